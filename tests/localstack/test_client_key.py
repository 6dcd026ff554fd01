"""The local stack with client keys and admission: the proxy gets the key file and the admission
settings, and every request the stack makes itself sends the file's first key (warm-up over real
HTTP, Prometheus's scrape, the demo's eval); the warm-up's prompt is one the proxy sends P/D."""

from __future__ import annotations

import io
import json
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from pcp_pd_kit.localstack import keys, warmup
from pcp_pd_kit.localstack.commands import proxy_spec
from pcp_pd_kit.localstack.demo import run_eval
from pcp_pd_kit.localstack.live import HttpError
from pcp_pd_kit.localstack.process import StackProcessError
from pcp_pd_kit.localstack.prometheus_config import render_config
from pcp_pd_kit.localstack.stack import Stack
from pcp_pd_kit.settings import settings_from_env
from pd_proxy.config.flags import load_config
from tests.support.env import example_env, example_settings

KEY = "sk-local-test-key"


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api_keys"
    path.write_text(f"# the stack's own key first\n{KEY} flow=stack weight=1\nsk-other flow=b\n")
    return path


def test_the_first_key_of_the_file_is_the_stacks(key_file: Path) -> None:
    assert keys.client_key(str(key_file)) == KEY
    assert keys.client_key("") is None
    assert keys.auth_headers(KEY) == {"Authorization": f"Bearer {KEY}"}
    assert keys.auth_headers(None) == {}


