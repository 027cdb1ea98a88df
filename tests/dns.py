"""A real DNS server on loopback for discovery tests: UDP and TCP on 127.0.0.1, authoritative for
the names a test sets, records changed while it runs (dnslib's server; nothing mocks a resolver)."""

from __future__ import annotations

import socket
import threading
from types import TracebackType

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

TTL = 1  # seconds: discovery re-resolves on its own clock; a low TTL keeps caches honest
_QUIET = DNSLogger(log="-request,-reply,-truncated,-data,-recv,-send", prefix=False)  # errors only


class _Records(BaseResolver):  # type: ignore[misc]
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.names: dict[str, list[str]] = {}
        self.queries = 0

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        name = str(request.q.qname).rstrip(".").lower()
        with self.lock:
            self.queries += 1
            addresses = self.names.get(name)
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for address in addresses:
            is_v6 = ":" in address
            if request.q.qtype == (QTYPE.AAAA if is_v6 else QTYPE.A):
                reply.add_answer(
                    RR(
                        request.q.qname,
                        request.q.qtype,
                        rdata=AAAA(address) if is_v6 else A(address),
                        ttl=TTL,
                    )
                )
        return reply


class LoopbackDNS:
    """``with LoopbackDNS() as dns: dns.set("workers.test", ["127.0.0.1"])``; ``dns.server`` is
    ``127.0.0.1:PORT`` for the gateway's ``discovery.dns_servers``."""

    def __init__(self) -> None:
        self.records = _Records()
        self.port = _free_port()
        self.servers = [
            DNSServer(self.records, port=self.port, address="127.0.0.1", tcp=tcp, logger=_QUIET)
            for tcp in (False, True)
        ]

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def queries(self) -> int:
        return self.records.queries

    def set(self, name: str, addresses: list[str]) -> None:
        with self.records.lock:
            self.records.names[name.lower()] = list(addresses)

    def remove(self, name: str) -> None:
        with self.records.lock:
            self.records.names.pop(name.lower(), None)

    def __enter__(self) -> LoopbackDNS:
        for server in self.servers:
            server.start_thread()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for server in self.servers:
            server.stop()
            server.server.server_close()


def _free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError("no port free for both UDP and TCP on 127.0.0.1")
