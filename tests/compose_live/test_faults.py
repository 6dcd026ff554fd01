"""Faults on the live compose deployment: bounded load through the proxy, one fault injected with
Docker, then four checks. Every client got the right text or a clear error (never 200 with wrong or
empty text); none waited past the proxy's documented limits; KV usage on both servers returns to 0
(prefill's within the lease); the stack serves again by itself, and how long that took is printed.

Runs after test_cpu_deployment.py on the same session stack, one fault at a time, before the
`down` check (test_teardown.py).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from pcp_pd_kit.localstack.report import parse_metrics, total
from pd_proxy.config import load_config

from .stack import ComposeStack

pytestmark = pytest.mark.compose
MODEL = "tiny-mla-moe"
PROMPTS = (
    "James has 3 apples and buys 5 more. How many",
    "Mary has 12 cookies and gives half to her friend. How many left?",
    " ".join(f"On day {day} the farmer sold {day * 7} eggs." for day in range(1, 7)),
)
MAX_TOKENS = 24
# The clients' own limit: what the proxy may take at most (proxy_limit_s) and a margin. A client
# still waiting then has been left hanging.
CLIENT_MARGIN_S = 15


@dataclass(frozen=True)
class Outcome:
    prompt: str
    status: int | None  # None: no HTTP answer at all (connection refused or reset)
    text: str | None
    seconds: float
    detail: str


def proxy_limit_s(stack: ComposeStack) -> float:
    """The longest the running proxy may take to answer, by its own rule (``answer_wait_s``) and
    from the environment Compose really gives ``proxy-cpu`` (``docker compose config``)."""
    env = stack.rendered()["services"]["proxy-cpu"]["environment"]
    env.pop("PD_PROXY_BACKEND_API_KEY_FILE")  # a path inside the container; not a limit
    return load_config([], environ=env).limits().answer_wait_s()


def ask(stack: ComposeStack, prompt: str, timeout_s: float) -> Outcome:
    """One P/D request. Its own ``cache_salt`` keeps prefix caching (on by default) from serving
    the prompt that ``expected`` cached on decode, so every request's whole KV crosses NIXL and the
    fault meets a full transfer."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "cache_salt": uuid.uuid4().hex,
    }
    request = urllib.request.Request(
        f"{stack.proxy_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {stack.api_key}"},
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            answer = json.loads(resp.read())
            return Outcome(prompt, resp.status, answer["choices"][0]["text"], _since(start), "")
    except urllib.error.HTTPError as exc:
        return Outcome(prompt, exc.code, None, _since(start), exc.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return Outcome(prompt, None, None, _since(start), repr(exc))


def _since(start: float) -> float:
    return time.monotonic() - start


@pytest.fixture(scope="module")
def expected(compose_stack: ComposeStack) -> dict[str, str]:
    """Each prompt's greedy text from decode-cpu answering alone (a PCP1 single instance)."""
    texts = {}
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        texts[prompt] = compose_stack.server_json("decode-cpu", "/v1/completions", body)["choices"][
            0
        ]["text"]
    return texts


class Load:
    """A bounded stream of requests on a few threads while a fault happens: ``per_thread``
    requests on each of ``threads``, one after the other."""

    def __init__(self, stack: ComposeStack, threads: int = 3, per_thread: int = 4) -> None:
        self.stack, self.threads, self.per_thread = stack, threads, per_thread
        self.timeout_s = proxy_limit_s(stack) + CLIENT_MARGIN_S
        self.pool = ThreadPoolExecutor(max_workers=threads)
        self.futures: list[Future[list[Outcome]]] = []

    def start(self) -> Load:
        for thread in range(self.threads):
            self.futures.append(self.pool.submit(self._run, thread))
        return self

    def _run(self, thread: int) -> list[Outcome]:
        out = []
        for i in range(self.per_thread):
            out.append(ask(self.stack, PROMPTS[(thread + i) % len(PROMPTS)], self.timeout_s))
        return out

    def outcomes(self) -> list[Outcome]:
        results = [o for f in self.futures for o in f.result(timeout=self.timeout_s * 5)]
        self.pool.shutdown()
        return results


def check_outcomes(
    outcomes: list[Outcome], expected: dict[str, str], limit_s: float, proxy_down: bool = False
) -> str:
    """The first two checks; returns a one-line summary for the log. No HTTP answer at all is
    a clear error only while the proxy itself is down (`proxy_down`): otherwise the proxy must
    answer every request."""
    wrong = [o for o in outcomes if o.status == 200 and o.text != expected[o.prompt]]
    assert not wrong, f"HTTP 200 with wrong or empty text: {wrong}"
    if not proxy_down:
        silent = [o for o in outcomes if o.status is None]
        assert not silent, f"the proxy gave no HTTP answer: {silent}"
    unclear = [
        o
        for o in outcomes
        if o.status not in (200, None)
        and not (400 <= (o.status or 0) < 600 and "error" in o.detail)
    ]
    assert not unclear, f"an error answer that is not an OpenAI-style error: {unclear}"
    slow = [o for o in outcomes if o.seconds > limit_s]
    assert not slow, f"clients waited past the documented {limit_s:.0f}s: {slow}"
    codes: dict[str, int] = {}
    for o in outcomes:
        key = str(o.status) if o.status is not None else "no-answer"
        codes[key] = codes.get(key, 0) + 1
    longest = max(o.seconds for o in outcomes)
    return f"{len(outcomes)} requests: {codes}, longest {longest:.1f}s"


def kv_usage(stack: ComposeStack, service: str) -> float | None:
    try:
        text = stack.server_json(service, "/metrics", timeout=20)
    except (subprocess.SubprocessError, ValueError):
        return None
    return total(parse_metrics(text), "vllm:kv_cache_usage_perc")


def wait_kv_zero(stack: ComposeStack, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    seen: dict[str, float | None] = {}
    while time.monotonic() < deadline:
        seen = {s: kv_usage(stack, s) for s in ("prefill-cpu", "decode-cpu")}
        if all(v == 0 for v in seen.values()):
            return
        time.sleep(2)
    raise AssertionError(f"KV usage not back to 0 within {within_s:.0f}s: {seen}")


def wait_serving(stack: ComposeStack, expected: dict[str, str], since: float, what: str) -> None:
    """The fourth check: the stack answers correctly again by itself; prints how long it took."""
    deadline = time.monotonic() + 420
    prompt = PROMPTS[0]
    while True:
        outcome = ask(stack, prompt, timeout_s=60)
        if outcome.status == 200:
            assert outcome.text == expected[prompt], outcome
            break
        assert time.monotonic() < deadline, f"not serving 420s after {what}: {outcome}"
        time.sleep(2)
    print(f"\n{what}: serving again {time.monotonic() - since:.0f}s after the fault")


def lease_s(stack: ComposeStack) -> float:
    return float(stack.env.get("NIXL_KV_LEASE_S", 30))


def container(stack: ComposeStack, service: str) -> str:
    return stack.compose("ps", "-q", service).strip()


def docker(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=True
    )
    return proc.stdout


def finish(
    stack: ComposeStack,
    load: Load,
    expected: dict[str, str],
    fault: str,
    t0: float,
    proxy_down: bool = False,
) -> None:
    summary = check_outcomes(load.outcomes(), expected, load.timeout_s, proxy_down)
    print(f"\n{fault}: {summary}")
    wait_serving(stack, expected, t0, fault)
    wait_kv_zero(stack, within_s=lease_s(stack) + 15)


# ------------------------------------------------------------------------------ the faults
# The servers share the holder's PID namespace, so /proc lists the other server's processes too:
# only those in this container's own cgroup are its own.
KILL_ENGINE = (
    "import os, signal\n"
    "mine = open('/proc/self/cgroup').read()\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    try:\n"
    "        name = open(f'/proc/{pid}/cmdline', 'rb').read()\n"
    "        group = open(f'/proc/{pid}/cgroup').read()\n"
    "    except OSError:\n"
    "        continue\n"
    "    if b'EngineCore' in name and group == mine:\n"
    "        os.kill(int(pid), signal.SIGKILL)\n"
)


def test_prefill_killed_mid_transfer(compose_stack, expected) -> None:
    """Prefill's engine dies under load (SIGKILL, as the OOM killer would); its container exits
    and `restart: unless-stopped` brings it back with no one touching it. Decode, in the same
    PID namespace (the holder's), is left alone."""
    before = compose_stack.container_state("prefill-cpu")
    decode_before = compose_stack.container_state("decode-cpu")
    load = Load(compose_stack).start()
    time.sleep(1.5)
    t0 = time.monotonic()
    compose_stack.compose("exec", "-T", "prefill-cpu", "python3", "-c", KILL_ENGINE, check=False)
    finish(compose_stack, load, expected, "prefill engine killed", t0)
    assert compose_stack.container_state("prefill-cpu")[2] > before[2], "prefill was not restarted"
    assert compose_stack.container_state("decode-cpu") == decode_before, "decode was restarted"


def pause(compose_stack: ComposeStack, service: str, tries: int = 3) -> None:
    """`docker compose pause`, tried again when the cgroup freezer gives up ("unable to freeze"):
    runc freezes within a fixed time, and a vLLM server busy forking threads on a loaded host can
    outlast it. runc thaws what it froze before it reports that, so a retry starts clean."""
    for attempt in range(1, tries + 1):
        try:
            compose_stack.compose("pause", service)
            return
        except AssertionError as error:
            if "unable to freeze" not in str(error) or attempt == tries:
                raise
        time.sleep(1)


def test_decode_paused_past_the_lease(compose_stack, expected) -> None:
    """A frozen decode stops its heartbeats: prefill's lease runs out and it frees the blocks.
    The proxy gives up on decode before that (its limit is shorter than the lease), so no client
    can get an answer built on freed blocks."""
    load = Load(compose_stack, threads=2, per_thread=2).start()
    time.sleep(0.5)
    t0 = time.monotonic()
    pause(compose_stack, "decode-cpu")
    try:
        time.sleep(lease_s(compose_stack) + 5)
    finally:
        compose_stack.compose("unpause", "decode-cpu")
    finish(compose_stack, load, expected, "decode paused past the lease", t0)


@pytest.mark.slow
def test_pd_network_cut_for_a_few_seconds(compose_stack, expected) -> None:
    """Decode's interface on the P/D network goes and comes back under another name. UCX keeps
    the interfaces it found at start, so the old decode process could never connect to a new
    prefill again (it did, once: every request after the next prefill restart failed); the
    entrypoint sees the change and exits 1, and Docker restarts decode on the new interface."""
    network = f"{compose_stack.env['COMPOSE_PROJECT_NAME']}_pd"
    decode = container(compose_stack, "decode-cpu")
    before = compose_stack.container_state("decode-cpu")
    load = Load(compose_stack).start()
    time.sleep(1)
    t0 = time.monotonic()
    docker("network", "disconnect", network, decode)
    try:
        time.sleep(5)
    finally:
        docker("network", "connect", "--alias", "decode", network, decode)
    finish(compose_stack, load, expected, "P/D network cut for 5s", t0)
    assert compose_stack.container_state("decode-cpu")[2] > before[2], "decode not restarted"
    assert "network interfaces changed since start" in compose_stack.logs("decode-cpu", tail="all")


def test_proxy_restarted_under_load(compose_stack, expected) -> None:
    """SIGTERM drains the proxy's in-flight requests; clients arriving while it restarts are
    refused at connect (no answer), never answered wrongly."""
    load = Load(compose_stack).start()
    time.sleep(1)
    t0 = time.monotonic()
    compose_stack.compose("restart", "proxy-cpu", timeout=120)
    finish(compose_stack, load, expected, "proxy restarted", t0, proxy_down=True)


@pytest.mark.slow
def test_prefill_restarted_while_decode_holds_pulled_blocks(compose_stack, expected) -> None:
    before = compose_stack.container_state("decode-cpu")
    load = Load(compose_stack).start()
    time.sleep(2)
    t0 = time.monotonic()
    compose_stack.compose("restart", "prefill-cpu", timeout=240)
    finish(compose_stack, load, expected, "prefill restarted", t0)
    assert compose_stack.container_state("decode-cpu") == before, "decode was restarted"


def test_a_cpu_throttled_prefill_is_slow_but_right(compose_stack, expected) -> None:
    prefill = container(compose_stack, "prefill-cpu")
    docker("update", "--cpus", "0.3", prefill)
    t0 = time.monotonic()
    try:
        load = Load(compose_stack, threads=2, per_thread=3).start()
        outcomes = load.outcomes()
    finally:
        docker("update", "--cpus", "0", prefill)
    summary = check_outcomes(outcomes, expected, load.timeout_s)
    assert all(o.status == 200 for o in outcomes), summary
    print(f"\nprefill throttled to 0.3 CPU: {summary}")
    wait_serving(compose_stack, expected, t0, "throttled prefill")
    wait_kv_zero(compose_stack, within_s=lease_s(compose_stack) + 15)
