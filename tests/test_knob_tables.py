"""The knobs tables in the docs (`| knob | default | ... |`) say what .env.example says: every
knob named is one .env.example defines, with the default it gives; and every knob .env.example
defines is read by the kit's code, so no documented knob is a dead one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.doc_citations import markdown_files, repo_files
from tests.support.env import example_env
from tests.support.paths import REPO

HEADER = re.compile(r"^\|\s*knob\s*\|\s*default\s*\|", re.IGNORECASE)
KNOB = re.compile(r"`([A-Z][A-Z0-9_]*)`")
# Where the kit reads its knobs: compose files, launchers, the kit's package, the connector,
# pd-proxy, the Kubernetes sources, make.
CODE_SUFFIXES = frozenset({".py", ".yaml", ".yml", ".sh", ".env"})
CODE_DIRS = ("compose", "scripts", "connector", "proxy", "deploy")


def knob_rows(text: str) -> list[tuple[list[str], str]]:
    """(knob names, default cell) of each row of each knobs table in a document."""
    rows, in_table = [], False
    for line in text.splitlines():
        if HEADER.match(line):
            in_table = True
            continue
        if not in_table or not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= set("-: "):
            continue
        rows.append((KNOB.findall(cells[0]), cells[1]))
    return rows


def documented_defaults(names: list[str], cell: str) -> list[str]:
    """The default cell as one value per knob: `0,1`, `2` -> two; 'empty: ...' -> ''."""
    text = cell.split(":", 1)[0] if cell.startswith("empty") else cell
    values = [v.strip().strip("`") for v in re.split(r"`,\s*`|,\s+", text)]
    if len(names) == 1:
        values = [text.strip().strip("`")]
    return ["" if v == "empty" else v for v in values]


def default_matches(documented: str, actual: str) -> bool:
    """Equal, or the documented short form of a model id (`DeepSeek-V2-Lite-Chat`)."""
    return documented == actual or actual.endswith(f"/{documented}")


def table_problems(doc: Path, env: dict[str, str]) -> list[str]:
    problems = []
    for names, cell in knob_rows(doc.read_text()):
        if not names:
            problems.append(f"a knobs row names no knob: {cell!r}")
            continue
        defaults = documented_defaults(names, cell)
        if len(defaults) != len(names):
            problems.append(f"{names}: {len(defaults)} defaults in {cell!r}")
            continue
        for name, documented in zip(names, defaults, strict=True):
            if name not in env:
                problems.append(f"{name} is not in .env.example")
            elif not default_matches(documented, env[name]):
                problems.append(f"{name}: documented {documented!r}, .env.example {env[name]!r}")
    return problems


def code_text(root: Path) -> str:
    files = [p for d in CODE_DIRS for p in repo_files(root / d) if p.suffix in CODE_SUFFIXES]
    files += [root / "compose.yaml", root / "Makefile"]
    return "\n".join(p.read_text(errors="replace") for p in files if p.is_file())


KNOB_DOCS = [p for p in markdown_files(REPO) if any(map(HEADER.match, p.read_text().splitlines()))]


def test_the_readme_has_a_knobs_table() -> None:
    assert REPO / "README.md" in KNOB_DOCS


@pytest.mark.parametrize("doc", KNOB_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_knobs_tables_match_env_example(doc: Path) -> None:
    assert table_problems(doc, example_env()) == []


def test_every_env_example_knob_is_read_by_the_code() -> None:
    code = code_text(REPO)
    assert [k for k in example_env() if not re.search(rf"\b{k}\b", code)] == []


def test_a_drifted_table_is_found(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text(
        "| knob | default | what |\n|---|---|---|\n"
        "| `A`, `B` | `0,1`, `2` | fine |\n"
        "| `MODEL_NAME` | Chat-7B | the short form of a model id |\n"
        "| `EMPTY` | empty: the tiny model | fine |\n"
        "| `GONE` | 1 | not in .env.example |\n"
        "| `A` | `0,2` | drifted |\n"
        "| `A`, `B` | 1 | one default for two |\n"
        "\nprose | `NOT_A_ROW` | x\n"
    )
    env = {"A": "0,1", "B": "2", "MODEL_NAME": "org/Chat-7B", "EMPTY": ""}
    assert table_problems(doc, env) == [
        "GONE is not in .env.example",
        "A: documented '0,2', .env.example '0,1'",
        "['A', 'B']: 1 defaults in '1'",
    ]
