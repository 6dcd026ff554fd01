"""Backend discovery: DNS names answered by a DNS server the test controls, and an endpoints file.

Fake vLLM backends listen on several loopback addresses (127.0.0.2, .3, ...) sharing one port per
role, as a Kubernetes headless Service's pods share their container port; the DNS server
(pd_proxy.testing.dns) maps the test's names to those addresses and the test edits its records
while the proxy runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pd_proxy import cli, scheduler
from pd_proxy.api.app import build_app, make_runner
from pd_proxy.api.startup_checks import validate
from pd_proxy.backends.pool import BackendPool
from pd_proxy.config import ConfigError, ProxyConfig, build_parser, load_config
from pd_proxy.discovery.endpoints_file import EndpointsFileError, parse_endpoints
from pd_proxy.discovery.watch import DiscoveryError, DnsWatch, system_resolver
from pd_proxy.testing.dns import (
    AAAA,
    A,
    DnsError,
    DnsServer,
    UdpResolver,
    build_query,
    build_response,
    parse_query,
    parse_response,
)
from pd_proxy.testing.fake_model import DECODE, PREFILL
from tests.proxy.discovery_helpers import HOSTS, WAIT_S, complete, find, fleet, url
from tests.proxy.proxy_harness import Stack
from tests.support.waits import until

P_NAME, D_NAME = "prefill.pd.test", "decode.pd.test"
FAST = {"health_interval": 0.1, "discovery_interval": 0.05}
# The test resolver's wait for an answer from the DNS server on this same event loop: an answer
# comes within a few turns of it, but a loaded host may stall those past a short limit, and a
# spurious "no answer" is a discovery error. Long where no name is silent (it costs nothing);
# where one is, as long as the silent rounds can afford.
ANSWER_S = 2.0


# ---------------------------------------------------------------------------------- helpers
async def polls(s: Stack, n: int) -> None:
    """Wait for ``n`` more complete discovery rounds."""
    discovery = s.proxy.discovery
    target = discovery.polls + n
    await until(lambda: discovery.polls >= target, f"{n} discovery rounds")


@asynccontextmanager
async def dns_server(records: dict[str, list[str]]) -> AsyncIterator[DnsServer]:
    server = DnsServer(records)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def proxy(resolver=None, **options) -> AsyncIterator[Stack]:
    """A proxy on an ephemeral loopback port, with fast health checks and discovery."""
    config = ProxyConfig(host="127.0.0.1", port=0, **{**FAST, **options})
    app = build_app(config, resolver)
    runner = make_runner(app, config)
    session = None
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        session = aiohttp.ClientSession()
        yield Stack(f"http://{host}:{port}", [], [], app, session)
    finally:
        if session is not None:
            await session.close()
        await runner.cleanup()


def gauge(s: Stack, role: str) -> dict[str, float | None]:
    return {
        state: s.sample("pd_proxy_backends", {"role": role, "state": state})
        for state in ("healthy", "unhealthy", "draining")
    }


def warnings_about(caplog, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


# ---------------------------------------------------------------------------------- DNS wire code
def test_query_bytes_match_rfc_1035():
    query = build_query(0x1234, "svc.pd.test", A)
    expected = (
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"  # id, RD, one question
        b"\x03svc\x02pd\x04test\x00"
        b"\x00\x01\x00\x01"  # A, IN
    )
    assert query == expected
    assert parse_query(query)[:3] == (0x1234, "svc.pd.test", A)


def test_response_answers_only_the_asked_family_with_a_compressed_name():
    query = build_query(7, "svc.pd.test", AAAA)
    reply = build_response(query, ["10.0.0.1", "fd00::5"], ttl=5)
    header = struct.unpack("!HHHHHH", reply[:12])
    assert header == (7, 0x8180, 1, 1, 0, 0)
    answer = reply[len(query) :]
    assert answer[:2] == b"\xc0\x0c"  # points at the question's name
    assert struct.unpack("!HHIH", answer[2:12]) == (AAAA, 1, 5, 16)
    assert parse_response(reply, 7, AAAA) == ["fd00::5"]
    with pytest.raises(DnsError, match="not the response"):
        parse_response(reply, 8, AAAA)


def test_response_parser_follows_pointers_and_skips_other_records():
    """A recursive server's usual shape: a CNAME, then the address under the CNAME's target."""
    query = build_query(9, "web.pd.test", A)
    cname_target = b"\x03pod\xc0\x10"  # "pod" + pointer to "pd.test" inside the question
    records = (
        b"\xc0\x0c"
        + struct.pack("!HHIH", 5, 1, 30, len(cname_target))
        + cname_target
        # The address record's name is a pointer to the CNAME target (offset 12 + 17 + 12).
        + b"\xc0\x29"
        + struct.pack("!HHIH", A, 1, 30, 4)
        + bytes([10, 1, 2, 3])
    )
    reply = struct.pack("!HHHHHH", 9, 0x8180, 1, 2, 0, 0) + query[12:] + records
    assert parse_response(reply, 9, A) == ["10.1.2.3"]
    nx = build_response(query, [], rcode=3)
    with pytest.raises(DnsError, match="NXDOMAIN"):
        parse_response(nx, 9, A)
    looping = struct.pack("!HHHHHH", 9, 0x8180, 0, 1, 0, 0) + b"\xc0\x0c"
    with pytest.raises(DnsError):
        parse_response(looping, 9, A)


async def test_udp_resolver_against_the_test_server():
    async with dns_server({"svc.pd.test": ["127.0.0.2", "::1"], "empty.pd.test": []}) as server:
        resolve = UdpResolver(server.address, timeout=1.0)  # one silent lookup below
        assert await resolve("svc.pd.test") == ["127.0.0.2", "::1"]
        assert await resolve("SVC.pd.test.") == ["127.0.0.2", "::1"]  # case, trailing dot
        assert await resolve("empty.pd.test") == []
        with pytest.raises(DnsError, match="NXDOMAIN"):
            await resolve("gone.pd.test")
        server.servfail.add("svc.pd.test")
        with pytest.raises(DnsError, match="SERVFAIL"):
            await resolve("svc.pd.test")
        server.silent.add("empty.pd.test")
        with pytest.raises(asyncio.TimeoutError):
            await resolve("empty.pd.test")
        assert ("svc.pd.test", A) in server.queries and ("svc.pd.test", AAAA) in server.queries


async def test_system_resolver_is_the_default_and_resolves_without_dns():
    assert await system_resolver("127.0.0.9") == ["127.0.0.9"]
    assert "127.0.0.1" in await system_resolver("localhost")
    async with fleet(PREFILL, ("127.0.0.1",)) as (pp, _), fleet(DECODE, ("127.0.0.1",)) as (dp, _):
        async with proxy(prefill_dns=f"localhost:{pp}", decode_dns=f"localhost:{dp}") as s:
            assert url("127.0.0.1", pp) in {b.url for b in s.proxy.prefill_pool.backends}
            assert await complete(s) is None


async def test_a_hung_lookup_is_waited_on_again_not_started_twice():
    """getaddrinfo cannot be cancelled (it holds a thread): polls must not pile lookups up."""
    calls: list[str] = []
    release = asyncio.Event()

    async def hung(host: str) -> list[str]:
        calls.append(host)
        await release.wait()
        return ["10.0.0.7", "fe80::1%eth0", "fd00::7"]

    watch = DnsWatch("decode", "svc.pd.test:8200", hung, timeout=0.05)
    for _ in range(3):
        with pytest.raises(DiscoveryError, match="no answer within 0.05s"):
            await watch.poll()
    assert calls == ["svc.pd.test"]
    release.set()
    found = await watch.poll()  # the same lookup, now answered; the scoped address is skipped
    assert found == {"decode": ["http://10.0.0.7:8200", "http://[fd00::7]:8200"]}
    assert await watch.poll() == found and calls == ["svc.pd.test"] * 2

    async def failing(host: str) -> list[str]:
        raise OSError(-2, "Name or service not known")

    with pytest.raises(DiscoveryError, match="Name or service not known"):
        await DnsWatch("decode", "svc.pd.test:8200", failing).poll()


# ---------------------------------------------------------------------------------- pool
def test_pool_update_joins_unhealthy_drains_and_reaps_only_idle_backends():
    pool = BackendPool("decode", ("http://static:1",))
    added = pool.update("dns", ["http://a:1", "http://b:1"])
    assert [b.url for b in added] == ["http://a:1", "http://b:1"]
    assert not any(b.healthy for b in added)  # no request before a check passes
    assert scheduler.pick(pool).url == "http://static:1"
    a, b = added
    a.healthy = b.healthy = True
    b.outstanding = 2
    assert pool.update("dns", ["http://a:1"]) == []
    assert [x.url for x in pool.draining] == ["http://b:1"] and b.draining
    assert all(scheduler.pick(pool) is not b for _ in range(5))
    assert pool.reap() == []  # still busy
    b.outstanding = 0
    assert pool.reap() == [b] and pool.draining == []
    pool.update("dns", [])  # only the static URL is left wanted
    assert [x.url for x in pool.backends] == ["http://static:1"]
    a.outstanding = 1
    assert pool.update("dns", ["http://a:1"]) == []  # back while draining: serves again
    assert pool.draining == [] and not a.draining and find(pool, "http://a:1") is a
    assert (pool.count("healthy"), pool.count("unhealthy"), pool.count("draining")) == (2, 0, 0)


# ---------------------------------------------------------------------------------- DNS
async def test_scale_up_new_address_gets_traffic_once_healthy():
    async with (
        fleet(PREFILL, HOSTS[:2]) as (pp, prefills),
        fleet(DECODE, HOSTS[:2]) as (dp, decodes),
        dns_server({P_NAME: [HOSTS[0]], D_NAME: [HOSTS[0]]}) as server,
    ):
        resolver = UdpResolver(server.address, timeout=ANSWER_S)
        async with proxy(resolver, prefill_dns=f"{P_NAME}:{pp}", decode_dns=f"{D_NAME}:{dp}") as s:
            pool = s.proxy.decode_pool
            for i in range(4):
                assert await complete(s, i) is None
            assert len(decodes[HOSTS[0]].seen) == 4

            new = url(HOSTS[1], dp)
            decodes[HOSTS[1]].knobs.healthy = False  # up, but its /health says not ready
            server.records[D_NAME] = [HOSTS[0], HOSTS[1]]
            await until(lambda: find(pool, new) is not None, "the new address to join")
            await polls(s, 3)
            await s.running.checker.check_all()  # a full round has certainly seen it
            assert find(pool, new).healthy is False
            for i in range(6):
                assert await complete(s, i) is None
            assert decodes[HOSTS[1]].seen == []  # not before it is healthy
            status, raw = await s.get("/health")
            assert status == 200 and json.loads(raw)["down"] == [new]

            decodes[HOSTS[1]].knobs.healthy = True
            await until(lambda: find(pool, new).healthy, "the new decode backend to pass a check")
            for i in range(8):
                assert await complete(s, i, stream=i % 2 == 0) is None
            assert len(decodes[HOSTS[1]].seen) == 4  # least outstanding, ties rotate
            assert s.sample("pd_proxy_backend_healthy", {"role": "decode", "backend": new}) == 1

            server.records[P_NAME] = list(HOSTS[:2])  # a healthy joiner serves after one check
            await until(
                lambda: getattr(find(s.proxy.prefill_pool, url(HOSTS[1], pp)), "healthy", 0),
                "the new prefill backend to pass a check",
            )
            for i in range(4):
                assert await complete(s, i) is None
            assert len(prefills[HOSTS[1]].seen) == 2
            assert gauge(s, "decode") == {"healthy": 2, "unhealthy": 0, "draining": 0}
            assert (
                s.sample("pd_proxy_discovery_errors_total", {"role": "decode", "source": "dns"})
                == 0
            )


async def test_scale_down_mid_load_loses_no_request(caplog):
    """200 requests at concurrency 16; one address of each role leaves half-way."""
    caplog.set_level(logging.INFO, logger="pd_proxy.routing.pool")
    total, concurrency, remove_after, gated_from = 200, 16, 40, 120
    async with (
        fleet(PREFILL) as (pp, prefills),
        fleet(DECODE) as (dp, decodes),
        dns_server({P_NAME: list(HOSTS), D_NAME: list(HOSTS)}) as server,
    ):
        leaving = HOSTS[1]
        for fake in decodes.values():
            fake.knobs.token_delay = 0.002
        decodes[leaving].knobs.token_delay = 0.1  # a stream of its outlives the DNS change
        resolver = UdpResolver(server.address, timeout=ANSWER_S)
        async with proxy(resolver, prefill_dns=f"{P_NAME}:{pp}", decode_dns=f"{D_NAME}:{dp}") as s:
            pools = (s.proxy.prefill_pool, s.proxy.decode_pool)
            gone_urls = (url(leaving, pp), url(leaving, dp))
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(total):
                queue.put_nowait(i)
            failures: list[str] = []
            done: list[int] = []
            dropped = asyncio.Event()
            seen_at_drop: list[int] = []

            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    if i >= gated_from:  # these run only once the removed backends are gone
                        await asyncio.wait_for(dropped.wait(), WAIT_S)
                    problem = await complete(s, i, stream=i % 2 == 0, n=4)
                    if problem:
                        failures.append(problem)
                    done.append(i)

            async def scale_down() -> None:
                slow = decodes[leaving]
                await until(  # removed with a stream of its in flight, whatever the host's speed
                    lambda: (
                        len(done) >= remove_after
                        and len(slow.seen) > slow.completed + len(slow.cancelled)
                    ),
                    "the first requests, and one in flight on the leaving decode",
                )
                server.records[P_NAME] = [h for h in HOSTS if h != leaving]
                server.records[D_NAME] = [h for h in HOSTS if h != leaving]
                await until(
                    lambda: all(find(p, u) is None for p, u in zip(pools, gone_urls, strict=True)),
                    "the removed backends to drain and drop",
                )
                seen_at_drop.extend((len(prefills[leaving].seen), len(decodes[leaving].seen)))
                await prefills[leaving].stop()  # the pod goes away for good
                await decodes[leaving].stop()
                dropped.set()

            await asyncio.gather(scale_down(), *(worker() for _ in range(concurrency)))

            assert failures == []
            assert sorted(done) == list(range(total))
            assert [len(prefills[leaving].seen), len(decodes[leaving].seen)] == seen_at_drop
            assert all(n > 0 for n in seen_at_drop)  # it did serve before it left
            assert decodes[leaving].cancelled == []  # its in-flight streams were not cut short
            remaining = [decodes[h] for h in HOSTS if h != leaving]
            assert sum(f.completed for f in remaining) + decodes[leaving].completed == total
            assert all(f.completed > 0 for f in remaining)
            drains = [
                r.getMessage()
                for r in caplog.records
                if "draining" in r.getMessage() and url(leaving, dp) in r.getMessage()
            ]
            assert drains and "(0 in flight)" not in drains[0], drains
            assert gauge(s, "decode") == {"healthy": 2, "unhealthy": 0, "draining": 0}
            labels = {"role": "decode", "backend": url(leaving, dp)}
            assert s.sample("pd_proxy_backend_healthy", labels) is None  # its series went too
            assert s.sample("pd_proxy_in_flight_requests") == 0


async def test_name_that_stops_resolving_keeps_the_pool(caplog):
    caplog.set_level(logging.INFO, logger="pd_proxy.discovery.watch")
    async with (
        fleet(PREFILL, HOSTS[:1]) as (pp, _),
        fleet(DECODE, HOSTS[:2]) as (dp, decodes),
        dns_server({P_NAME: [HOSTS[0]], D_NAME: list(HOSTS[:2])}) as server,
    ):
        resolver = UdpResolver(server.address, timeout=0.5)  # each silent round waits it
        async with proxy(resolver, prefill_dns=f"{P_NAME}:{pp}", decode_dns=f"{D_NAME}:{dp}") as s:
            pool = s.proxy.decode_pool
            before = sorted(b.url for b in pool.backends)
            errors = {"role": "decode", "source": "dns"}
            label = f"decode DNS name {D_NAME}:{dp}"
            assert s.sample("pd_proxy_discovery_errors_total", errors) == 0

            for outage, reason in (
                (lambda: server.records.pop(D_NAME), "NXDOMAIN"),
                (lambda: server.records.__setitem__(D_NAME, []), "resolves to no addresses"),
                (lambda: server.silent.add(D_NAME), "no answer within"),
            ):
                counted = s.sample("pd_proxy_discovery_errors_total", errors)
                outage()
                await polls(s, 4)
                assert sorted(b.url for b in pool.backends) == before
                assert pool.draining == []
                for i in range(4):
                    assert await complete(s, i) is None
                status, _ = await s.get("/health")
                assert status == 200
                # The first of those rounds may have resolved just before the change.
                assert s.sample("pd_proxy_discovery_errors_total", errors) >= counted + 3
                found = warnings_about(caplog, label)
                assert len(found) == 1 and reason in found[0], found  # once per outage
                assert "keeping the last known backends (decode: 2)" in found[0]
                caplog.clear()
                server.records[D_NAME] = list(HOSTS[:2])
                server.silent.clear()
                await polls(s, 2)
                assert any("works again" in r.getMessage() for r in caplog.records)
                caplog.clear()
            assert (
                s.sample("pd_proxy_discovery_errors_total", {"role": "prefill", "source": "dns"})
                == 0
            )
            assert all(len(f.seen) > 0 for f in decodes.values())


async def test_name_missing_at_start_is_not_fatal_and_joins_later(caplog):
    """Kubernetes may start the proxy before any decode pod is ready (NXDOMAIN until then)."""
    caplog.set_level(logging.INFO, logger="pd_proxy.discovery.watch")
    async with (
        fleet(PREFILL, HOSTS[:1]) as (pp, _),
        fleet(DECODE, HOSTS[:1]) as (dp, _),
        dns_server({P_NAME: [HOSTS[0]]}) as server,
    ):
        resolver = UdpResolver(server.address, timeout=ANSWER_S)
        async with proxy(resolver, prefill_dns=f"{P_NAME}:{pp}", decode_dns=f"{D_NAME}:{dp}") as s:
            status, raw = await s.get("/health")
            assert status == 503 and "no healthy decode backend" in raw.decode()
            status, _, _ = await s.post("/v1/completions", {"prompt": "x"})
            assert status == 503
            found = warnings_about(caplog, f"decode DNS name {D_NAME}:{dp}")
            assert len(found) == 1 and "NXDOMAIN" in found[0], found
            server.records[D_NAME] = [HOSTS[0]]
            await until(lambda: s.proxy.decode_pool.healthy(), "the decode backend to join")
            assert await complete(s) is None
            status, _ = await s.get("/health")
            assert status == 200


# ---------------------------------------------------------------------------------- endpoints file
def write_atomically(path: Path, text: str) -> None:
    """How the file should be edited in production: write aside, then rename over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def endpoints_yaml(prefill: list[str], decode: list[str]) -> str:
    lines = ["# written by the test", "endpoints:"]
    lines += [f"  - {{role: prefill, url: '{u}'}}" for u in prefill]
    for u in decode:  # the address/port form for decode
        host, port = u.removeprefix("http://").rsplit(":", 1)
        lines += [
            "  - name: decode",
            "    role: decode",
            f"    address: {host}",
            f"    port: {port}",
        ]
    return "\n".join(lines) + "\n" if prefill or decode else "endpoints: []\n"


