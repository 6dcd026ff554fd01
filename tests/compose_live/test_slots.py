"""Slots by lease on the live cpu stack: PREFILL_REPLICAS=2, then the moves that used
to break compose's container-number slots. `docker rm -f` of replica 1 then `up -d` (compose
names the new container 3 of 2, which the old entrypoint refused), scaling down and up again
(which replicas survive is compose's choice), and `--scale` past the count (the extra replica
must wait and say so, not start on another replica's share). Each replica's start-up line names
the slot it leased; at the end the two serving replicas hold slots 1 and 2 and both prefill
requests through the proxy. About 8 minutes on 2 cores, most of it prefill replicas starting.
"""

from __future__ import annotations

import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .stack import UP, ComposeStack
from .test_cpu_deployment import PROMPTS, greedy_body, http, text_of
from .test_replicas import (
    docker,
    proxy_prefill_backends,
    replica_containers,
    served_by_replica,
    wait_until,
)

# About 10 minutes of replica churn (three scale and rm scenarios): behind the `repeat` marker, so
# `make test` stays inside CI's time. Run them with
# `pytest -m 'compose and repeat' tests/compose_live/test_slots.py`.
pytestmark = [pytest.mark.compose, pytest.mark.repeat]
SLOT_LINE = re.compile(r"vllm_serve: replica (\d+) of (\d+) \(lease (prefill-slot-\d+)\)")
WAITING = "every prefill slot is held"


def container_logs(name: str) -> str:
    proc = subprocess.run(
        ["docker", "logs", name], capture_output=True, text=True, timeout=60, check=False
    )
    return proc.stdout + proc.stderr


def slot_of(name: str) -> str:
    """The slot a replica's latest start-up line names."""
    found = SLOT_LINE.findall(container_logs(name))
    assert found, f"{name} logged no slot lease:\n{container_logs(name)[-2000:]}"
    return str(found[-1][2])


def both_serve(stack: ComposeStack) -> None:
    """Two healthy prefill backends in the proxy, and 8 concurrent requests through it answered
    200 with each replica prefilling some of them (Prometheus counts per replica)."""
    wait_until(
        "pd-proxy sees two healthy prefill backends",
        lambda: sum(proxy_prefill_backends(stack).values()) >= 2,
        600,
        every_s=5,
    )
    wait_until("Prometheus scrapes both replicas", lambda: len(served_by_replica(stack)) >= 2, 90)
    before = served_by_replica(stack)
    url = f"{stack.proxy_url}/v1/completions"
    bodies = [greedy_body({"prompt": f"{PROMPTS['short']['prompt']} {i}"}) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: http(url, b, key=stack.api_key, timeout=300), bodies))
    assert [status for status, _ in answers] == [200] * 8, answers
    assert all(text_of(answer) for _, answer in answers)
    names = set(served_by_replica(stack))

    def counted() -> dict[str, float] | None:
        now = served_by_replica(stack)
        delta = {inst: now.get(inst, 0.0) - before.get(inst, 0.0) for inst in now}
        return delta if sum(delta.values()) >= 8 else None

    delta = wait_until("Prometheus counts the 8 prefills", counted, 90)
    live = {inst: n for inst, n in delta.items() if inst in names and n > 0}
    assert len(live) == 2, delta


def test_rm_then_up_wait_takes_the_freed_slot_and_both_serve(two_prefills) -> None:
    stack = two_prefills
    first, second = replica_containers(stack)
    assert {slot_of(first), slot_of(second)} == {"prefill-slot-1", "prefill-slot-2"}
    # Remove the first: compose names the next container max+1 = 3 (removing the last one
    # would give its number back, measured with Compose 2.40.3).
    gone = slot_of(first)
    docker("rm", "-f", first)
    start = time.monotonic()
    # Exactly the user's command: `up -d --wait` waits for every service's health check, so it
    # succeeds only when the recreated replica took a slot and started.
    out = stack.compose(*UP, "--wait", "--wait-timeout", "900", timeout=1020)
    stack.up(timeout_s=300, prefills=2)  # and the proxy routes to both
    names = replica_containers(stack)
    assert len(names) == 2 and first not in names, (names, out[-2000:])
    (new,) = set(names) - {second}
    assert new.endswith("-3"), names  # the number 3 of 2 the old entrypoint refused (exit 2)
    assert slot_of(new) == gone and slot_of(second) != gone
    print(f"\nrm -f + up: {new} on {gone} healthy {time.monotonic() - start:.0f}s later")
    both_serve(stack)


def test_scale_past_the_count_waits_and_says_so(two_prefills) -> None:
    stack = two_prefills
    serving = replica_containers(stack)
    stack.compose("--profile", "cpu", "up", "-d", "--no-recreate", "--scale", "prefill-cpu=3")
    extra = [n for n in replica_containers(stack) if n not in serving]
    assert len(extra) == 1, replica_containers(stack)
    logs = wait_until(
        "the third replica says it waits for a slot",
        lambda: (lambda text: text if WAITING in text else None)(container_logs(extra[0])),
        120,
    )
    assert "PREFILL_REPLICAS=2, so this container is one too many" in logs
    assert not SLOT_LINE.search(logs)  # never started vLLM on a slot
    state = subprocess.run(
        ["docker", "inspect", "--format", "{{.State.Status}} {{.RestartCount}}", extra[0]],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert state == ["running", "0"], state  # waiting, not crashing into the restart hold
    stack.compose("--profile", "cpu", "up", "-d", "--no-recreate", "--scale", "prefill-cpu=2")
    assert replica_containers(stack) == sorted(serving)


def test_scale_down_and_up_ends_on_disjoint_slots(two_prefills) -> None:
    stack = two_prefills
    stack.compose("--profile", "cpu", "up", "-d", "--no-recreate", "--scale", "prefill-cpu=1")
    (kept,) = replica_containers(stack)
    held = slot_of(kept)
    out = stack.compose(
        "--profile",
        "cpu",
        "up",
        "-d",
        "--wait",
        "--wait-timeout",
        "600",
        "--no-recreate",
        "--scale",
        "prefill-cpu=2",
        timeout=900,
        check=False,
    )
    names = replica_containers(stack)
    assert len(names) == 2, (names, out[-2000:])
    (new,) = set(names) - {kept}
    assert slot_of(kept) == held and slot_of(new) != held
    both_serve(stack)
