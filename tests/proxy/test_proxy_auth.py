"""Secure by default: client keys, the backend key, where /metrics lives, the open-proxy warning."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import aiohttp
import pytest

from pd_proxy import cli
from pd_proxy import serve as serve_module
from pd_proxy.api.auth import INVALID_KEY, MISSING_KEY, ClientKeys
from pd_proxy.api.startup_checks import validate
from pd_proxy.config import ConfigError, ProxyConfig, build_parser, load_config
from pd_proxy.config.key_files import BackendKey, parse_keys
from pd_proxy.metrics import METRIC_NAMES
from tests.proxy.proxy_harness import pd_stack
from tests.support.net import closed_port_url, free_port

P = "http://127.0.0.1:16801"
D = "http://127.0.0.1:16802"
STREAM = {"prompt": "x", "max_tokens": 3, "stream": True}
PLAIN = {"prompt": "x", "max_tokens": 3}
OPEN_WARNING = "no client API key configured (PD_PROXY_API_KEY_FILE)"


def write_keys(tmp_path, *lines: str, name: str = "keys") -> str:
    path = tmp_path / name
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(status: int, raw: bytes, message: str) -> None:
    assert status == 401, raw
    body = json.loads(raw)
    assert body == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


def backend_hits(s) -> list[tuple[str, str]]:
    """Every /v1 request any fake backend received (rejected ones included)."""
    return [(m, p) for f in s.prefills + s.decodes for m, p, _ in f.received]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- client keys, e2e
async def test_missing_key_is_401_on_every_route_and_no_backend_is_touched(tmp_path):
    async with pd_stack(api_key_file=write_keys(tmp_path, "sk-one")) as s:
        for path, body in [("/v1/completions", STREAM), ("/v1/chat/completions", PLAIN)]:
            status, headers, raw = await s.post(path, body)
            assert_401(status, raw, MISSING_KEY)
            assert headers["WWW-Authenticate"].startswith("Bearer")
        for path in ("/v1/models", "/metrics", "/no/such/route"):
            status, raw = await s.get(path)
            assert_401(status, raw, MISSING_KEY)
        # Another scheme, or a bearer with no token, is no key either.
        for value in ("Basic c2stb25lOg==", "sk-one", "Bearer ", "Bearer"):
            status, _, raw = await s.post("/v1/completions", PLAIN, {"Authorization": value})
            assert_401(status, raw, MISSING_KEY)
        assert backend_hits(s) == []
        assert s.prefill.seen == [] and s.decode.seen == []
        labels = {"endpoint": "/v1/completions", "status": "401", "path": ""}
        assert s.sample("pd_proxy_requests_total", labels) == 5


async def test_wrong_key_is_401_and_not_echoed(tmp_path):
    async with pd_stack(api_key_file=write_keys(tmp_path, "sk-one")) as s:
        for wrong in ("sk-wrong", "sk-on", "sk-one2", "SK-ONE", "# sk-one"):
            status, _, raw = await s.post("/v1/completions", STREAM, bearer(wrong))
            assert_401(status, raw, INVALID_KEY)
            assert wrong.encode() not in raw
            status, raw = await s.get("/v1/models", bearer(wrong))
            assert_401(status, raw, INVALID_KEY)
        assert backend_hits(s) == []


async def test_right_key_serves_both_legs_end_to_end(tmp_path):
    async with pd_stack(api_key_file=write_keys(tmp_path, "sk-one")) as s:
        status, headers, raw = await s.post("/v1/completions", STREAM, bearer("sk-one"))
        assert status == 200, raw
        rid = headers["X-Request-Id"]
        assert raw == s.decode.sent[rid] and raw.endswith(b"data: [DONE]\n\n")
        status, _, raw = await s.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
            {"Authorization": "bearer sk-one"},  # the scheme is case-insensitive
        )  # fmt: skip
        assert status == 200, raw
        assert len(s.prefill.seen) == len(s.decode.seen) == 2
        status, raw = await s.get("/v1/models", bearer("sk-one"))
        assert status == 200 and json.loads(raw)["data"][0]["id"] == "fake-model"
        # No --metrics-port: /metrics stays on the main port, behind the key like the rest.
        status, raw = await s.get("/metrics", bearer("sk-one"))
        assert status == 200 and b"pd_proxy_requests_total" in raw


async def test_every_key_of_the_file_works_and_comments_do_not(tmp_path):
    path = write_keys(
        tmp_path, "# team keys", "", "  sk-alpha  ", "sk-beta", "   # sk-commented", "sk-gamma"
    )
    async with pd_stack(api_key_file=path) as s:
        for key in ("sk-alpha", "sk-beta", "sk-gamma"):
            status, _, raw = await s.post("/v1/completions", PLAIN, bearer(key))
            assert status == 200, (key, raw)
        for not_a_key in ("sk-commented", "# sk-commented", "# team keys"):
            status, _, raw = await s.post("/v1/completions", PLAIN, bearer(not_a_key))
            assert_401(status, raw, INVALID_KEY)
        assert len(s.decode.seen) == 3


async def test_health_stays_open_without_a_key(tmp_path):
    async with pd_stack(api_key_file=write_keys(tmp_path, "sk-one")) as s:
        status, raw = await s.get("/health")
        assert status == 200 and json.loads(raw)["status"] == "ok"
        status, raw = await s.get("/health", bearer("sk-wrong"))
        assert status == 200


async def test_rotated_key_file_is_reloaded_without_restart(tmp_path, caplog):
    """The default one-second check: the new key starts working, the old one stops."""
    caplog.set_level(logging.INFO, logger="pd_proxy.api.auth")
    path = write_keys(tmp_path, "sk-old")
    async with pd_stack(api_key_file=path) as s:
        status, _, _ = await s.post("/v1/completions", PLAIN, bearer("sk-old"))
        assert status == 200
        tmp = tmp_path / "keys.new"
        tmp.write_text("sk-new-key\n")
        os.replace(tmp, path)  # how secret mounts and careful operators swap files
        for _ in range(60):  # the reload is due within a second; each miss is a cheap 401
            status, _, _ = await s.post("/v1/completions", PLAIN, bearer("sk-new-key"))
            if status == 200:
                break
            await asyncio.sleep(0.05)
        assert status == 200
        status, _, raw = await s.post("/v1/completions", PLAIN, bearer("sk-old"))
        assert_401(status, raw, INVALID_KEY)
        assert any("reloaded client API key file" in r.getMessage() for r in caplog.records)


async def test_bad_new_key_file_keeps_the_last_good_keys_and_logs_an_error(tmp_path, caplog):
    path = write_keys(tmp_path, "sk-good")
    async with pd_stack(api_key_file=path) as s:
        keys = s.proxy.client_keys
        keys.interval = 0.0  # check on every request: the throttle has its own test

        async def status_with(key: str) -> int:
            status, _, _ = await s.post("/v1/completions", PLAIN, bearer(key))
            return status

        for bad in ("", "# only a comment\n\n", None):  # empty, no key, deleted
            caplog.clear()
            if bad is None:
                os.remove(path)
            else:
                with open(path, "w") as f:
                    f.write(bad)
            assert await status_with("sk-good") == 200
            assert await status_with("sk-good") == 200
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1, [r.getMessage() for r in errors]  # once per change
            assert path in errors[0].getMessage()
            assert "keeping the last good key" in errors[0].getMessage()
        write_keys(tmp_path, "sk-back-again")
        assert await status_with("sk-back-again") == 200
        assert await status_with("sk-good") == 401


# --------------------------------------------------------------------------- client keys, unit
def test_key_file_parsing():
    text = "# comment\n\n  k1  \nk2\n\t# c2\nk1\n"
    assert parse_keys(text) == ("k1", "k2")
    assert parse_keys("# nothing\n\n") == ()


def test_reload_is_checked_at_most_once_per_second(tmp_path, monkeypatch):
    path = write_keys(tmp_path, "sk-one")
    clock = FakeClock()
    keys = ClientKeys(path, clock=clock)
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(p) or real_stat(p, *a, **k))
    write_keys(tmp_path, "sk-two-longer")
    for _ in range(1000):  # the hot path: no stat, no read within the interval
        assert keys.check("Bearer sk-one") is None
    clock.now += 0.5
    assert keys.check("Bearer sk-one") is None
    assert stats == []
    clock.now += 0.5
    assert keys.check("Bearer sk-one") == INVALID_KEY
    assert keys.check("Bearer sk-two-longer") is None
    assert stats == [path]  # one stat for the due check


def test_backend_key_is_the_first_key_and_reloads(tmp_path):
    path = write_keys(tmp_path, "# vLLM --api-key", "be-first", "be-second")
    clock = FakeClock()
    key = BackendKey(path, clock=clock)
    assert key.header() == "Bearer be-first"
    write_keys(tmp_path, "be-rotated")
    clock.now += 1.0
    assert key.header() == "Bearer be-rotated"


# --------------------------------------------------------------------------- start-up errors
@pytest.mark.parametrize("content", ["", "\n\n", "# just a comment\n", "two words\n"])
def test_empty_or_malformed_key_file_at_start_is_a_config_error(tmp_path, content):
    path = tmp_path / "keys"
    path.write_text(content)
    env = {"PD_PROXY_PREFILL": P, "PD_PROXY_DECODE": D, "PD_PROXY_API_KEY_FILE": str(path)}
    with pytest.raises(ConfigError, match="PD_PROXY_API_KEY_FILE") as info:
        validate(load_config([], env))
    assert str(path) in str(info.value)
    assert "two" not in str(info.value)  # never the key material


def test_missing_or_unreadable_key_file_at_start_is_a_config_error(tmp_path):
    missing = str(tmp_path / "nope")
    for path in (missing, str(tmp_path)):  # a directory cannot be read as a file, even by root
        with pytest.raises(ConfigError, match="--api-key-file") as info:
            validate(load_config(["--prefill", P, "--decode", D, "--api-key-file", path], {}))
        assert path in str(info.value)
    with pytest.raises(ConfigError, match="PD_PROXY_BACKEND_API_KEY_FILE"):
        validate(ProxyConfig(prefill=(P,), decode=(D,), backend_api_key_file=missing))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_key_file_without_read_permission_is_a_config_error(tmp_path):
    path = write_keys(tmp_path, "sk-one")
    os.chmod(path, 0)
    with pytest.raises(ConfigError, match="cannot read"):
        validate(ProxyConfig(prefill=(P,), decode=(D,), api_key_file=path))


def test_main_exits_2_naming_the_key_file(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "absent-keys")
    monkeypatch.setenv("PD_PROXY_PREFILL", P)
    monkeypatch.setenv("PD_PROXY_DECODE", D)
    monkeypatch.setenv("PD_PROXY_API_KEY_FILE", missing)
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pd-proxy: error: ") and missing in err
    assert "Traceback" not in err


def test_keys_come_only_from_files_and_stay_out_of_the_config_repr(tmp_path):
    parser = build_parser()
    key_options = [a for a in parser._actions if "key" in a.dest]
    assert sorted(a.dest for a in key_options) == ["api_key_file", "backend_api_key_file"]
    text = parser.format_help()
    for flag, env in [
        ("--api-key-file", "PD_PROXY_API_KEY_FILE"),
        ("--backend-api-key-file", "PD_PROXY_BACKEND_API_KEY_FILE"),
        ("--metrics-port", "PD_PROXY_METRICS_PORT"),
    ]:
        assert flag in text and env in text
    config = ProxyConfig(
        prefill=(P,),
        decode=(D,),
        api_key_file=write_keys(tmp_path, "sk-secret-client"),
        backend_api_key_file=write_keys(tmp_path, "sk-secret-backend", name="be"),
    )
    assert "sk-secret" not in repr(config)


# --------------------------------------------------------------------------- backend key
async def test_client_authorization_is_never_forwarded(tmp_path):
    client = bearer("sk-client-secret")
    # No keys at all, a backend key only, and both: never the client's header upstream.
    setups = [
        {},
        {"backend_api_key_file": write_keys(tmp_path, "be-secret", name="be")},
        {
            "backend_api_key_file": write_keys(tmp_path, "be-secret", name="be"),
            "api_key_file": write_keys(tmp_path, "sk-client-secret"),
        },
    ]
    for options in setups:
        async with pd_stack(**options) as s:
            for body in (STREAM, PLAIN):
                status, _, raw = await s.post("/v1/completions", body, client)
                assert status == 200, raw
            status, _ = await s.get("/v1/models", client)
            assert status == 200
            received = [h for f in s.prefills + s.decodes for _, _, h in f.received]
            assert len(received) == 5  # 2 prefill, 2 decode, 1 models
            sent = {h.get("Authorization") for h in received}
            expected = "Bearer be-secret" if "backend_api_key_file" in options else None
            assert sent == {expected}, options


async def test_backend_key_is_sent_on_both_legs_and_models(tmp_path):
    path = write_keys(tmp_path, "# vLLM --api-key of both servers", "be-secret", "be-unused")
    async with pd_stack(backend_key="be-secret", backend_api_key_file=path) as s:
        for body in (STREAM, PLAIN):
            status, _, raw = await s.post("/v1/completions", body)
            assert status == 200, raw
        status, raw = await s.get("/v1/models")
        assert status == 200, raw
        for fake, paths in [
            (s.prefill, ["/v1/completions"] * 2),
            (s.decode, ["/v1/completions"] * 2 + ["/v1/models"]),
        ]:
            assert [p for _, p, _ in fake.received] == paths
            assert {h["Authorization"] for _, _, h in fake.received} == {"Bearer be-secret"}


async def test_backend_refusing_the_proxys_key_is_a_502_not_the_clients_401(tmp_path):
    """Forwarding vLLM's 401 would tell the client its own (valid) key is wrong."""
    wrong = write_keys(tmp_path, "be-stale", name="be")
    for options in ({}, {"backend_api_key_file": wrong}):
        async with pd_stack(backend_key="be-secret", **options) as s:
            status, _, raw = await s.post("/v1/completions", STREAM)
            assert status == 502, raw
            error = json.loads(raw)["error"]
            assert error["code"] == 502
            assert "rejected the proxy's API key" in error["message"]
            assert s.prefill.url in error["message"]
            status, raw = await s.get("/v1/models")
            assert status == 502 and b"rejected the proxy's API key" in raw
            labels = {"stage": "prefill", "backend": s.prefill.url}
            assert s.sample("pd_proxy_backend_errors_total", labels) == 1
            assert s.decode.seen == []  # prefill failed: decode never ran