def test_an_unusable_key_file_stops_the_stack_before_it_starts(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# no key\n")
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(StackProcessError, match="LOCAL_API_KEY_FILE"):
            Stack(example_settings(api_key_file=str(path)), work_dir=tmp_path)


def test_the_key_file_comes_from_the_knob_or_the_proxys_own_variable(key_file: Path) -> None:
    assert settings_from_env(example_env()).api_key_file == ""
    env = {**example_env(), "LOCAL_API_KEY_FILE": str(key_file)}
    assert settings_from_env(env).api_key_file == str(key_file)
    env = {**example_env(), "PD_PROXY_API_KEY_FILE": str(key_file)}
    assert settings_from_env(env).api_key_file == str(key_file)


def test_the_proxy_gets_the_key_file_and_the_admission_settings(key_file: Path) -> None:
    settings = example_settings(api_key_file=str(key_file))
    config = load_config(proxy_spec(settings).argv[3:], {})
    assert config.api_key_file == str(key_file)
    assert config.admission is True
    assert (
        config.prefill_max_inflight,
        config.prefill_max_tokens,
        config.decode_max_inflight,
        config.decode_max_pending_pulls,
        config.queue_size,
        config.queue_timeout,
    ) == (
        settings.prefill_max_inflight,
        settings.prefill_max_tokens,
        settings.decode_max_inflight,
        settings.decode_max_pending_pulls,
        settings.queue_size,
        settings.queue_timeout_s,
    )
    assert config.flow_header is None and not config.client_priority
    assert load_config(proxy_spec(example_settings()).argv[3:], {}).api_key_file is None
    off = proxy_spec(example_settings(admission=False)).argv
    assert "--no-admission" in off and "--prefill-max-inflight" not in off
    assert load_config(off[3:], {}).admission is False
    gateway = example_settings(flow_header="X-Team", client_priority=True)
    config = load_config(proxy_spec(gateway).argv[3:], {})
    assert config.flow_header == "X-Team" and config.client_priority


@pytest.mark.parametrize(
    ("env_key", "value"), [("CPU_PROXY_QUEUE_SIZE", "-1"), ("CPU_PROXY_PREFILL_MAX_TOKENS", "-1")]
)
def test_unusable_admission_settings_are_refused(env_key: str, value: str) -> None:
    with pytest.raises(ValueError, match=env_key):
        settings_from_env({**example_env(), env_key: value})


def test_prometheus_sends_the_key_to_the_proxy_only(tmp_path: Path) -> None:
    credentials = keys.write_credentials(KEY, tmp_path / "prom" / "proxy_key")
    assert credentials.read_text() == KEY
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    config = yaml.safe_load(render_config(example_settings(), [], credentials))
    auth = {job["job_name"]: job.get("authorization") for job in config["scrape_configs"]}
    assert auth == {
        "prefill": None,
        "decode": None,
        "proxy": {"type": "Bearer", "credentials_file": str(credentials)},
    }
    plain = yaml.safe_load(render_config(example_settings(), []))
    assert all("authorization" not in job for job in plain["scrape_configs"])


class _KeyedProxy(BaseHTTPRequestHandler):
    """Answers a completion only with the right bearer key, like pd-proxy (401 otherwise)."""

    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = self.headers.get("Authorization") == f"Bearer {KEY}"
        if ok:
            type(self).bodies.append(body)
        payload = json.dumps({"choices": [{"text": "4"}]} if ok else {"error": "invalid key"})
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def keyed_proxy() -> Iterator[str]:
    _KeyedProxy.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeyedProxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_warm_up_sends_the_key_and_a_prompt_past_the_local_limit(keyed_proxy: str) -> None:
    headers = keys.auth_headers(KEY)
    warmup.warm_up(warmup.proxy_sender(keyed_proxy, "m", 5.0, 128, headers), sleep=lambda s: None)
    (body,) = _KeyedProxy.bodies
    # At least one token per number: past 128 tokens, so the proxy sends it P/D.
    assert len(body["prompt"].split(",")) > 128 + 1
    assert warmup.warmup_prompt(0) == warmup.PROMPT
    # Without the key the proxy refuses every try, and the warm-up fails naming the 401s.
    with pytest.raises(warmup.WarmupError, match="401"):
        warmup.warm_up(warmup.proxy_sender(keyed_proxy, "m", 5.0), sleep=lambda s: None)
    with pytest.raises(HttpError):
        warmup.proxy_sender(keyed_proxy, "m", 5.0, 0, {"Authorization": "Bearer no"})()


def test_the_stack_warms_up_with_its_key(
    key_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[int, dict[str, str]]] = []
    stack = Stack(example_settings(api_key_file=str(key_file)), work_dir=tmp_path)
    monkeypatch.setattr(
        warmup,
        "proxy_sender",
        lambda url, model, timeout_s, limit, headers: lambda: sent.append((limit, headers)),
    )
    stack.model = type("M", (), {"path": "m", "served_name": "m"})()  # type: ignore[assignment]
    stack._warm_up()
    assert sent == [(stack.settings.local_prefill_max_tokens, {"Authorization": f"Bearer {KEY}"})]


def test_the_demo_eval_gets_the_key_for_the_proxy_only(
    key_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, str | None] = {}

    class Done:
        def __init__(self, argv: list[str], env: dict[str, str], **kw: Any) -> None:
            seen[argv[argv.index("--base-url") + 1]] = env.get(keys.EVAL_KEY_VARIABLE)
            self.stdout = io.StringIO()
            self.pid, self.returncode = 0, 0

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.delenv(keys.EVAL_KEY_VARIABLE, raising=False)
    monkeypatch.setattr("pcp_pd_kit.localstack.demo.subprocess.Popen", Done)
    parts = ("prefill", "decode", "proxy", "reference")
    stack = Stack(example_settings(api_key_file=str(key_file)), parts=parts, work_dir=tmp_path)
    task = type("T", (), {"eval_env": {}, "label": "t", "max_gen_toks": 8, "data_dir": None})
    task.num_fewshot = None  # type: ignore[attr-defined]
    run_eval(stack, 1, task=task, target="proxy")  # type: ignore[arg-type]
    run_eval(stack, 1, task=task, target="reference")  # type: ignore[arg-type]
    assert seen == {stack.urls["proxy"]: KEY, stack.urls["reference"]: None}
