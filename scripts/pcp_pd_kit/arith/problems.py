"""Templated arithmetic word problems in GSM8K's format, split into training and held-out sets.

The trained demo model learns from these, and the demo's lm-eval task scores it on questions it
never saw. Answers are GSM8K's shape: a short worked line, then ``#### N``. Every step is one
binary operation whose operands stand right before ``=``, so a two-layer model can learn it. Pure
standard library: the generator is deterministic for a seed on any host and any Python >= 3.10.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NAMES = (
    "James", "Mary", "John", "Sarah", "Tom", "Anna", "Mike", "Lisa", "Janet", "Weng",
    "Betty", "Julie", "Albert", "Ken", "Alexis", "Nina",
)  # fmt: skip
ITEMS = (
    "apples", "oranges", "books", "cookies", "eggs", "pens", "cards", "shells",
    "stamps", "marbles", "stickers", "coins",
)  # fmt: skip


@dataclass(frozen=True)
class Problem:
    """One question and its GSM8K-style answer (worked steps, then ``#### N``)."""

    question: str
    answer: str
    result: int

    def row(self) -> dict[str, str]:
        """A GSM8K JSONL row."""
        return {"question": self.question, "answer": self.answer}


def _answer(steps: list[tuple[int, str, int, int]]) -> str:
    lines = " ".join(f"{a} {op} {b} = {r}." for a, op, b, r in steps)
    return f"{lines}\n#### {steps[-1][3]}"


Template = Callable[[random.Random, str, str], Problem]


def _buys(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    q = f"{name} has {a} {item} and buys {b} more. How many {item} now?"
    return Problem(q, _answer([(a, "+", b, a + b)]), a + b)


def _gives(rng: random.Random, name: str, item: str) -> Problem:
    a = rng.randint(2, 18)
    b = rng.randint(1, min(9, a - 1))
    q = f"{name} has {a} {item} and gives {b} away. How many {item} now?"
    return Problem(q, _answer([(a, "-", b, a - b)]), a - b)


def _bags(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    q = f"{name} buys {a} bags of {b} {item}. How many {item} in all?"
    return Problem(q, _answer([(a, "*", b, a * b)]), a * b)


def _buys_and_gives(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    s = a + b
    c = rng.randint(1, min(9, s - 1))
    q = f"{name} has {a} {item}, buys {b} more and gives {c} away. How many {item} now?"
    return Problem(q, _answer([(a, "+", b, s), (s, "-", c, s - c)]), s - c)


TEMPLATES: tuple[Template, ...] = (_buys, _gives, _bags, _buys_and_gives)
# The largest number a problem can hold (operands and results), for the one-token check.
MAX_NUMBER = 25


def generate(seed: int) -> Iterator[Problem]:
    """An endless, seeded stream of problems cycling through the templates in a seeded order."""
    rng = random.Random(seed)
    while True:
        template = rng.choice(TEMPLATES)
        yield template(rng, rng.choice(NAMES), rng.choice(ITEMS))


@dataclass(frozen=True)
class Split:
    train: list[Problem]
    heldout: list[Problem]


def split(seed: int, n_train: int, n_heldout: int) -> Split:
    """Held-out questions first (their own stream), then training questions that differ from
    every held-out one: the eval never scores a question the model trained on."""
    heldout: list[Problem] = []
    seen: set[str] = set()
    for problem in generate(seed + 1):
        if problem.question not in seen:
            seen.add(problem.question)
            heldout.append(problem)
        if len(heldout) == n_heldout:
            break
    train: list[Problem] = []
    for problem in generate(seed):
        if problem.question not in seen:
            train.append(problem)
        if len(train) == n_train:
            break
    return Split(train, heldout)


def prompt(question: str) -> str:
    """lm-eval's GSM8K prompt (its gsm8k.yaml doc_to_text), zero-shot."""
    return f"Question: {question}\nAnswer:"


def completion(answer: str) -> str:
    """What the model must generate after the prompt (lm-eval stops at the EOS token)."""
    return f" {answer}"
