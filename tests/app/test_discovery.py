"""The resolver discovery uses, against a real DNS server on loopback (tests/dns.py) and the system's
resolver; the URLs it makes of addresses; and a target's replicas joining and leaving."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from app.targets.channel import Breaker, Channel, Expected, Replica
from app.targets.discovery import DiscoveryError, Resolver, replica_url
from app.targets.replicas import ReplicaSet
from app.targets.specgate import SpecgateDialect
from tests.dns import LoopbackDNS


def test_a_name_resolves_to_every_address_as_its_records_change() -> None:
    async def run(dns: LoopbackDNS) -> None:
        resolver = Resolver([dns.server])
        dns.set("pods.test", ["127.0.0.3", "127.0.0.2", "fd00::1"])
        # IPv4 first, sorted
        assert await resolver.addresses("pods.test") == ["127.0.0.2", "127.0.0.3", "fd00::1"]
        dns.set("pods.test", ["127.0.0.3"])
        assert await resolver.addresses("pods.test") == ["127.0.0.3"]
        dns.remove("pods.test")
        assert await resolver.addresses("pods.test") == []  # NXDOMAIN: no pod behind the name
        assert await resolver.addresses("10.1.2.3") == ["10.1.2.3"]  # an address is itself

    with LoopbackDNS() as dns:
        asyncio.run(run(dns))
        assert dns.queries >= 6  # A and AAAA each time: asked, not cached


def test_the_system_resolver_and_a_server_that_does_not_answer() -> None:
    async def run() -> None:
        # /etc/hosts, through getaddrinfo
        assert {"127.0.0.1", "::1"} & set(await Resolver([]).addresses("localhost"))
        assert await Resolver([]).addresses("no-such-host.invalid") == []
        with pytest.raises(DiscoveryError, match="resolving"):
            # discard port: no DNS there
            await Resolver(["127.0.0.1:9"], timeout_s=0.3).addresses("pods.test")

    asyncio.run(run())


def test_replica_urls_keep_the_port_and_path() -> None:
    assert replica_url("http://pods.test:8101/", "10.0.0.5") == "http://10.0.0.5:8101"
    assert replica_url("http://pods.test:8101/base", "fd00::1") == "http://[fd00::1]:8101/base"
    assert replica_url("https://pods.test", "10.0.0.5") == "https://10.0.0.5"


def test_a_leaving_replica_keeps_its_sessions_and_takes_no_new_ones() -> None:
    client = httpx.AsyncClient()
    expected = Expected(fingerprint="f", vocab_size=8)
    channel = Channel("w", client, httpx.Timeout(1.0), None, None)
    target = ReplicaSet(
        "w",
        ["http://pods.test:8101"],
        1.0,
        channel,
        SpecgateDialect("w", channel, expected),
        expected,
        3,
        discovered=True,
    )
    assert target.replicas == [] and target.url == "http://pods.test:8101"
    a, b = (Replica(f"http://127.0.0.{i}:8101", Breaker(3)) for i in (2, 3))
    target.join(a)
    target.join(b)
    target.sessions["s"] = a
    target.retire(a.url)
    assert target.present_urls() == {b.url} and a in target.replicas and a.retired  # it holds "s"
    del target.sessions["s"]  # its session ended: the next change of the list drops a
    target.retire(a.url)
    assert target.replicas == [b]
    target.join(Replica(a.url, Breaker(3)))  # back in the records: a replica again
    assert target.present_urls() == {a.url, b.url}
    asyncio.run(client.aclose())
