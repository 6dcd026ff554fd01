"""The trained demo model's data: held out for real, GSM8K's format, scored as GSM8K scores."""

import re

import pytest
import yaml

from pcp_pd_kit.arith import problems
from pcp_pd_kit.arith.train import TrainSpec
from pcp_pd_kit.gsm8k.offline_task import stock_task_yaml

SPEC = TrainSpec()


@pytest.fixture(scope="module")
def split() -> problems.Split:
    return problems.split(SPEC.seed, SPEC.n_train, SPEC.n_heldout)


def test_heldout_questions_never_appear_in_training(split: problems.Split) -> None:
    train = {p.question for p in split.train}
    assert len(split.heldout) >= 100
    assert len({p.question for p in split.heldout}) == len(split.heldout)
    assert not train & {p.question for p in split.heldout}


def test_split_is_seeded() -> None:
    assert problems.split(7, 50, 20) == problems.split(7, 50, 20)
    assert problems.split(7, 50, 20) != problems.split(8, 50, 20)


def test_every_step_is_right_and_the_answer_ends_in_gsm8k_form(split: problems.Split) -> None:
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    for p in split.train[:2000] + split.heldout:
        work, final = p.answer.split("\n#### ")
        assert int(final) == p.result
        steps = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)\.", work)
        assert steps and all(ops[op](int(a), int(b)) == int(r) for a, op, b, r in steps)
        assert int(steps[-1][3]) == p.result
        numbers = [int(n) for n in re.findall(r"\d+", p.question + p.answer)]
        assert max(numbers) <= problems.MAX_NUMBER and min(numbers) >= 0


def _strict_match(response: str, target: str) -> bool:
    """lm-eval's GSM8K strict-match as its gsm8k.yaml configures it (regex filter, take_first,
    exact_match with its regexes_to_ignore), read from the installed lm-eval."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    config = yaml.safe_load(stock_task_yaml().read_text())
    strict = next(f for f in config["filter_list"] if f["name"] == "strict-match")
    pattern = strict["filter"][0]["regex_pattern"]
    metric = next(m for m in config["metric_list"] if m["metric"] == "exact_match")
    extracted = list(RegexFilter(regex_pattern=pattern).apply([[response]], [{}]))[0][0]
    score = exact_match_hf_evaluate(
        [extracted],
        [target],
        regexes_to_ignore=metric["regexes_to_ignore"],
        ignore_case=metric["ignore_case"],
        ignore_punctuation=metric["ignore_punctuation"],
    )
    return bool(score["exact_match"] == 1.0)


@pytest.mark.parametrize(
    ("response", "right"),
    [
        (" 7 + 6 = 13. 13 - 4 = 9.\n#### 9", True),  # the trained format
        (" #### 9", True),
        (" 7 + 6 = 13. 13 - 4 = 9.\n#### 13", False),  # an intermediate result is not the answer
        (" 7 + 6 = 13. 13 - 4 = 9.", False),  # strict: no '#### N', no score
        (" 9", False),
        (" #### 9\n#### 3", True),  # take_first
    ],
)
def test_strict_match_scores_known_outputs(response: str, right: bool) -> None:
    target = "7 + 6 = 13. 13 - 4 = 9.\n#### 9"
    assert _strict_match(response, target) is right
