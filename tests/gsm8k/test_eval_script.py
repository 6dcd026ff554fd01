"""scripts/eval_gsm8k.sh (pcp-pd-kit eval) end to end, through the real pd-proxy, with fake
GSM8K-answering backends that speak the kv_transfer_params protocol, on the offline data slice.
Both verdicts, and errors."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from pcp_pd_kit.gsm8k import finish
from tests.support import net, procs
from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "eval_gsm8k.sh"
SLICE = REPO / "scripts" / "data" / "gsm8k_slice"
FAKE = [sys.executable, "-m", "pd_proxy.testing.fake_vllm"]
ENGINE = "fake-prefill-engine"  # the decode accepts KV handles from this prefill only
MODEL = "fake/DeepSeek-V2-Lite-Chat"  # ends like the reference model: the built-in 0.65 applies
LIMIT = 20


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5):
        pass


def _metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not in metrics")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """prefill fake + decode fake behind a real pd-proxy subprocess."""
    logs = tmp_path_factory.mktemp("stack")
    proxy_port, prefill_port, decode_port = net.free_ports(3)
    base = "http://127.0.0.1:{}"
    env = dict(os.environ)
    fake = [*FAKE, "--model", MODEL, "--gsm8k-data", str(SLICE)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            procs.running(
                [*fake, "--role", "prefill", "--port", str(prefill_port), "--engine-id", ENGINE],
                logs / "prefill.log",
                base.format(prefill_port) + "/health",
                env,
            )
        )
        stack.enter_context(
            procs.running(
                [*fake, "--role", "decode", "--port", str(decode_port)]
                + ["--prefill-engine-id", ENGINE],
                logs / "decode.log",
                base.format(decode_port) + "/health",
                env,
            )
        )
        proxy_argv = [sys.executable, "-m", "pd_proxy", "--host", "127.0.0.1"]
        proxy_argv += ["--port", str(proxy_port), "--prefill", base.format(prefill_port)]
        proxy_argv += ["--decode", base.format(decode_port)]
        stack.enter_context(
            procs.running(proxy_argv, logs / "proxy.log", base.format(proxy_port) + "/health", env)
        )
        yield {
            "proxy": base.format(proxy_port),
            "prefill": base.format(prefill_port),
            "decode": base.format(decode_port),
        }


def run_eval(stack: dict, out: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("EXPECTED_SCORE", "SCORE_TOLERANCE")}
    env.update(env_extra)
    argv = [str(SCRIPT), "--base-url", stack["proxy"], "--output-dir", str(out)]
    argv += ["--prefill-url", stack["prefill"], "--decode-url", stack["decode"], *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=150)


def test_pass_branch_with_builtin_expectation(stack, tmp_path) -> None:
    """Decode answers 13 of 20 right = 0.65: inside DeepSeek-V2-Lite-Chat's 0.65 +- 0.05."""
    _post(stack["decode"] + "/fake/mode", {"mode": "mixed"})
    before = _metric(_get(stack["decode"] + "/metrics"), 'fake_requests_total{result="ok"}')
    res = run_eval(stack, tmp_path, "--limit", str(LIMIT), "--data-dir", str(SLICE))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "PASS" in res.stdout

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["verdict"]["passed"] is True
    assert manifest["verdict"]["score"] == pytest.approx(0.65)
    assert manifest["verdict"]["expected"] == 0.65
    assert manifest["verdict"]["expected_source"] == "built-in table"
    assert manifest["settings"]["name"] == "custom"  # .env.example's defaults, not the reference
    assert manifest["settings"]["knobs"]["MOE_BACKEND"] == "auto"
    assert manifest["result"]["samples"] == LIMIT
    assert manifest["run"]["task"] == "gsm8k_offline"
    assert manifest["versions"]["packages"]["lm_eval"] == "0.4.13"
    topo = manifest["topology"]
    assert topo["proxy"]["models"][0]["id"] == MODEL
    assert topo["prefill"]["version"] == "0.32.0-fake"
    assert topo["decode"]["metrics"]["cache_config"]["block_size"] == "128"
    decode_counters = topo["decode"]["metrics"]["counters"]
    assert decode_counters['vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'] > 0

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["results"]["gsm8k_offline"]["exact_match,strict-match"] == pytest.approx(0.65)

    # Every question went prefill -> decode through the proxy, with KV handles the decode accepted.
    decode_metrics = _get(stack["decode"] + "/metrics")
    assert _metric(decode_metrics, 'fake_requests_total{result="ok"}') - before == LIMIT
    assert _metric(decode_metrics, 'fake_requests_total{result="rejected"}') == 0
    proxy_metrics = _get(stack["proxy"] + "/metrics")
    done = 'pd_proxy_requests_total{endpoint="/v1/completions",path="pd",status="200"}'
    assert _metric(proxy_metrics, done) >= LIMIT

    # Two-sided: the same run judged against 0.5 +- 0.05 is too *good* and must fail.
    returncode = finish.judge(
        tmp_path,
        task="gsm8k_offline",
        model=MODEL,
        base_url=stack["proxy"],
        servers={},
        run=manifest["run"],
        env={**os.environ, "EXPECTED_SCORE": "0.5"},
    )
    assert returncode == 1
    assert json.loads((tmp_path / "manifest.json").read_text())["verdict"]["passed"] is False