async def test_endpoints_file_add_remove_and_bad_edits(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pd_proxy.discovery.watch")
    async with fleet(PREFILL, HOSTS[:1]) as (pp, _), fleet(DECODE, HOSTS[:2]) as (dp, decodes):
        p0, d0, d1 = url(HOSTS[0], pp), url(HOSTS[0], dp), url(HOSTS[1], dp)
        path = tmp_path / "endpoints.yaml"
        path.write_text(endpoints_yaml([p0], [d0]))
        async with proxy(endpoints_file=str(path)) as s:
            pool = s.proxy.decode_pool
            assert [b.url for b in pool.backends] == [d0]
            # A discovered backend joins unhealthy until a check passes; on a loaded host the
            # first round can end after start-up's bounded wait for it.
            await until(lambda: pool.backends[0].healthy, "d0 to pass its first check")
            for i in range(2):
                assert await complete(s, i) is None

            write_atomically(path, endpoints_yaml([p0], [d0, d1]))
            await until(lambda: getattr(find(pool, d1), "healthy", False), "d1 to join and pass")
            for i in range(4):
                assert await complete(s, i) is None
            assert len(decodes[HOSTS[1]].seen) == 2

            write_atomically(path, endpoints_yaml([p0], [d1]))
            await until(lambda: find(pool, d0) is None, "d0 to drain and drop")
            seen = len(decodes[HOSTS[0]].seen)
            for i in range(4):
                assert await complete(s, i) is None
            assert len(decodes[HOSTS[0]].seen) == seen and len(decodes[HOSTS[1]].seen) == 6

            errors = {"role": "decode", "source": "file"}
            counted = s.sample("pd_proxy_discovery_errors_total", errors)
            for bad, reason in (
                ("endpoints:\n  - {role: decode, url: http://x:1\n", "not valid YAML"),
                ("endpoints:\n  - {rol: decode, url: 'http://x:1'}\n", "unknown keys rol"),
                ("", "must be a mapping"),
            ):
                caplog.clear()
                write_atomically(path, bad)
                await polls(s, 3)
                assert [b.url for b in pool.backends] == [d1]
                assert await complete(s) is None
                found = warnings_about(caplog, f"endpoints file {path}")
                assert len(found) == 1 and reason in found[0], found
            assert s.sample("pd_proxy_discovery_errors_total", errors) >= counted + 6

            caplog.clear()
            write_atomically(path, endpoints_yaml([p0], []))  # valid, but no decode left
            await polls(s, 3)
            assert [b.url for b in pool.backends] == [d1] and pool.draining == []
            found = warnings_about(caplog, "lists no decode endpoint")
            assert len(found) == 1, found
            write_atomically(path, endpoints_yaml([p0], [d0]))
            await until(lambda: find(pool, d1) is None, "d1 to drop once d0 is listed")
            # d0 joins again unhealthy until a check passes (on a loaded host, after d1 left).
            await until(lambda: getattr(find(pool, d0), "healthy", False), "d0 to pass")
            assert await complete(s) is None


def test_endpoints_parser_accepts_both_forms_and_json():
    text = """
endpoints:
  - {name: a, role: prefill, url: "http://10.0.0.5:8100/"}
  - {role: prefill, url: "http://10.0.0.5:8100"}
  - {role: decode, address: fd00::6, port: "8200"}
  - {role: decode, address: node-7.lan, port: 8200}
"""
    assert parse_endpoints(text) == {
        "prefill": ("http://10.0.0.5:8100",),
        "decode": ("http://[fd00::6]:8200", "http://node-7.lan:8200"),
    }
    doc = {"endpoints": [{"role": "decode", "url": "https://d:1"}]}
    assert parse_endpoints(json.dumps(doc), json_format=True) == {
        "prefill": (),
        "decode": ("https://d:1",),
    }
    assert parse_endpoints("endpoints: []") == {"prefill": (), "decode": ()}


def test_endpoints_file_in_json_or_yaml_reads_the_same():
    yaml_text = "endpoints:\n  - {role: decode, url: 'http://d:1'}\n"
    json_text = '{"endpoints": [{"role": "decode", "url": "http://d:1"}]}'
    assert parse_endpoints(yaml_text) == parse_endpoints(json_text, json_format=True)
    assert parse_endpoints(json_text, json_format=True)["decode"] == ("http://d:1",)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("endpoints: [{role: decoder, url: 'http://d:1'}]", "role must be prefill or decode"),
        ("endpoints: [{role: decode}]", "needs a url"),
        ("endpoints: [{role: decode, address: d, port: http}]", "port must be a number"),
        ("endpoints: [{role: decode, url: 'd:1'}]", "must look like http"),
        ("endpoints: [{role: decode, url: 'http://d:1', port: 2}]", "not both"),
        ("endpoints: [{role: decode, url: 'http://d:1', labels: {}}]", "unknown keys labels"),
        ("backends: []", "must be a mapping with an 'endpoints' list"),
        ("endpoints: []\nextra: 1", "unknown top-level keys"),
        ("endpoints: [http://d:1]", "endpoints[0] must be a mapping"),
    ],
)
def test_endpoints_parser_rejects_mistakes(text, message):
    with pytest.raises(EndpointsFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_endpoints(text)


# ---------------------------------------------------------------------------------- gauge
async def test_backends_gauge_counts_healthy_unhealthy_and_draining():
    async with (
        fleet(PREFILL, HOSTS[:1]) as (pp, prefills),
        fleet(DECODE, HOSTS[:2]) as (dp, decodes),
        dns_server({D_NAME: list(HOSTS[:2])}) as server,
    ):
        busy, sick = decodes[HOSTS[0]], decodes[HOSTS[1]]
        sick.knobs.healthy = False
        resolver = UdpResolver(server.address, timeout=ANSWER_S)
        static = url(HOSTS[0], pp)  # a fixed prefill URL next to discovered decode backends
        async with proxy(resolver, prefill=(static,), decode_dns=f"{D_NAME}:{dp}") as s:
            assert gauge(s, "prefill") == {"healthy": 1, "unhealthy": 0, "draining": 0}
            assert gauge(s, "decode") == {"healthy": 1, "unhealthy": 1, "draining": 0}

            busy.knobs.token_delay = 0.1
            request = asyncio.create_task(complete(s, stream=True, n=5))
            pool = s.proxy.decode_pool
            backend = find(pool, url(HOSTS[0], dp))
            await until(lambda: backend.outstanding == 1, "the stream to start")
            server.records[D_NAME] = [HOSTS[1]]
            await until(lambda: backend.draining, "the busy backend to start draining")
            assert gauge(s, "decode") == {"healthy": 0, "unhealthy": 1, "draining": 1}
            status, raw = await s.get("/health")
            health = json.loads(raw)
            assert status == 503 and health["draining"] == [backend.url]
            assert backend.url not in health["down"]
            assert await request is None  # the in-flight stream finished whole
            await until(lambda: find(pool, backend.url) is None, "the drained backend to drop")
            assert gauge(s, "decode") == {"healthy": 0, "unhealthy": 1, "draining": 0}
            text = (await s.get("/metrics"))[1].decode()
            assert 'pd_proxy_backends{role="decode",state="draining"} 0.0' in text
            assert "# TYPE pd_proxy_discovery_errors_total counter" in text
            labels = {"role": "decode", "backend": backend.url}
            assert s.sample("pd_proxy_backend_healthy", labels) is None
            assert len(prefills[HOSTS[0]].seen) == 1


# ---------------------------------------------------------------------------------- config
P = "http://127.0.0.1:16801"
D = "http://127.0.0.1:16802"


def test_dns_names_and_file_make_the_urls_optional(tmp_path):
    c = load_config([], {"PD_PROXY_PREFILL_DNS": "pcp-pd-prefill:8100", "PD_PROXY_DECODE": D})
    assert c.prefill == () and c.prefill_dns == "pcp-pd-prefill:8100" and c.decode == (D,)
    c = load_config(
        ["--prefill-dns", "pcp-pd-prefill.default.svc.cluster.local.:8100",
         "--decode-dns", "[fd00::1]:8200", "--discovery-interval", "0.5"],
        {},
    )  # fmt: skip
    assert c.prefill_dns == "pcp-pd-prefill.default.svc.cluster.local.:8100"
    assert c.decode_dns == "[fd00::1]:8200" and c.discovery_interval == 0.5
    assert c.discovery and c.sources("decode") == ["dns:[fd00::1]:8200"]
    path = tmp_path / "endpoints.json"
    path.write_text(json.dumps({"endpoints": [{"role": "decode", "url": D}]}))
    env = {"PD_PROXY_PREFILL": P, "PD_PROXY_ENDPOINTS_FILE": str(path)}
    c = load_config([], env)
    assert c.endpoints_file == str(path) and c.decode == ()
    assert c.sources("prefill") == [P, f"file:{path}"]
    assert not load_config([], {"PD_PROXY_PREFILL": P, "PD_PROXY_DECODE": D}).discovery


@pytest.mark.parametrize(
    "value",
    ["pcp-pd-prefill", "pcp-pd-prefill:", ":8100", "host:0", "host:65536", "host:http",
     "http://host:8100", "host name:8100", "-host:8100", "fd00::1:8100", "[nope]:8100",
     "[fd00::1]8100", "a..b:8100"],
)  # fmt: skip
def test_bad_dns_target_is_a_config_error(value):
    with pytest.raises(ConfigError, match="--decode-dns"):
        load_config([], {"PD_PROXY_PREFILL": P, "PD_PROXY_DECODE_DNS": value})


def test_role_without_any_source_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no decode backend.*--decode-dns.*--endpoints-file"):
        load_config([], {"PD_PROXY_PREFILL_DNS": "p:1"})
    path = tmp_path / "endpoints.yaml"
    path.write_text(f"endpoints: [{{role: prefill, url: '{P}'}}]\n")
    with pytest.raises(ConfigError, match="no decode backend"):  # the file covers prefill only
        validate(load_config(["--endpoints-file", str(path)], {}))
    c = load_config(["--endpoints-file", str(path), "--decode-dns", "d:1"], {})
    assert c.prefill == () and c.decode_dns == "d:1"


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read it"), ("endpoints: [{role: x}]", "role must be")],
)
def test_bad_endpoints_file_is_a_config_error(tmp_path, content, message):
    path = tmp_path / "endpoints.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"--endpoints-file.*{message}"):
        validate(load_config(["--endpoints-file", str(path), "--prefill", P, "--decode", D], {}))
    with pytest.raises(ConfigError, match="discovery_interval"):
        load_config(
            [], {"PD_PROXY_PREFILL": P, "PD_PROXY_DECODE": D, "PD_PROXY_DISCOVERY_INTERVAL": "0"}
        )


