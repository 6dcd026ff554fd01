"""`docker compose --profile cpu up -d` for real, ready at the proxy's /health, in the kit's
topology (a PCP2 + EP2 prefill, a PCP1 decode, the tiny MLA + MoE model): P/D correctness
against both servers answering alone, the replicated-PCP invariants through the Prometheus
container, the eval, security defaults, a killed decode and a restarted prefill.

Tests run in file order on one session stack; the fault suite (test_faults.py) and the `down`
check (test_teardown.py) follow on the same stack.
"""

from __future__ import annotations

import json
import json as _json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pcp_nixl_connector.amx import AmxStatus, cpu_has_amx
from pcp_pd_kit.localstack.report import dedup_invariants, failed, format_report
from pd_proxy.routing.cache.metrics import METRIC_NAMES as CACHE_METRIC_NAMES
from tests.support.paths import REPO

from .stack import ComposeStack, settled_prefill_view

pytestmark = pytest.mark.compose
MODEL = "tiny-mla-moe"
PROMPTS = {
    "tiny": {"prompt": "Hi"},  # fewer tokens than the PCP2 prefill has chunks
    "short": {"prompt": "The capital of France is"},
    "multi_block": {"prompt": " ".join(f"item {i} is a thing and" for i in range(40))},
}
CHAT = {"messages": [{"role": "user", "content": "Say something about the sea."}]}


def http(
    url: str, body: dict[str, Any] | None = None, key: str | None = None, timeout: float = 120
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"raw": raw.decode(errors="replace")}


def greedy_body(extra: dict[str, Any]) -> dict[str, Any]:
    return {**extra, "model": MODEL, "max_tokens": 16, "temperature": 0.0}