# --------------------------------------------------------------------------- /metrics policy
async def test_metrics_port_moves_metrics_off_the_main_port():
    async with pd_stack(metrics_port=0) as s:
        assert s.metrics_url is not None
        status, raw = await s.get("/metrics")
        assert status == 404 and json.loads(raw)["error"]["code"] == 404
        status, raw = await s.get("/metrics", base=s.metrics_url)
        assert status == 200
        for name in METRIC_NAMES:
            assert f"# TYPE {name} ".encode() in raw
        status, _, raw = await s.post("/v1/completions", PLAIN)
        assert status == 200, raw
        # The metrics listener serves nothing else.
        for path in ("/v1/models", "/health", "/"):
            status, _ = await s.get(path, base=s.metrics_url)
            assert status == 404
        assert len(s.decode.received) == 1


async def test_metrics_port_needs_no_key_while_the_main_port_does(tmp_path):
    async with pd_stack(metrics_port=0, api_key_file=write_keys(tmp_path, "sk-one")) as s:
        status, raw = await s.get("/metrics", base=s.metrics_url)
        assert status == 200 and b"pd_proxy_in_flight_requests" in raw
        status, raw = await s.get("/metrics")
        assert_401(status, raw, MISSING_KEY)
        status, raw = await s.get("/metrics", bearer("sk-one"))
        assert status == 404


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 9000, "metrics_port": 9000}, "is the main port"),
        ({"metrics_port": 70000}, "outside"),
        ({"metrics_port": 9100, "metrics": False}, "metrics are off"),
    ],
)
def test_bad_metrics_port_is_a_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ProxyConfig(prefill=(P,), decode=(D,), **kwargs)