def test_fail_branch_exits_1_with_manifest(stack, tmp_path) -> None:
    _post(stack["decode"] + "/fake/mode", {"mode": "wrong"})
    try:
        res = run_eval(
            stack, tmp_path, "--limit", "10", "--num-concurrent", "4", "--data-dir", str(SLICE)
        )
    finally:
        _post(stack["decode"] + "/fake/mode", {"mode": "mixed"})
    assert res.returncode == 1, res.stderr[-3000:]
    assert "FAIL" in res.stdout
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["verdict"]["passed"] is False
    assert manifest["verdict"]["score"] == 0.0
    assert manifest["result"]["samples"] == 10
    assert manifest["run"]["num_concurrent"] == "4"


def test_unknown_model_needs_expected_score(stack, tmp_path) -> None:
    res = run_eval(stack, tmp_path, "--model", "my-org/tiny-random", "--data-dir", str(SLICE))
    assert res.returncode == 2
    assert "EXPECTED_SCORE" in res.stderr
    assert not (tmp_path / "manifest.json").exists()


def test_unreachable_proxy_is_a_clear_error(tmp_path) -> None:
    (port,) = net.free_ports(1)
    res = subprocess.run(
        [str(SCRIPT), "--base-url", f"http://127.0.0.1:{port}", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert f"cannot reach the proxy at http://127.0.0.1:{port}" in res.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--limit", "0"], "--limit must be a positive integer"),
        (["--num-concurrent", "x"], "--num-concurrent must be a positive integer"),
        (["--bogus"], "unknown argument '--bogus'"),
        (["--limit"], "--limit needs a value"),
    ],
)
def test_bad_arguments(args: list[str], needle: str) -> None:
    res = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert needle in res.stderr


def test_bad_data_dir(stack, tmp_path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    res = run_eval(stack, tmp_path / "out", "--data-dir", str(tmp_path / "data"))
    assert res.returncode == 2
    assert "train.jsonl is missing" in res.stderr


def slice_problems(data_dir: Path) -> list[str]:
    """The offline slice holds what its SOURCE says: the first N GSM8K rows of each split, each a
    question with a '#### <number>' answer, no row twice, under the dataset's MIT licence."""
    problems = []
    source = (data_dir / "SOURCE").read_text(encoding="utf-8")
    counts = dict(
        (split, int(n)) for n, split in re.findall(r"[Ff]irst (\d+) rows of (\w+)\.jsonl", source)
    )
    if set(counts) != {"test", "train"}:
        problems.append(f"SOURCE does not say how many rows of each split: {counts}")
    for split, want in counts.items():
        rows = (data_dir / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        if len(rows) != want:
            problems.append(f"{split}.jsonl has {len(rows)} rows, SOURCE says {want}")
        questions = set()
        for lineno, line in enumerate(rows, start=1):
            try:
                row = json.loads(line)
            except ValueError:
                problems.append(f"{split}.jsonl:{lineno}: not JSON")
                continue
            answer = str(row.get("answer", ""))
            if not row.get("question") or not re.search(r"\n#### -?[\d,.]+$", answer):
                problems.append(f"{split}.jsonl:{lineno}: no question or '#### <number>' answer")
            if row.get("question") in questions:
                problems.append(f"{split}.jsonl:{lineno}: repeated question")
            questions.add(row.get("question"))
    licence = data_dir / "LICENSE"
    if not licence.is_file() or not licence.read_text().startswith("MIT License"):
        problems.append("LICENSE is not the dataset's MIT licence")
    return problems


def test_the_kits_slice_is_what_its_source_says() -> None:
    assert slice_problems(SLICE) == []


def test_slice_check_catches_a_damaged_copy(tmp_path) -> None:
    damaged = tmp_path / "slice"
    shutil.copytree(SLICE, damaged)
    rows = (damaged / "test.jsonl").read_text().splitlines()
    row = json.loads(rows[1])
    row["answer"] = row["answer"].rsplit("####", 1)[0]
    (damaged / "test.jsonl").write_text("\n".join([rows[0], json.dumps(row), rows[0]]) + "\n")
    (damaged / "LICENSE").unlink()
    problems = slice_problems(damaged)
    assert any("has 3 rows" in p for p in problems), problems
    assert "test.jsonl:2: no question or '#### <number>' answer" in problems
    assert "test.jsonl:3: repeated question" in problems
    assert "LICENSE is not the dataset's MIT licence" in problems
