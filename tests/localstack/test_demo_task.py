"""Which eval the demo runs, and the command line that runs it against P/D or one instance."""

import dataclasses
import json
from pathlib import Path

from pcp_pd_kit.localstack import demo_task
from pcp_pd_kit.localstack.demo import eval_command
from pcp_pd_kit.localstack.stack import PD_PARTS, REFERENCE_PARTS, Stack
from tests.support.env import example_settings


def _model_dir(tmp_path: Path, questions: int) -> Path:
    data = tmp_path / "model" / "heldout"
    data.mkdir(parents=True)
    row = json.dumps({"question": "q", "answer": "#### 1"}) + "\n"
    (data / "test.jsonl").write_text(row * questions)
    (data / "train.jsonl").write_text(row)
    return tmp_path / "model"


def test_a_model_of_your_own_keeps_the_gsm8k_slice(tmp_path: Path) -> None:
    settings = dataclasses.replace(example_settings(), model="/some/model")
    chosen, task = demo_task.choose(settings, tmp_path)
    assert chosen is settings
    assert task.min_score is None and task.limit is None and task.min_samples == 1
    assert task.eval_env == {"EXPECTED_SCORE": settings.demo_expected_score}


def test_the_arithmetic_task_scores_every_heldout_question_zero_shot(tmp_path: Path) -> None:
    task = demo_task.arithmetic_task(_model_dir(tmp_path, 120))
    assert (task.limit, task.num_fewshot, task.min_score, task.min_samples) == (120, 0, 0.8, 50)
    # The eval's own band never fails a run the demo's floor accepts (0.80 included).
    low = float(task.eval_env["EXPECTED_SCORE"]) - float(task.eval_env["SCORE_TOLERANCE"])
    assert low < demo_task.MIN_SCORE


def test_eval_command_targets_the_proxy_or_the_single_instance(tmp_path: Path) -> None:
    task = demo_task.arithmetic_task(_model_dir(tmp_path, 3))
    settings = example_settings()
    pd = eval_command(Stack(settings, parts=PD_PARTS, repo=tmp_path), 3, task)
    one = eval_command(
        Stack(settings, parts=REFERENCE_PARTS, repo=tmp_path), 3, task, "reference", tmp_path / "o"
    )

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag(pd, "--base-url") == settings.url(settings.proxy_port)
    assert flag(pd, "--decode-url") == settings.url(settings.decode_port)
    ref = settings.url(settings.reference_port)
    assert flag(one, "--base-url") == flag(one, "--prefill-url") == flag(one, "--decode-url") == ref
    for argv in (pd, one):
        assert flag(argv, "--num-fewshot") == "0"
        assert flag(argv, "--data-dir") == str(task.data_dir)
        assert flag(argv, "--limit") == "3"
    assert flag(one, "--output-dir") == str(tmp_path / "o")