def test_metrics_port_from_env_and_flag():
    env = {"PD_PROXY_PREFILL": P, "PD_PROXY_DECODE": D, "PD_PROXY_METRICS_PORT": "9100"}
    assert load_config([], env).metrics_port == 9100
    assert load_config(["--metrics-port", "9200"], env).metrics_port == 9200
    assert load_config([], {"PD_PROXY_PREFILL": P, "PD_PROXY_DECODE": D}).metrics_port is None


# --------------------------------------------------------------------------- cli.serve
async def serve_once(monkeypatch, config: ProxyConfig, while_up=None) -> None:
    """Run ``cli.serve`` until ``while_up()`` returns, instead of until a signal."""

    async def instead_of_signal() -> None:
        if while_up is not None:
            await while_up()

    monkeypatch.setattr(serve_module, "_wait_for_signal", instead_of_signal)
    # no gc.freeze() in the test process
    monkeypatch.setattr(serve_module, "_settle_gc", lambda: None)
    await cli.serve(config)


async def test_serve_warns_once_when_no_client_key_is_configured(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    base = {"prefill": (closed_port_url(),), "decode": (closed_port_url(),), "host": "127.0.0.1"}
    await serve_once(monkeypatch, ProxyConfig(port=port, health_timeout=0.5, **base))
    warnings = [r.getMessage() for r in caplog.records if OPEN_WARNING in r.getMessage()]
    assert len(warnings) == 1
    assert f"anyone who can reach port {port} can use the model" in warnings[0]
    assert [r.levelname for r in caplog.records if OPEN_WARNING in r.getMessage()] == ["WARNING"]

    caplog.clear()
    keys = write_keys(tmp_path, "sk-one")
    await serve_once(
        monkeypatch, ProxyConfig(port=0, health_timeout=0.5, api_key_file=keys, **base)
    )
    assert any("listening on" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if OPEN_WARNING in r.getMessage()]


async def test_serve_opens_the_metrics_listener(monkeypatch):
    port, metrics_port = free_port(), free_port()
    config = ProxyConfig(
        prefill=(closed_port_url(),),
        decode=(closed_port_url(),),
        host="127.0.0.1",
        port=port,
        metrics_port=metrics_port,
        health_timeout=0.5,
    )
    seen = {}

    async def probe() -> None:
        async with aiohttp.ClientSession() as session:
            for name, url in [
                ("main", f"http://127.0.0.1:{port}/metrics"),
                ("metrics", f"http://127.0.0.1:{metrics_port}/metrics"),
                ("health", f"http://127.0.0.1:{port}/health"),
            ]:
                async with session.get(url) as r:
                    seen[name] = (r.status, await r.read())

    await serve_once(monkeypatch, config, probe)
    assert seen["main"][0] == 404
    assert seen["metrics"][0] == 200 and b"pd_proxy_backend_healthy" in seen["metrics"][1]
    assert seen["health"][0] == 503  # backends are down; the route is still there
