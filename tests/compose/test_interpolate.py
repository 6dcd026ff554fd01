"""The interpolation and .env parsing rules the compose checks rely on."""

from __future__ import annotations

import pytest
from compose_env import InterpolationError, interpolate, parse_dotenv, references

ENV = {"SET": "v", "EMPTY": ""}


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("${SET}", "v"),
        ("$SET-x", "v-x"),
        ("${UNSET}", ""),
        ("${UNSET:-d}", "d"),
        ("${EMPTY:-d}", "d"),
        ("${EMPTY-d}", ""),
        ("${UNSET-d}", "d"),
        ("${SET:-d}", "v"),
        ("${SET:+alt}", "alt"),
        ("${EMPTY+alt}", "alt"),
        ("${EMPTY:+alt}", ""),
        ("$${SET}", "${SET}"),
        ("cost $$5", "cost $5"),
        ("${UNSET:-${SET}/x}", "v/x"),
        ('\'{"a":"${SET}"}\'', '\'{"a":"v"}\''),
        ("a $ b", "a $ b"),
    ],
)
def test_interpolate(text: str, want: str) -> None:
    assert interpolate(text, ENV) == want


@pytest.mark.parametrize("text", ["${UNSET:?need it}", "${EMPTY:?need it}", "${UNSET?need it}"])
def test_required_variable_errors_name_it(text: str) -> None:
    with pytest.raises(InterpolationError, match="UNSET|EMPTY"):
        interpolate(text, ENV)


def test_required_variable_set_passes() -> None:
    assert interpolate("${EMPTY?x}", ENV) == ""
    assert interpolate("${SET:?x}", ENV) == "v"


@pytest.mark.parametrize("text", ["${", "${1BAD}", "${A*b}"])
def test_malformed_expressions_raise(text: str) -> None:
    with pytest.raises(InterpolationError):
        interpolate(text, ENV)


def test_references_report_defaults_including_nested() -> None:
    refs = references("${A:-${B}} $C $${D} ${E?x}")
    assert [(r.name, r.has_default) for r in refs] == [
        ("A", True),
        ("B", False),
        ("C", False),
        ("E", False),
    ]


def test_parse_dotenv_follows_compose_rules() -> None:
    text = (
        '# comment\n\nA=1\nexport B = two words # trailing\nC="x \\"q\\" # kept"\n'
        "D='lit $X \\n'\nE=\nF=a#b\n"
    )
    assert parse_dotenv(text) == {
        "A": "1",
        "B": "two words",
        "C": 'x "q" # kept',
        "D": "lit $X \\n",
        "E": "",
        "F": "a#b",
    }


@pytest.mark.parametrize("text", ["NOEQUALS\n", 'A="open\n', "A='open\n"])
def test_parse_dotenv_rejects_bad_lines(text: str) -> None:
    with pytest.raises(ValueError, match="line 1"):
        parse_dotenv(text)
