"""Workers found by DNS (a Kubernetes headless Service): a worker entry's host resolves to many
addresses, each a replica of that entry, re-resolved every ``discovery_interval_s``. A new
address joins once its ``/health`` and ``/v1/info`` pass the checks a listed replica passes; an
address that disappears gets no new sessions while the sessions it holds finish (or fail over)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from urllib.parse import urlsplit, urlunsplit

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver
import httpx

from app.targets.channel import Breaker, Replica
from app.targets.failures import ReplicaFailure
from app.targets.replicas import ReplicaSet

log = logging.getLogger(__name__)

_HEALTH_TIMEOUT = httpx.Timeout(2.0)


class DiscoveryError(Exception):
    """A resolution that failed (timeout, no server): the replicas stay as they were."""


class Resolver:
    """A name's addresses: from ``servers`` (``host[:port]``, DNS over UDP/TCP), else the
    system's resolver (getaddrinfo: /etc/hosts, /etc/resolv.conf's servers and search domains)."""

    def __init__(self, servers: list[str], timeout_s: float = 2.0) -> None:
        self.servers, self.timeout_s = servers, timeout_s
        self._dns: dns.asyncresolver.Resolver | None = None
        if servers:
            self._dns = dns.asyncresolver.Resolver(configure=False)
            self._dns.nameservers = [dns.nameserver.Do53Nameserver(*_host_port(s)) for s in servers]
            self._dns.lifetime = timeout_s

    async def addresses(self, host: str) -> list[str]:
        """Every address of ``host``, sorted; [] when the name does not exist (no pod behind it)."""
        if _is_address(host):
            return [host]
        found = await (self._query(host) if self._dns is not None else self._getaddrinfo(host))
        return sorted(set(found), key=lambda a: (":" in a, a))

    async def _query(self, host: str) -> list[str]:
        assert self._dns is not None
        found: list[str] = []
        for kind in ("A", "AAAA"):
            try:
                answer = await self._dns.resolve(host, kind, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as exc:
                raise DiscoveryError(f"resolving {host} ({kind}): {exc}") from exc
            found += [record.address for record in answer]
        return found

    async def _getaddrinfo(self, host: str) -> list[str]:
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM), self.timeout_s
            )
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []
            raise DiscoveryError(f"resolving {host}: {exc}") from exc
        except TimeoutError as exc:
            raise DiscoveryError(f"resolving {host}: no answer in {self.timeout_s:g} s") from exc
        return [str(info[4][0]) for info in infos]


def replica_url(url: str, address: str) -> str:
    """``url`` with its host replaced by ``address`` (port and path kept)."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")


class Discovery:
    """Keeps one target's replicas equal to the addresses its URL's host resolves to."""

    def __init__(
        self, target: ReplicaSet, url: str, interval_s: float, resolver: Resolver, client: httpx.AsyncClient
    ) -> None:
        self.target, self.url, self.interval_s, self.resolver, self.client = (
            target,
            url.rstrip("/"),
            interval_s,
            resolver,
            client,
        )
        self.host = urlsplit(url).hostname or ""
        self.num_resolutions = 0
        self.last_error: str | None = None

    async def refresh(self) -> None:
        """One resolution: new addresses join once checked, vanished ones retire."""
        try:
            addresses = await self.resolver.addresses(self.host)
        except DiscoveryError as exc:
            self.last_error = str(exc)
            log.warning("worker %s: %s (its replicas stay as they are)", self.target.name, exc)
            return
        self.num_resolutions += 1
        self.last_error = None
        wanted = [replica_url(self.url, a) for a in addresses]
        for url in self.target.present_urls() - set(wanted):
            self.target.retire(url)
            log.info("worker %s: %s left %s: no new sessions", self.target.name, url, self.host)
        joining = [url for url in wanted if url not in self.target.present_urls()]
        await asyncio.gather(*(self._join(url) for url in joining))

    async def _join(self, url: str) -> None:
        replica = Replica(url, Breaker(self.target.threshold))
        try:
            health = self.target.dialect.health_path  # None: an engine whose check is its /v1/models
            resp = await self.client.get(f"{url}{health}", timeout=_HEALTH_TIMEOUT) if health else None
            if resp is not None and resp.status_code != 200:
                raise ReplicaFailure("status", f"{health} answered {resp.status_code}")
            await self.target.check(replica)
        except (httpx.HTTPError, ReplicaFailure) as exc:
            log.info("worker %s: %s (from %s) has not joined yet: %s", self.target.name, url, self.host, exc)
            return
        self.target.join(replica)
        log.info("worker %s: %s joined (from %s)", self.target.name, url, self.host)

    async def run(self) -> None:
        """Resolve every ``interval_s`` until cancelled (the first resolution: ``TargetSet.discover``)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()


def _host_port(server: str) -> tuple[str, int]:
    if server.startswith("["):  # [v6]:port
        host, _, port = server[1:].partition("]")
        return host, int(port.lstrip(":") or 53)
    if server.count(":") == 1:
        host, port = server.split(":")
        return host, int(port)
    return server, 53


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