def test_help_documents_the_discovery_options():
    text = build_parser().format_help()
    for flag, env in [
        ("--prefill-dns", "PD_PROXY_PREFILL_DNS"),
        ("--decode-dns", "PD_PROXY_DECODE_DNS"),
        ("--endpoints-file", "PD_PROXY_ENDPOINTS_FILE"),
        ("--discovery-interval", "PD_PROXY_DISCOVERY_INTERVAL"),
    ]:
        assert flag in text and env in text


def test_console_script_rejects_a_dns_name_without_port_with_exit_2():
    package_root = str(Path(cli.__file__).resolve().parents[1])
    env = {
        "PYTHONPATH": package_root,
        "PD_PROXY_PREFILL_DNS": "pcp-pd-prefill",
        "PD_PROXY_DECODE": D,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pd_proxy"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "PD_PROXY_PREFILL_DNS" in proc.stderr and "missing port" in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_discovery_task_stops_with_the_app():
    async with fleet(PREFILL, HOSTS[:1]) as (pp, _), fleet(DECODE, HOSTS[:1]) as (dp, _):
        async with dns_server({P_NAME: [HOSTS[0]]}) as server:
            resolver = UdpResolver(server.address, timeout=ANSWER_S)
            async with proxy(resolver, prefill_dns=f"{P_NAME}:{pp}", decode=(url(HOSTS[0], dp),)):
                names = {t.get_name() for t in asyncio.all_tasks()}
                assert "pd-proxy-discovery" in names
    names = {t.get_name() for t in asyncio.all_tasks()}
    assert "pd-proxy-discovery" not in names and "pd-proxy-health" not in names
