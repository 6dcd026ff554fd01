"""xPyD on the live cpu stack: PREFILL_REPLICAS=2 through `docker compose up`, as a user runs it.

The session stack (1P1D) is brought to two prefill replicas with the knob itself, not `--scale`:
compose adds `prefill-cpu-2` and recreates `prefill-cpu-1` (its KIT_ROLE_REPLICAS changed), the
other services stay as they are. pd-proxy finds the new
replica by DNS (the `prefill` alias now has two A records), Prometheus scrapes it by DNS service
discovery, and 16 concurrent requests through the proxy all answer 200 with each replica having
prefilled some of them (counted per replica by Prometheus). A replica stopped by hand leaves the
proxy's pool (requests keep answering 200) and rejoins it once started again. The stack goes back
to one replica at the end only when a later test needs it (conftest.py).

Both prefill replicas run on the prefill's cpuset (PREFILL_CPUS, cores 0 and 1 by default), the
decode on core 1 beside them (their workers sleep while they wait, docs/cpu.md). Most of
the module's time is the second prefill starting, twice (the scale-up and the rejoin).
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .stack import ComposeStack
from .test_cpu_deployment import PROMPTS, greedy_body, http, prom_query, text_of

pytestmark = [pytest.mark.compose, pytest.mark.slow]
CONCURRENT = 16
REPLICA_JOINS_WITHIN_S = 90
# Per prefill replica: requests it prefilled (finished with its one token), as Prometheus sees them.
SERVED = 'sum by (instance) (vllm:request_success_total{job="prefill"})'


def served_by_replica(stack: ComposeStack) -> dict[str, float]:
    return {r["metric"]["instance"]: float(r["value"][1]) for r in prom_query(stack, SERVED)}


def wait_until(what: str, check, timeout_s: float, every_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(every_s)


def docker(*args: str) -> None:
    subprocess.run(["docker", *args], capture_output=True, timeout=180, check=True)


def replica_containers(stack: ComposeStack, stopped_too: bool = False) -> list[str]:
    extra = ["-a"] if stopped_too else []
    out = stack.compose("--profile", "cpu", "ps", *extra, "--format", "{{.Name}}", "prefill-cpu")
    return sorted(line.strip() for line in out.splitlines() if line.strip())


def side_channel_host(container: str) -> str:
    """The NIXL side-channel host the entrypoint gave this replica's vLLM (its start-up line)."""
    logs = subprocess.run(
        ["docker", "logs", container], capture_output=True, text=True, timeout=60, check=True
    )
    found = re.findall(r"vllm_serve: NIXL side channel (\S+)", logs.stdout + logs.stderr)
    assert found, f"{container} logged no side-channel host"
    return str(found[-1])


def proxy_prefill_backends(stack: ComposeStack) -> dict[str, float]:
    """pd-proxy's view: prefill backend -> healthy (1) or not (0), from Prometheus."""
    rows = prom_query(stack, 'pd_proxy_backend_healthy{job="proxy", role="prefill"}')
    return {r["metric"]["backend"]: float(r["value"][1]) for r in rows}


def test_the_knob_runs_two_prefill_replicas_each_with_its_own_side_channel(two_prefills) -> None:
    stack = two_prefills
    names = replica_containers(stack)
    rendered = stack.rendered()["services"]
    assert rendered["prefill-cpu"]["scale"] == 2
    assert rendered["decode-cpu"]["scale"] == 1
    # Each replica publishes its own address as the NIXL side-channel host (the entrypoint's
    # default): decode must pull from the replica that prefilled, not from the alias.
    hosts = {name: side_channel_host(name) for name in names}
    assert len(set(hosts.values())) == 2, hosts
    for name, host in hosts.items():
        assert ipaddress.ip_address(host), (name, host)


def test_sixteen_concurrent_requests_answer_200_and_both_replicas_prefill(two_prefills) -> None:
    stack = two_prefills
    wait_until(
        "pd-proxy sees two healthy prefill backends",
        lambda: sum(proxy_prefill_backends(stack).values()) >= 2,
        REPLICA_JOINS_WITHIN_S,
    )
    wait_until("Prometheus scrapes both replicas", lambda: len(served_by_replica(stack)) == 2, 60)
    before = served_by_replica(stack)
    url = f"{stack.proxy_url}/v1/completions"
    bodies = [
        greedy_body({"prompt": f"{PROMPTS['short']['prompt']} {i}"}) for i in range(CONCURRENT)
    ]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda b: http(url, b, key=stack.api_key, timeout=300), bodies))
    assert [status for status, _ in answers] == [200] * CONCURRENT, answers
    assert all(text_of(answer) for _, answer in answers)

    def counted() -> dict[str, float] | None:
        now = served_by_replica(stack)
        delta = {inst: now.get(inst, 0.0) - before.get(inst, 0.0) for inst in now}
        return delta if sum(delta.values()) >= CONCURRENT else None

    delta = wait_until("Prometheus counts all 16 prefills", counted, 60)
    print(f"\nprefills per replica for {CONCURRENT} concurrent requests: {delta}")
    assert len(delta) == 2 and all(n > 0 for n in delta.values()), delta


def test_a_stopped_replica_leaves_the_pool(two_prefills) -> None:
    """The second replica stopped by hand leaves pd-proxy's pool (its DNS record goes) and
    requests keep answering 200. It stays stopped: `down` removes it, and a later test that
    needs the stack's replicas gets them back from the fixture's `up`."""
    stack = two_prefills
    _stop_second_and_serve(stack)


def test_a_stopped_replica_comes_back(two_prefills) -> None:
    """Started again, the replica rejoins the pool and serves (a full prefill start, so `slow`
    with the module, not `repeat`: the docs cite it as the proof that a replica rejoins)."""
    stack = two_prefills
    second = replica_containers(stack, stopped_too=True)[-1]
    if second in replica_containers(stack):  # running: run alone, not after the stop check
        _stop_second_and_serve(stack)
    docker("start", second)
    wait_until(
        "the restarted replica rejoins the pool",
        lambda: sum(proxy_prefill_backends(stack).values()) >= 2,
        600,
        every_s=5,
    )
    status, answer = http(
        f"{stack.proxy_url}/v1/completions",
        greedy_body(PROMPTS["short"]),
        key=stack.api_key,
        timeout=120,
    )
    assert status == 200, answer


def _stop_second_and_serve(stack: ComposeStack) -> None:
    url = f"{stack.proxy_url}/v1/completions"
    body = greedy_body(PROMPTS["short"])
    docker("stop", replica_containers(stack)[-1])
    wait_until(
        "pd-proxy drops the stopped replica",
        lambda: sum(proxy_prefill_backends(stack).values()) == 1,
        REPLICA_JOINS_WITHIN_S,
    )
    for _ in range(4):
        status, answer = http(url, body, key=stack.api_key, timeout=120)
        assert status == 200, answer
