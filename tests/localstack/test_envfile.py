from pathlib import Path

import pytest

from pcp_pd_kit.settings import EnvFileError, kit_env, parse_env_text, read_env_file
from tests.support.paths import ENV_EXAMPLE


def test_parse_skips_comments_and_blank_lines_and_strips_quotes() -> None:
    text = """
# a comment
A=1
export B = two
C="quoted # not a comment"
D='single'
E=value # inline comment
F=
"""
    assert parse_env_text(text) == {
        "A": "1",
        "B": "two",
        "C": "quoted # not a comment",
        "D": "single",
        "E": "value",
        "F": "",
    }


@pytest.mark.parametrize("line", ["NOEQUALS", "1BAD=x", "A B=c", 'Q="unterminated'])
def test_parse_rejects_malformed_lines_with_location(line: str) -> None:
    with pytest.raises(EnvFileError, match=r"f\.env: line 2"):
        parse_env_text(f"OK=1\n{line}\n", source="f.env")


def test_layering_order_example_then_dotenv_then_process(tmp_path: Path) -> None:
    (tmp_path / ".env.example").write_text("A=example\nB=example\nC=example\n")
    (tmp_path / ".env").write_text("B=dotenv\nC=dotenv\n")
    merged = kit_env({"C": "process"}, tmp_path)
    assert (merged["A"], merged["B"], merged["C"]) == ("example", "dotenv", "process")


def test_missing_dotenv_is_fine(tmp_path: Path) -> None:
    (tmp_path / ".env.example").write_text("A=1\n")
    assert kit_env({}, tmp_path)["A"] == "1"


def test_kit_dotenv_replaces_or_skips_the_developers_env(tmp_path: Path) -> None:
    example = kit_env({"KIT_DOTENV": ""})
    other = tmp_path / "other.env"
    other.write_text("LOCAL_PROXY_PORT=1234\n")
    assert kit_env({"KIT_DOTENV": str(other)})["LOCAL_PROXY_PORT"] == "1234"
    assert example["LOCAL_PROXY_PORT"] == read_env_file(ENV_EXAMPLE)["LOCAL_PROXY_PORT"]
