"""Backends from Kubernetes EndpointSlices, watched through an API server that speaks the real
protocol (tests/proxy/fake_kube_api.py) over TLS, with the pod's in-cluster credentials, driven by
EndpointSlice watch events (tests/proxy/data/endpointslices.json).

Fake vLLM backends listen on loopback addresses sharing one port per role, as a Service's pods share
their container port; the events' pod IPs are swapped for those addresses.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pd_proxy.api.app import build_app, make_runner
from pd_proxy.api.startup_checks import validate
from pd_proxy.config import ConfigError, ProxyConfig, build_parser, load_config
from pd_proxy.config.service_ref import ServiceRef, parse_service_ref
from pd_proxy.discovery import kube_api
from pd_proxy.discovery.k8s_service import EndpointSliceWatch, slice_endpoints
from pd_proxy.discovery.kube_api import InCluster, KubeConfigError
from pd_proxy.testing.fake_model import DECODE, PREFILL
from tests.proxy.discovery_helpers import complete, find, fleet, url
from tests.proxy.fake_kube_api import FakeKubeApi
from tests.proxy.proxy_harness import Stack
from tests.support.waits import until

EVENTS = json.loads((Path(__file__).parent / "data" / "endpointslices.json").read_text())
NAMESPACE = EVENTS["namespace"]
TOKEN = "eyJhbGciOiJSUzI1NiJ9.first"
PREFILL_IPS = {"10.244.1.11": "127.0.0.2", "10.244.2.12": "127.0.0.3"}
DECODE_IPS = {
    "10.244.1.21": "127.0.0.2",
    "10.244.2.22": "127.0.0.3",
    "10.244.3.23": "127.0.0.4",
    "10.244.4.24": "127.0.0.5",
}
DECODE_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
# Health checks fast; the poll interval long, so only the watch's wake-up can explain a prompt
# reaction to an event.
OPTIONS = {"health_interval": 0.1, "discovery_interval": 60.0}
SERVICES = {
    "prefill_k8s_service": "pcp-pd-prefill:http",
    "decode_k8s_service": "pcp-pd-decode:http",
}


# ---------------------------------------------------------------------------------- helpers
def localize(event: dict[str, Any], ports: dict[str, int]) -> dict[str, Any]:
    """The event with loopback addresses and the fakes' ports instead of the pods'."""
    event = copy.deepcopy(event)
    obj = event["object"]
    service = obj["metadata"]["labels"]["kubernetes.io/service-name"]
    ips = PREFILL_IPS if service == "pcp-pd-prefill" else DECODE_IPS
    for endpoint in obj.get("endpoints") or []:
        endpoint["addresses"] = [ips[a] for a in endpoint["addresses"]]
    for port in obj.get("ports") or []:
        port["port"] = ports[service]
    return event


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as the cluster CA and the API server's cert."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found: it makes the API server's TLS certificate")
    cert, key = folder / "ca.crt", folder / "apiserver.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=kube-apiserver", "-addext",
         "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


class Cluster:
    """The fake API server plus this process set up as a pod of it (env, ServiceAccount files)."""

    def __init__(self, api: FakeKubeApi, sa_dir: Path, ports: dict[str, int]) -> None:
        self.api = api
        self.sa_dir = sa_dir
        self.ports = ports

    def apply(self, *events: dict[str, Any]) -> None:
        for event in events:
            self.api.apply(localize(event, self.ports))

    def rotate_token(self, token: str) -> None:
        (self.sa_dir / "token").write_text(token + "\n")
        self.api.token = token


@asynccontextmanager
async def cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ports: dict[str, int]
) -> AsyncIterator[Cluster]:
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    api = FakeKubeApi(NAMESPACE, TOKEN, ssl_context=context)
    await api.start()
    try:
        sa_dir = tmp_path / "serviceaccount"
        sa_dir.mkdir()
        (sa_dir / "token").write_text(TOKEN + "\n")
        (sa_dir / "namespace").write_text(NAMESPACE)
        shutil.copy(cert, sa_dir / "ca.crt")
        host, port = api.url.removeprefix("https://").rsplit(":", 1)
        monkeypatch.setattr(kube_api, "SERVICE_ACCOUNT_DIR", sa_dir)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
        c = Cluster(api, sa_dir, ports)
        c.apply(*EVENTS["initial"])
        yield c
    finally:
        await api.stop()


@asynccontextmanager
async def proxy(**options: Any) -> AsyncIterator[Stack]:
    config = ProxyConfig(host="127.0.0.1", port=0, **{**OPTIONS, **SERVICES, **options})
    app = build_app(config)
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


@asynccontextmanager
async def deployment(tmp_path, monkeypatch, decode_hosts=DECODE_HOSTS[:3], **options: Any):
    """Two prefill and three decode fakes, the API server listing them, and the proxy."""
    async with (
        fleet(PREFILL, ("127.0.0.2", "127.0.0.3")) as (pp, prefills),
        fleet(DECODE, decode_hosts) as (dp, decodes),
        cluster(tmp_path, monkeypatch, {"pcp-pd-prefill": pp, "pcp-pd-decode": dp}) as c,
        proxy(**options) as s,
    ):
        await until(lambda: len(s.proxy.decode_pool.healthy()) == 3, "three healthy decodes")
        yield s, c, prefills, decodes, dp


def watch_of(s: Stack, role: str):
    return next(w for w in s.proxy.discovery.watches if w.source == "k8s" and w.role == role)


def warnings_about(caplog, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


# ---------------------------------------------------------------------------------- the data
def test_recorded_events_are_valid_endpointslices():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    events = [e for v in EVENTS.values() if isinstance(v, list) for e in v]
    assert len(events) >= 8
    for event in events:
        assert event["type"] in ("ADDED", "MODIFIED", "DELETED")
        kv.validate(event["object"], "1.32.0", strict=True)


# ---------------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("pcp-pd-decode", ServiceRef("pcp-pd-decode")),
        ("pcp-pd-decode:http", ServiceRef("pcp-pd-decode", None, "http")),
        ("pcp-pd/pcp-pd-decode:8200", ServiceRef("pcp-pd-decode", "pcp-pd", 8200)),
    ],
)
def test_service_refs(text, ref):
    assert parse_service_ref(text) == ref
    assert str(ref) == text


@pytest.mark.parametrize(
    "text",
    ["Decode", "1decode", "decode:", "decode:0", "decode:HTTP", "ns_x/decode", "a/b/c", "d:123456"],
)
def test_bad_service_refs(text):
    with pytest.raises(ValueError):
        parse_service_ref(text)


def test_slice_endpoints_read_conditions_ports_and_pods():
    obj = copy.deepcopy(EVENTS["decode_scale_down"][0]["object"])
    eps = slice_endpoints(obj, "http")
    assert [e.url for e in eps] == [
        "http://10.244.1.21:8200",
        "http://10.244.2.22:8200",
        "http://10.244.3.23:8200",
    ]
    leaving = eps[1]
    assert (leaving.ready, leaving.serving, leaving.terminating) == (False, True, True)
    assert not leaving.wanted and eps[0].wanted
    assert leaving.pod == "pcp-pd-decode-6c9f7d8b5-9wz4t"
    assert slice_endpoints(obj, 8300)[0].url == "http://10.244.1.21:8300"  # a number is the port
    assert slice_endpoints(obj, None)[0].url.endswith(":8200")  # the only port
    assert slice_endpoints(obj, "metrics") == []  # the slice lacks that port
    for ep in obj["endpoints"]:
        ep["conditions"] = {}  # unknown: ready, as the API asks consumers to read it
    assert all(e.wanted for e in slice_endpoints(obj, "http"))
    obj["addressType"] = "IPv6"
    obj["endpoints"][0]["addresses"] = ["fd00::21"]
    assert slice_endpoints(obj, "http")[0].url == "http://[fd00::21]:8200"
    obj["addressType"] = "FQDN"
    assert slice_endpoints(obj, "http") == []


def test_in_cluster_config_from_the_pod(tmp_path):
    (tmp_path / "token").write_text("t1\n")
    (tmp_path / "namespace").write_text("pcp-pd\n")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    c = InCluster.from_environment(env, tmp_path)
    assert (c.base_url, c.namespace, c.ca_file) == ("https://[fd00::1]:443", "pcp-pd", None)
    assert c.headers()["Authorization"] == "Bearer t1"
    (tmp_path / "token").write_text("t2\n")  # the kubelet rotated it: read again each time
    assert c.headers()["Authorization"] == "Bearer t2"
    with pytest.raises(KubeConfigError, match="not running in a pod"):
        InCluster.from_environment({}, tmp_path)
    (tmp_path / "token").unlink()
    with pytest.raises(KubeConfigError, match="automountServiceAccountToken"):
        InCluster.from_environment(env, tmp_path)


def test_config_flags_need_a_pod(tmp_path, monkeypatch):
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t")
    monkeypatch.setattr(kube_api, "SERVICE_ACCOUNT_DIR", sa)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    env = {"PD_PROXY_PREFILL_K8S_SERVICE": "pcp-pd-prefill:http", "PD_PROXY_DECODE": "http://d:1"}
    with pytest.raises(ConfigError, match="PD_PROXY_PREFILL_K8S_SERVICE.*not running in a pod"):
        validate(load_config([], env))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ConfigError, match="no namespace file: give NAMESPACE/NAME"):
        validate(load_config([], env))
    c = load_config(
        ["--decode-k8s-service", "pcp-pd/pcp-pd-decode:http"], {"PD_PROXY_PREFILL": "http://p:1"}
    )
    assert c.decode_k8s_service == "pcp-pd/pcp-pd-decode:http" and c.decode == ()
    (sa / "namespace").write_text(NAMESPACE)
    c = load_config([], env)
    assert c.discovery and c.sources("prefill") == ["k8s:pcp-pd-prefill:http"]
    with pytest.raises(ConfigError, match="--decode-k8s-service.*port"):
        load_config(["--decode-k8s-service", "pcp-pd-decode:HTTP"], env)
    text = build_parser().format_help()
    for flag in ("--prefill-k8s-service", "PD_PROXY_DECODE_K8S_SERVICE", "endpointslices"):
        assert flag in text


# ---------------------------------------------------------------------------------- the watch
async def test_scale_down_through_the_watch_loses_no_request(tmp_path, monkeypatch, caplog):
    """160 requests at concurrency 16 while one decode pod of three is deleted: the pod goes
    Terminating (preStop), stops serving, leaves the slice. It gets no new request from the
    moment the API says it is terminating, its in-flight ones finish, none is lost."""
    caplog.set_level(logging.INFO, logger="pd_proxy")
    total, concurrency, terminate_after, gated_from = 160, 16, 40, 110
    async with deployment(tmp_path, monkeypatch) as (s, c, _prefills, decodes, dp):
        leaving_host = DECODE_IPS["10.244.2.22"]
        leaving, gone_url = decodes[leaving_host], url(leaving_host, dp)
        for fake in decodes.values():
            fake.knobs.token_delay = 0.002
        leaving.knobs.token_delay = 0.04  # its streams are surely in flight at the event
        pool = s.proxy.decode_pool
        backend = find(pool, gone_url)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(total):
            queue.put_nowait(i)
        failures: list[str] = []
        done: list[int] = []
        gone = asyncio.Event()
        record: dict[str, Any] = {}

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                if i >= gated_from:  # these run only once the pod is gone for good
                    await asyncio.wait_for(gone.wait(), 30)
                problem = await complete(s, i, stream=i % 2 == 0, n=4)
                if problem:
                    failures.append(problem)
                done.append(i)

        async def scale_down() -> None:
            loop = asyncio.get_running_loop()
            await until(lambda: len(done) >= terminate_after, "the first requests")
            await until(lambda: backend.outstanding >= 2, "requests in flight on the pod")
            started = loop.time()
            c.apply(EVENTS["decode_scale_down"][0])  # Terminating, preStop sleep running
            await until(lambda: backend.draining, "the pod to start draining")
            record["react_s"] = loop.time() - started
            record["in_flight"] = backend.outstanding
            await until(lambda: backend.outstanding == 0, "its in-flight requests to finish")
            record["seen"] = len(leaving.seen)
            c.apply(*EVENTS["decode_scale_down"][1:])  # SIGTERM, then the pod is gone
            await until(lambda: find(pool, gone_url) is None, "the drained backend to drop")
            await leaving.stop()
            gone.set()

        await asyncio.gather(scale_down(), *(worker() for _ in range(concurrency)))

        assert failures == [], failures  # 0 of 160 lost
        assert sorted(done) == list(range(total))
        assert record["in_flight"] >= 1  # it was busy when it started terminating ...
        assert leaving.cancelled == []  # ... and those requests finished whole
        assert len(leaving.seen) == record["seen"] > 0  # nothing new after the event
        assert record["react_s"] < 10.0, record  # the watch, not the 60 s poll, reacted
        assert sum(f.completed for f in decodes.values()) == total
        assert watch_of(s, "decode").lists == 1  # one LIST, then the watch carried everything
        logs = "\n".join(r.getMessage() for r in caplog.records)
        assert "pod pcp-pd-decode-6c9f7d8b5-9wz4t" in logs and "is terminating" in logs
        labels = {"role": "decode", "source": "k8s"}
        assert s.sample("pd_proxy_discovery_errors_total", labels) == 0
        assert s.sample("pd_proxy_in_flight_requests") == 0


async def test_scale_up_joins_once_ready_and_healthy(tmp_path, monkeypatch):
    async with deployment(tmp_path, monkeypatch, decode_hosts=DECODE_HOSTS) as (s, c, *_rest):
        _prefills, decodes, dp = _rest
        new = url(DECODE_IPS["10.244.4.24"], dp)
        pool = s.proxy.decode_pool
        watch = watch_of(s, "decode")
        c.apply(EVENTS["decode_scale_up"][0])  # created, not ready yet
        # The watch has the event (on a loaded host it may take longer than the wait below, which
        # would then prove nothing); the discovery round it wakes runs right after.
        version = str(c.api.version)
        await until(lambda: watch.resource_version == version, "the not-ready event")
        await asyncio.sleep(0.3)
        assert find(pool, new) is None
        c.apply(EVENTS["decode_scale_up"][1])  # ready
        await until(lambda: getattr(find(pool, new), "healthy", False), "the new pod to serve")
        for i in range(8):
            assert await complete(s, i) is None
        assert decodes[DECODE_IPS["10.244.4.24"]].seen


async def test_watch_resumes_where_it_ended_and_lists_again_after_410(tmp_path, monkeypatch):
    async with deployment(tmp_path, monkeypatch) as (s, c, _p, _d, dp):
        watch = watch_of(s, "decode")
        pool = s.proxy.decode_pool
        gone_url = url(DECODE_IPS["10.244.2.22"], dp)
        await until(lambda: c.api.watching == 2, "both watches to be open")
        # The server ends the streams (timeoutSeconds); an event lands before they reconnect.
        c.api.end_watches()
        c.apply(EVENTS["decode_scale_down"][2])
        await until(lambda: find(pool, gone_url) is None, "the removal to arrive on resume")
        assert watch.lists == 1 and c.api.lists() == 2  # resumed, not listed again
        resumed = [q for kind, q in c.api.requests if kind == "watch"][-1]
        assert resumed["allowWatchBookmarks"] == "true" and resumed["resourceVersion"]
        # A bookmark moves the version on without an object change.
        before = watch.resource_version
        c.api.apply(localize(EVENTS["initial"][0], c.ports))  # prefill slice: other selector
        c.api.bookmark()
        await until(lambda: watch.resource_version != before, "the bookmark's version")
        assert watch.resource_version == str(c.api.version)
        # The streams end, an event lands and the history is compacted before they reconnect:
        # their version is too old (410 Gone), so the watch lists again.
        await until(lambda: c.api.watching == 2, "the watches to reconnect")
        c.api.end_watches()
        c.apply(EVENTS["decode_address_reused"][0])  # 10.244.2.22 is back, as another pod
        c.api.compact()
        await until(lambda: watch.lists == 2, "a new LIST after 410 Gone")
        await until(lambda: getattr(find(pool, gone_url), "healthy", False), "the new pod")


async def test_address_reused_by_another_pod_is_checked_before_traffic(tmp_path, monkeypatch):
    async with deployment(tmp_path, monkeypatch) as (s, c, _p, decodes, dp):
        host = DECODE_IPS["10.244.2.22"]
        pool = s.proxy.decode_pool
        backend = find(pool, url(host, dp))
        decodes[host].knobs.healthy = False  # the new pod is not ready to serve yet
        c.apply(EVENTS["decode_address_reused"][0])  # same address, another pod uid
        await until(lambda: not backend.healthy, "the reused address to be checked again")
        seen = len(decodes[host].seen)
        for i in range(6):
            assert await complete(s, i) is None
        assert len(decodes[host].seen) == seen  # no traffic while its check fails
        decodes[host].knobs.healthy = True
        await until(lambda: backend.healthy, "the new pod to pass its check")


async def test_missing_rbac_then_granted(tmp_path, monkeypatch, caplog):
    """Started before its Role exists: one warning naming the refusal, /health 503, and the
    backends join once the API lets the proxy list."""
    caplog.set_level(logging.INFO, logger="pd_proxy.discovery.watch")
    async with (
        fleet(PREFILL, ("127.0.0.2", "127.0.0.3")) as (pp, _),
        fleet(DECODE, DECODE_HOSTS[:3]) as (dp, _),
        cluster(tmp_path, monkeypatch, {"pcp-pd-prefill": pp, "pcp-pd-decode": dp}) as c,
    ):
        c.api.forbidden = True
        monkeypatch.setattr("pd_proxy.discovery.k8s_service.FIRST_SYNC_S", 1.0)
        async with proxy(discovery_interval=0.1) as s:
            status, raw = await s.get("/health")
            assert status == 503
            await until(lambda: warnings_about(caplog, "Service pcp-pd/pcp-pd-decode:http"), "warn")
            found = warnings_about(caplog, "Service pcp-pd/pcp-pd-decode:http")
            assert len(found) == 1 and "403 Forbidden" in found[0], found
            assert 'cannot list resource "endpointslices"' in found[0]
            c.api.forbidden = False
            await until(lambda: len(s.proxy.decode_pool.healthy()) == 3, "the decodes to join")
            assert await complete(s) is None
            assert any("works again" in r.getMessage() for r in caplog.records)
            labels = {"role": "decode", "source": "k8s"}
            assert s.sample("pd_proxy_discovery_errors_total", labels) >= 1


async def test_api_outage_keeps_the_backends_and_the_token_is_read_again(
    tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="pd_proxy.discovery.watch")
    monkeypatch.setattr("pd_proxy.discovery.k8s_service.RETRY_MIN_S", 0.05)
    async with deployment(tmp_path, monkeypatch, discovery_interval=0.1) as (s, c, _p, _d, dp):
        pool = s.proxy.decode_pool
        gone_url = url(DECODE_IPS["10.244.2.22"], dp)
        c.rotate_token("eyJhbGciOiJSUzI1NiJ9.rotated")  # the old token is refused from now on
        c.api.end_watches()
        await until(lambda: c.api.watching == 2, "the watches to reconnect with the new token")
        c.apply(EVENTS["decode_scale_down"][0])
        await until(lambda: find(pool, gone_url) is None, "the event to arrive over the watch")
        before = sorted(b.url for b in pool.backends)
        # The API server goes away: the pool keeps what it had, one warning per role.
        c.api.token = "someone-else"  # every request is now 401
        c.api.end_watches()
        await until(lambda: warnings_about(caplog, "decode Service"), "the outage warning")
        for i in range(4):
            assert await complete(s, i) is None
        assert sorted(b.url for b in pool.backends) == before and pool.draining == []
        found = warnings_about(caplog, "decode Service")
        assert len(found) == 1 and "401" in found[0], found
        c.api.token = "eyJhbGciOiJSUzI1NiJ9.rotated"
        await until(
            lambda: any("works again" in r.getMessage() for r in caplog.records), "recovery"
        )
        assert sorted(b.url for b in pool.backends) == before


async def test_http_410_lists_again_without_an_outage(tmp_path, monkeypatch, caplog):
    """A server that answers a too-old watch with the HTTP status 410 (not an ERROR event): the
    watch lists again at once, as for the event; no outage is logged or counted."""
    caplog.set_level(logging.INFO, logger="pd_proxy.discovery.watch")
    async with deployment(tmp_path, monkeypatch) as (s, c, _p, _d, dp):
        watch = watch_of(s, "decode")
        gone_url = url(DECODE_IPS["10.244.2.22"], dp)
        c.api.gone_as_status = True
        await until(lambda: c.api.watching == 2, "both watches to be open")
        c.api.end_watches()
        c.apply(EVENTS["decode_scale_down"][2])  # lands while they reconnect ...
        c.api.compact()  # ... and the history is gone: their version is too old
        await until(lambda: watch.lists == 2, "a new LIST after the HTTP 410")
        await until(lambda: find(s.proxy.decode_pool, gone_url) is None, "the removal")
        assert warnings_about(caplog, "Service") == []
        labels = {"role": "decode", "source": "k8s"}
        assert s.sample("pd_proxy_discovery_errors_total", labels) == 0


async def test_backoff_resets_after_a_successful_list(tmp_path, monkeypatch, caplog):
    """Refused for a while, the retries space out (0.01 s doubling); once a LIST succeeds, the
    next failure is retried after the shortest delay again, not after the grown one."""
    caplog.set_level(logging.DEBUG, logger="pd_proxy.discovery.watch")
    monkeypatch.setattr("pd_proxy.discovery.k8s_service.RETRY_MIN_S", 0.01)
    async with deployment(tmp_path, monkeypatch) as (s, c, _p, _d, _dp):
        watch = watch_of(s, "decode")
        good = c.api.token

        def retries() -> list[float]:
            text = f"{watch.label}: retrying in "
            return [
                float(r.getMessage().removeprefix(text).rstrip("s"))
                for r in caplog.records
                if r.getMessage().startswith(text)
            ]

        def requests() -> int:
            return sum(1 for _kind, q in c.api.requests if "pcp-pd-decode" in q["labelSelector"])

        c.api.token = "refused"  # every request is now 401
        c.api.end_watches()
        before = requests()
        # The watch, then LISTs 0.01, 0.02, ... 0.64 s apart: the next delay is 1.28 s.
        await until(lambda: requests() >= before + 8, "eight refused requests")
        c.api.token = good
        await until(lambda: watch.lists == 2, "a successful LIST")
        await until(lambda: c.api.watching == 2, "the watches to be open again")
        c.api.token = "refused"
        c.api.end_watches()
        before, seen = requests(), len(retries())
        # Reset: 0.01, 0.02, 0.04 s; without it the first retry alone would wait 2.56 s. The
        # logged delays below prove it, whatever a loaded host does to the wall time.
        await until(lambda: requests() >= before + 3, "three quick retries")
        c.api.token = good
        assert retries()[:3] == [0.01, 0.02, 0.04] and retries()[seen] == 0.01, retries()


async def test_a_dead_watch_task_is_logged_and_restarted(tmp_path, monkeypatch, caplog):
    """A bug that ends the watch task (an exception nobody expected) must not freeze the pool:
    the next poll logs it with its traceback, starts the watch again (a new LIST) and the
    changes since then arrive."""
    caplog.set_level(logging.INFO, logger="pd_proxy.discovery.watch")
    apply = EndpointSliceWatch._apply
    bugs = [RuntimeError("a bug in the event handling")]

    def buggy(self: EndpointSliceWatch, event: dict[str, Any]) -> None:
        if self.role == "decode" and event["type"] != "BOOKMARK" and bugs:
            raise bugs.pop()
        apply(self, event)

    async with deployment(tmp_path, monkeypatch) as (s, c, _p, _d, dp):
        monkeypatch.setattr(EndpointSliceWatch, "_apply", buggy)
        watch = watch_of(s, "decode")
        gone_url = url(DECODE_IPS["10.244.2.22"], dp)
        await until(lambda: c.api.watching == 2, "both watches to be open")
        c.apply(EVENTS["decode_scale_down"][2])  # the pod is gone; its event hits the bug
        await until(lambda: find(s.proxy.decode_pool, gone_url) is None, "the removal")
        assert bugs == [] and watch.restarts == 1 and watch.lists == 2
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "watch stopped (RuntimeError" in errors[0].getMessage()
        assert errors[0].exc_info is not None  # the traceback, to find the bug
        assert any("works again" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("as_status", [False, True])
async def test_a_server_that_is_always_gone_is_listed_with_backoff(
    tmp_path, monkeypatch, caplog, as_status
):
    """410 Gone to a watch from the version the LIST just returned cannot be fixed by listing
    again at once: that would loop as fast as the server answers. The watch backs off (and
    says so once), keeps following the LISTs, and watches again once the server does."""
    caplog.set_level(logging.INFO, logger="pd_proxy.discovery.watch")
    monkeypatch.setattr("pd_proxy.discovery.k8s_service.RETRY_MIN_S", 0.05)
    async with deployment(tmp_path, monkeypatch) as (s, c, _p, _d, dp):
        watch = watch_of(s, "decode")
        gone_url = url(DECODE_IPS["10.244.2.22"], dp)
        c.api.always_gone, c.api.gone_as_status = True, as_status
        await until(lambda: c.api.watching == 2, "both watches to be open")
        c.api.end_watches()
        c.apply(EVENTS["decode_scale_down"][2])
        await until(lambda: find(s.proxy.decode_pool, gone_url) is None, "the removal, listed")
        before = watch.lists
        await asyncio.sleep(1.0)
        # 0.05 + 0.1 + 0.2 + 0.4 s: about 4 more LISTs, not hundreds (a loaded host only makes
        # fewer; it may take longer than the second to have two).
        assert watch.lists - before <= 8, watch.lists - before
        await until(lambda: watch.lists - before >= 2, "the LISTs to go on")
        found = warnings_about(caplog, "answers 410 Gone")
        assert len(found) == 2, found  # once per role
        c.api.always_gone = False
        await until(lambda: c.api.watching == 2, "the watches to be open again")


async def test_a_watch_that_dies_before_its_first_list_is_restarted_at_once(
    tmp_path, monkeypatch, caplog
):
    """The first poll waits for the first LIST at most FIRST_SYNC_S (5 s), but not for a task
    that already died: it restarts it and the backends join without that wait."""
    caplog.set_level(logging.INFO, logger="pd_proxy.discovery.watch")
    list_ = EndpointSliceWatch._list
    bugs = [KeyError("metadata")]

    async def buggy(self: EndpointSliceWatch, client: Any) -> None:
        if self.role == "decode" and bugs:
            raise bugs.pop()
        await list_(self, client)

    monkeypatch.setattr(EndpointSliceWatch, "_list", buggy)
    loop = asyncio.get_running_loop()
    async with (
        fleet(PREFILL, ("127.0.0.2", "127.0.0.3")) as (pp, _),
        fleet(DECODE, DECODE_HOSTS[:3]) as (dp, _),
        cluster(tmp_path, monkeypatch, {"pcp-pd-prefill": pp, "pcp-pd-decode": dp}),
    ):
        started = loop.time()
        async with proxy() as s:  # its start-up polls once
            await until(lambda: len(s.proxy.decode_pool.healthy()) == 3, "the decodes")
            assert loop.time() - started < 3.0  # not FIRST_SYNC_S (5 s) and more
            assert watch_of(s, "decode").restarts == 1 and bugs == []
            assert any("watch stopped (KeyError" in r.getMessage() for r in caplog.records)
