"""``pcp-pd-kit eval``, the eval's one entry point: its error paths (each one clear line on
stderr and exit 2, never a traceback) and the offline task, which must be lm-eval's own gsm8k
reached through an ``include`` with only the dataset replaced."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pcp_pd_kit.gsm8k import EvalError, entry, offline_task
from pcp_pd_kit.settings import kit_env
from tests.support.paths import REPO

SLICE = REPO / "scripts" / "data" / "gsm8k_slice"
MODEL = "fake/DeepSeek-V2-Lite-Chat"  # the built-in 0.65 applies
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


class FakeProxy(http.server.ThreadingHTTPServer):
    """Answers each path with a canned (status, body); 404 for the rest. Records auth headers."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes: dict[str, tuple[int, str]] = {"/v1/models": (200, MODELS)}
        self.auth: list[str | None] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeProxy

    def _answer(self) -> None:
        self.server.auth.append(self.headers.get("Authorization"))
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        status, body = self.server.routes.get(self.path, (404, "{}"))
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[FakeProxy]:
    server = FakeProxy()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(autouse=True)
def restored_env(monkeypatch) -> None:
    """The entry point sets these in os.environ; monkeypatch puts them back after each test."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(name, os.environ.get(name, "1" if name.startswith("HF") else "false"))


def run_main(capsys, argv: list[str], **env: str) -> tuple[int, str, str]:
    layered = kit_env(os.environ)
    base = {k: v for k, v in layered.items() if k not in ("EXPECTED_SCORE", "OPENAI_API_KEY")}
    code = entry.main(argv, {**base, **env})
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert needle in err, err
    assert "Traceback" not in err, err
    assert err.count("eval_gsm8k: error: ") == 1, err


# --- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--num-fewshot", "-1"], "--num-fewshot must be a non-negative integer, got '-1'"),
        (["--max-gen-toks", "0"], "--max-gen-toks must be a positive integer, got '0'"),
        (["--limit=ten"], "--limit must be a positive integer, got 'ten'"),
        (["--model="], "--model needs a value"),
        (["extra"], "unknown argument 'extra'"),
    ],
)
def test_bad_arguments_in_process(capsys, args: list[str], needle: str) -> None:
    assert_clean_error(*run_main(capsys, args)[::2], needle)


def test_env_defaults_and_flags_win() -> None:
    from pcp_pd_kit.gsm8k import cli

    example = kit_env({})
    env = {**example, "PROXY_PORT": "9000", "LIMIT": "7", "DECODE_URL": "http://d:1"}
    s = cli.parse(["--limit", "3", "--base-url=http://p:2/"], env)
    assert s is not None
    want_fewshot = example["NUM_FEWSHOT"]
    assert (s.base_url, s.limit, s.num_fewshot) == ("http://p:2", "3", want_fewshot)
    want_prefill = f"http://127.0.0.1:{example['PREFILL_PORT']}"
    assert (s.prefill_url, s.decode_url) == (want_prefill, "http://d:1")
    assert cli.parse([], env).base_url == "http://127.0.0.1:9000"  # type: ignore[union-attr]
    with pytest.raises(EvalError, match="--limit must be a positive integer, got .0."):
        cli.parse([], {**example, "LIMIT": "0"})
    assert cli.parse(["--help"], {}) is None


def test_a_knob_missing_from_every_layer_is_named() -> None:
    from pcp_pd_kit.gsm8k import cli

    env = {k: v for k, v in kit_env({}).items() if k not in ("NUM_FEWSHOT", "PROXY_PORT")}
    with pytest.raises(EvalError, match="no value for NUM_FEWSHOT, PROXY_PORT: .env.example"):
        cli.parse([], env)


def test_module_entry_point_help_and_error() -> None:
    env = dict(os.environ)
    run = [sys.executable, "-m", "pcp_pd_kit", "eval"]
    res = subprocess.run([*run, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0 and "--max-gen-toks" in res.stdout and "EXPECTED_SCORE" in res.stdout
    res = subprocess.run([*run, "--limit"], capture_output=True, text=True, env=env, timeout=60)
    assert (res.returncode, res.stderr) == (
        2,
        "eval_gsm8k: error: --limit needs a value (see --help)\n",
    )


def test_missing_lm_eval_is_a_clear_error(capsys, monkeypatch) -> None:
    monkeypatch.setattr(entry, "lm_eval_installed", lambda: False)
    code, _, err = run_main(capsys, ["--base-url", "http://127.0.0.1:1"])
    assert_clean_error(code, err, "lm-eval is not installed")
    assert "pip install 'lm-eval[api]==0.4.13'" in err


# --- the proxy probe ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "key", "needle"),
    [
        ((401, "{}"), "", "wants an API key: set OPENAI_API_KEY"),
        ((401, "{}"), "wrong", "(the one set was refused)"),
        ((503, "{}"), "", "answered 503 on /v1/models: are its backends up?"),
        ((200, "<html>"), "", "did not return JSON: is"),
        ((200, '{"data": []}'), "", "/v1/models lists no models"),
    ],
)
def test_proxy_probe_errors(capsys, proxy, tmp_path, route, key, needle) -> None:
    proxy.routes["/v1/models"] = route
    argv = ["--base-url", proxy.url, "--output-dir", str(tmp_path / "out")]
    code, _, err = run_main(capsys, argv, OPENAI_API_KEY=key)
    assert_clean_error(code, err, needle)
    assert proxy.auth == [f"Bearer {key}" if key else None]
    assert not (tmp_path / "out").exists()


def test_base_url_without_scheme(capsys) -> None:
    code, _, err = run_main(capsys, ["--base-url", "127.0.0.1:8000"])
    assert_clean_error(code, err, "--base-url must be an http(s) URL, got '127.0.0.1:8000'")


# --- expectation, output and data dirs ---------------------------------------------------------


def test_unknown_served_model_needs_expected_score(capsys, proxy, tmp_path) -> None:
    proxy.routes["/v1/models"] = (200, json.dumps({"data": [{"id": "org/tiny"}]}))
    code, _, err = run_main(capsys, ["--base-url", proxy.url, "--output-dir", str(tmp_path / "o")])
    assert_clean_error(code, err, "no expected GSM8K score for model 'org/tiny'")
    assert not (tmp_path / "o").exists()


def test_output_dir_that_cannot_be_made(capsys, proxy, tmp_path) -> None:
    (tmp_path / "file").write_text("")
    argv = ["--base-url", proxy.url, "--output-dir", str(tmp_path / "file" / "out")]
    assert_clean_error(*run_main(capsys, argv)[::2], "cannot create output dir")


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        (None, "is not a directory"),
        ({"train.jsonl": '{"question": "q", "answer": "1"}\n'}, "test.jsonl is missing"),
        ({"train.jsonl": "not json\n", "test.jsonl": "{}\n"}, "first line is not JSON"),
    ],
)
def test_bad_data_dir(capsys, proxy, tmp_path, files, needle) -> None:
    data = tmp_path / "data"
    if files is not None:
        data.mkdir()
        for name, text in files.items():
            (data / name).write_text(text)
    argv = ["--base-url", proxy.url, "--output-dir", str(tmp_path / "out")]
    code, _, err = run_main(capsys, [*argv, "--data-dir", str(data)])
    assert_clean_error(code, err, needle)
    assert not (tmp_path / "out" / "manifest.json").exists()


# --- lm-eval failing ---------------------------------------------------------------------------


@pytest.mark.parametrize("offline_data", [True, False], ids=["offline", "hub"])
def test_lm_eval_call_and_its_failure(capsys, proxy, tmp_path, monkeypatch, offline_data) -> None:
    """What simple_evaluate is asked for; when it raises: one line, the traceback in the log."""
    import lm_eval.tasks
    from lm_eval import evaluator

    calls: dict = {}

    def manager(**kwargs: object) -> str:
        calls["manager"] = kwargs
        return "the task manager"

    def boom(**kwargs: object) -> None:
        calls["evaluate"] = kwargs
        raise RuntimeError("boom")

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", manager)
    monkeypatch.setattr(evaluator, "simple_evaluate", boom)
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    out = tmp_path / "out"
    argv = ["--base-url", proxy.url + "/", "--output-dir", str(out), "--limit", "7"]
    argv += ["--data-dir", str(SLICE)] if offline_data else []
    code, stdout, err = run_main(capsys, [*argv, "--num-concurrent", "3", "--max-gen-toks", "64"])

    assert_clean_error(code, err, f"lm-eval failed: RuntimeError: boom (log: {out}/lm_eval.log)")
    log = (out / "lm_eval.log").read_text()
    assert "Traceback" in log and "RuntimeError: boom" in log
    assert "PASS" not in stdout and "FAIL" not in stdout
    assert not (out / "manifest.json").exists()

    kwargs = calls["evaluate"]
    assert kwargs["model"] == "local-completions" and kwargs["task_manager"] == "the task manager"
    assert kwargs["model_args"] == {
        "model": MODEL,
        "base_url": f"{proxy.url}/v1/completions",
        "num_concurrent": 3,
        "max_retries": 3,
        "tokenized_requests": False,
        "tokenizer_backend": None,
        "max_gen_toks": 64,
        "timeout": 600,  # EVAL_REQUEST_TIMEOUT_S
    }
    assert (kwargs["num_fewshot"], kwargs["limit"], kwargs["log_samples"]) == (5, 7, True)
    if offline_data:
        assert kwargs["tasks"] == ["gsm8k_offline"]
        assert calls["manager"] == {"include_path": out / "tasks", "include_defaults": False}
        assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    else:
        assert kwargs["tasks"] == ["gsm8k"]
        assert calls["manager"] == {"include_path": None, "include_defaults": True}
        assert "HF_DATASETS_OFFLINE" not in os.environ


def test_completions_failing_for_real(capsys, proxy, tmp_path) -> None:
    """The proxy lists a model but every completion is a 500: lm-eval gives up, exit 2."""
    proxy.routes["/v1/completions"] = (500, '{"error": "backend down"}')
    out = tmp_path / "out"
    argv = ["--base-url", proxy.url, "--output-dir", str(out), "--data-dir", str(SLICE)]
    code, _, err = run_main(capsys, [*argv, "--limit", "1", "--num-fewshot", "0"])
    assert_clean_error(code, err, "lm-eval failed: ")
    assert "ClientResponseError: 500" in err
    assert len(proxy.auth) >= 2  # the probe, then lm-eval's completion attempts
    assert not (out / "manifest.json").exists()


# --- the offline task is lm-eval's gsm8k ------------------------------------------------------


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """The offline task written for the kit's slice, loaded by lm-eval's TaskManager."""
    from lm_eval.tasks import TaskManager

    tasks = tmp_path_factory.mktemp("tasks")
    path = offline_task.write_task(SLICE, tasks)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        manager = TaskManager(include_path=tasks, include_defaults=False)
        task = manager.load([offline_task.TASK_NAME])["tasks"][offline_task.TASK_NAME]
    return path, task


def test_task_file_includes_the_stock_task_and_overrides_only_the_dataset(offline) -> None:
    path, _ = offline
    own = yaml.safe_load(path.read_text())
    assert set(own) == {"include", "task", *offline_task.DATASET_FIELDS}
    assert Path(own["include"]) == offline_task.stock_task_yaml()
    assert own["task"] == "gsm8k_offline" and own["dataset_path"] == "json"
    assert own["dataset_kwargs"]["data_files"] == {
        split: str((SLICE / f"{split}.jsonl").resolve()) for split in ("train", "test")
    }


def test_include_is_the_file_lm_evals_task_index_calls_gsm8k() -> None:
    from lm_eval.tasks import TaskManager

    entry_ = TaskManager().task_index["gsm8k"]
    assert Path(entry_.yaml_path).resolve() == offline_task.stock_task_yaml()


def test_loaded_task_is_stock_gsm8k_on_the_local_rows(offline) -> None:
    from lm_eval.tasks._yaml_loader import load_yaml

    _, task = offline
    stock = load_yaml(offline_task.stock_task_yaml(), resolve_func=False)
    skip = {"tag", "task", "metadata", *offline_task.DATASET_FIELDS}
    for key, value in stock.items():
        if key not in skip:
            assert getattr(task.config, key) == value, key
    assert task.config.metadata["version"] == stock["metadata"]["version"]
    assert [f.name for f in task._filters] == ["strict-match", "flexible-extract"]
    assert task.config.fewshot_split == "train" and task.config.test_split == "test"

    def rows(split: str) -> list[dict]:
        return [json.loads(line) for line in (SLICE / f"{split}.jsonl").read_text().splitlines()]

    test_rows, train_rows = rows("test"), rows("train")
    docs = list(task.test_docs())
    assert [d["question"] for d in docs] == [r["question"] for r in test_rows]
    # lm-eval's own prompt: stock template, shots drawn from the local train split.
    context = task.fewshot_context(docs[0], num_fewshot=3)
    assert context.endswith(f"Question: {test_rows[0]['question']}\nAnswer:")
    shots = [
        r for r in train_rows if f"Question: {r['question']}\nAnswer: {r['answer']}" in context
    ]
    assert len(shots) == 3