def text_of(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def alone(stack: ComposeStack, service: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request to one server's own API, inside its container: a plain, non-P/D vLLM
    request (no kv_transfer_params). decode-cpu answering alone is a PCP1 single instance;
    prefill-cpu answering alone runs the whole request on its PCP2 + EP2 ranks."""
    return stack.server_json(service, path, body)


def prom_query(stack: ComposeStack, expr: str) -> list[dict[str, Any]]:
    url = f"{stack.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, answer = http(url, timeout=30)
    assert status == 200 and answer.get("status") == "success", (expr, answer)
    return answer["data"]["result"]


def prom_value(stack: ComposeStack, expr: str, until: float = 60) -> float | None:
    """The summed value of ``expr`` once Prometheus has it (scrapes run every 5 s)."""
    deadline = time.monotonic() + until
    while True:
        result = prom_query(stack, expr)
        if result:
            return sum(float(r["value"][1]) for r in result)
        if time.monotonic() > deadline:
            return None
        time.sleep(2)


def container_id(stack: ComposeStack, service: str) -> str:
    return stack.compose("ps", "-q", service).strip()


def test_up_brings_the_stack_up_with_each_server_on_its_own_cores(compose_stack) -> None:
    took = compose_stack.up_seconds
    print(f"\n`docker compose --profile cpu up -d` to the proxy's /health 200: {took:.0f}s")
    cpusets = {}
    for service in ("prefill-cpu", "decode-cpu"):
        raw = subprocess.run(
            [
                "docker",
                "inspect",
                "--format",
                "{{.HostConfig.CpusetCpus}}",
                container_id(compose_stack, service),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        cpusets[service] = raw
    assert all(cpusets.values()), cpusets
    assert cpusets == {
        "prefill-cpu": compose_stack.env.get("PREFILL_CPUS", "0,1"),
        "decode-cpu": compose_stack.env.get("DECODE_CPUS", "1"),
    }, cpusets


def test_only_the_proxy_is_published(compose_stack) -> None:
    for service, port, knob in (
        ("prefill-cpu", 8100, "PREFILL_PORT"),
        ("decode-cpu", 8200, "DECODE_PORT"),
    ):
        out = compose_stack.compose("port", service, str(port), check=False)
        assert re.search(r":\d+\s*$", out.strip()) is None, f"{service} is published: {out}"
        with socket.socket() as sock:
            sock.settimeout(3)
            assert sock.connect_ex(("127.0.0.1", int(compose_stack.env[knob]))) != 0, service
    status, _ = http(f"{compose_stack.proxy_url}/health")
    assert status == 200


def test_a_request_without_the_key_is_refused_before_any_backend(compose_stack) -> None:
    body = greedy_body(PROMPTS["short"])
    url = f"{compose_stack.proxy_url}/v1/completions"
    status, answer = http(url, body)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer
    status, answer = http(url, body, key="sk-wrong")
    assert status == 401, answer
    status, answer = http(url, body, key=compose_stack.api_key)
    assert status == 200, answer


@pytest.mark.parametrize("name", [*PROMPTS, "chat"])
def test_greedy_pd_output_equals_a_single_instance(compose_stack, name) -> None:
    path, extra = (
        ("/v1/chat/completions", CHAT) if name == "chat" else ("/v1/completions", PROMPTS[name])
    )
    body = greedy_body(extra)
    start = time.monotonic()
    status, pd = http(f"{compose_stack.proxy_url}{path}", body, key=compose_stack.api_key)
    pd_seconds = time.monotonic() - start
    assert status == 200, pd
    pcp1 = alone(compose_stack, "decode-cpu", path, body)
    pcp2 = alone(compose_stack, "prefill-cpu", path, body)
    print(f"\n{name}: P/D through the compose proxy {pd_seconds * 1000:.0f} ms")
    assert text_of(pd) == text_of(pcp1) == text_of(pcp2)
    for count in ("prompt_tokens", "completion_tokens"):
        assert pd["usage"][count] == pcp1["usage"][count], count


def test_the_prefill_runs_pcp2_ep2_on_model_runner_v2_with_the_kit_fixes(compose_stack) -> None:
    prefill = compose_stack.logs("prefill-cpu", tail=100000)
    decode = compose_stack.logs("decode-cpu", tail=100000)
    assert "Worker_PCP0_EP0" in prefill and "Worker_PCP1_EP1" in prefill
    assert "Using V2 Model Runner" in prefill
    # vLLM's own "non-default args" line: the flags the entrypoint added reached the engine.
    assert "'prefill_context_parallel_size': 2" in prefill
    assert "'enable_expert_parallel': True" in prefill
    for text in (prefill, decode):
        assert "CPU fix: rotary embedding" in text and "CPU fix: expert-parallel MoE" in text
    assert "Worker_PCP" not in decode


def test_kv_crossed_nixl_as_the_prometheus_container_sees_it(compose_stack) -> None:
    external = prom_value(
        compose_stack,
        'sum(vllm:prompt_tokens_by_source_total{job="decode",source="external_kv_transfer"}) > 0',
    )
    assert external and external > 0, "decode computed every prompt itself: no KV crossed NIXL"
    transfers = prom_value(
        compose_stack, 'sum(vllm:nixl_xfer_time_seconds_count{job="decode"}) > 0'
    )
    assert transfers and transfers > 0
    failures = prom_value(compose_stack, "sum(vllm:nixl_num_failed_transfers_total)")
    assert failures == 0
    targets = prom_query(compose_stack, "up")
    assert {t["metric"]["job"]: t["value"][1] for t in targets} == {
        "prefill": "1",
        "decode": "1",
        "proxy": "1",
    }


def test_replicated_pcp_invariants_as_the_prometheus_container_sees_them(compose_stack) -> None:
    """After one more request, read back once prefill settled and was scraped again: canonical
    completions = P/D requests held, suppressed = completions x (PCP-1), one skipped handshake
    publication, prefill KV at 0 well inside the lease and nothing expired."""
    status, _ = http(
        f"{compose_stack.proxy_url}/v1/completions",
        greedy_body(PROMPTS["multi_block"]),
        key=compose_stack.api_key,
    )
    assert status == 200
    view, seconds = settled_prefill_view(compose_stack, timeout_s=25)
    print(f"\nprefill settled {seconds:.1f}s after the request: {view}")
    checks = dedup_invariants(view, pcp=int(compose_stack.env.get("CPU_PREFILL_PCP_SIZE", "2")))
    assert not failed(checks), format_report(checks)
    assert prom_value(compose_stack, 'sum(vllm:nixl_num_kv_expired_reqs_total{job="prefill"})') == 0


def test_worker_logs_show_amx_permission_and_cpu_knobs(compose_stack) -> None:
    want_amx = AmxStatus(supported=cpu_has_amx(), permitted=cpu_has_amx()).describe()
    for service in ("prefill-cpu", "decode-cpu"):
        logs = compose_stack.logs(service, tail=100000)
        assert want_amx in logs, service
        assert "NIXL progress thread delay set to 1000 us" in logs, service
        assert "instead of NIXL's KV core pinning" in logs, service
    # UCX_PROTO_INFO: the transport the decode's KV pull really used (docs/gpu.md points here).
    decode = compose_stack.logs("decode-cpu", tail=100000)
    pull = decode[decode.index("remote memory read") :][:1200]
    assert "tcp/" in pull, pull


def test_gsm8k_eval_through_the_compose_proxy(compose_stack, tmp_path) -> None:
    env = {
        **os.environ,
        "OPENAI_API_KEY": compose_stack.api_key,
        "EXPECTED_SCORE": "0.0",
        "SCORE_TOLERANCE": "0.0",
    }
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "eval_gsm8k.sh"),
            "--base-url",
            compose_stack.proxy_url,
            "--limit",
            "2",
            "--num-concurrent",
            "2",
            "--max-gen-toks",
            "32",
            "--data-dir",
            str(REPO / "scripts" / "data" / "gsm8k_slice"),
            "--output-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = next(Path(tmp_path).glob("**/manifest*.json"), None)
    assert manifest is not None, list(tmp_path.rglob("*"))
    assert "verdict" in _json.loads(manifest.read_text()) or manifest.read_text()


@pytest.mark.repeat
def test_a_restarted_prefill_leaves_decode_running_and_serves_again(compose_stack) -> None:
    """Decode shares nothing with prefill's processes (GPU: a holder owns the shared namespaces),
    so `docker compose restart prefill-cpu` leaves the decode container as it was. A repeat
    check: test_faults.py's prefill restart proves the same under load (decode untouched, the
    right text again, KV back to 0), so `make test` restarts prefill once, there."""
    before = compose_stack.container_state("decode-cpu")
    start = time.monotonic()
    compose_stack.compose("restart", "prefill-cpu", timeout=240)
    url = f"{compose_stack.proxy_url}/v1/completions"
    body = greedy_body(PROMPTS["short"])
    want = text_of(alone(compose_stack, "decode-cpu", "/v1/completions", body))
    deadline = time.monotonic() + 300
    while True:
        status, answer = http(url, body, key=compose_stack.api_key, timeout=60)
        if status == 200:
            break
        assert status in (502, 503), (status, answer)
        assert time.monotonic() < deadline, f"no answer after the prefill restart: {answer}"
        time.sleep(3)
    print(f"\nserving again {time.monotonic() - start:.0f}s after `restart prefill-cpu`")
    assert text_of(answer) == want
    assert compose_stack.container_state("decode-cpu") == before


def test_a_killed_decode_is_a_clear_error_and_start_brings_it_back(compose_stack) -> None:
    url = f"{compose_stack.proxy_url}/v1/completions"
    body = greedy_body(PROMPTS["short"])
    compose_stack.compose("kill", "decode-cpu")
    status, answer = http(url, body, key=compose_stack.api_key, timeout=60)
    assert status in (502, 503), (status, answer)
    assert "decode" in json.dumps(answer).lower(), answer
    compose_stack.compose("start", "decode-cpu")
    deadline = time.monotonic() + 300
    while True:
        status, answer = http(url, body, key=compose_stack.api_key, timeout=60)
        if status == 200:
            break
        assert time.monotonic() < deadline, f"decode did not come back: {status} {answer}"
        time.sleep(3)


def test_every_grafana_panel_query_returns_data(compose_stack) -> None:
    """After the decode kill, so the error panels have their series too."""
    print(
        "\nGrafana's image cannot be had on this machine (no registry, no package): its panels'"
        " PromQL is evaluated against the live Prometheus container instead."
    )
    dashboard = json.loads((REPO / "compose/grafana/dashboards/pcp-pd-kit.json").read_text())
    # The cache router's series exist only where it runs (PREFIX_CACHE_ROUTING, auto by default;
    # they start at 0 even when one replica per role leaves nothing to decide); with it off, its
    # queries are the one kind allowed to be empty, and nothing else is.
    proxy_env = compose_stack.rendered()["services"]["proxy-cpu"]["environment"]
    routing_off = proxy_env.get("PD_PROXY_PREFIX_CACHE_ROUTING", "off") == "off"
    empty = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "2m")
            if routing_off and any(name in expr for name in CACHE_METRIC_NAMES):
                continue
            if not prom_value(compose_stack, expr, until=30) and not prom_query(
                compose_stack, expr
            ):
                empty.append(f"{panel['title']}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
