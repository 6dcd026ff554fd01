"""No issue numbers or tracker talk in the product: users never see the tracker, so code, docs,
dashboards and test names say the capability ("the handover goal"), never the ticket that asked
for it (its case, its goals by that name) or the project the kit grew from."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.doc_citations import repo_files
from tests.support.paths import REPO

# "issue N", "Issue #N's", "issues N and M", "test_issue_N" (N a number): no letter right before.
ISSUE_NUMBER = re.compile(r"(?<![A-Za-z])issues?[\s_#-]*\d+", re.IGNORECASE)
# Tracker talk: the ticket itself, its goals by the tracker's name, the project the kit grew from
# (a random seed is fine). Bracketed letters keep this file from matching itself.
TRACKER_TALK = re.compile(
    r"\bthe (iss[u]e|se[e]d)'s\b|\bthe iss[u]e\b|\bdo[n]e[- ]when\b"
    r"|\bse[e]d (kit|topology|settings)\b",
    re.IGNORECASE,
)
TEXT_SUFFIXES = frozenset({".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".json", ".cfg", ".txt"})
TEXT_NAMES = frozenset({"Makefile", ".env.example", "Dockerfile"})


def product_files(root: Path) -> list[Path]:
    """The kit's own text files: sources, docs, configs and tests, not environments or run output
    (generated trees are copies of sources that are scanned)."""
    return [p for p in repo_files(root) if p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES]


def issue_mentions(root: Path) -> list[str]:
    """``file:line: text`` for every line that names an issue by number."""
    hits = []
    for path in product_files(root):
        text = path.read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if ISSUE_NUMBER.search(line) or TRACKER_TALK.search(line):
                hits.append(f"{path.relative_to(root)}:{number}: {line.strip()[:120]}")
    return hits


def test_no_issue_numbers_in_the_product() -> None:
    assert issue_mentions(REPO) == []


def test_an_issue_number_is_found_wherever_it_hides(tmp_path: Path) -> None:
    number = "19"  # kept apart so this file holds no issue number of its own
    (tmp_path / "a.md").write_text(f"fine\nsee Issue #{number}'s goals\n")
    (tmp_path / "b.py").write_text(f"def test_issue_{number}():\n    pass\n")
    (tmp_path / "c.json").write_text(f'{{"d": "issues {number} and 27"}}\n')
    (tmp_path / ".env.example").write_text(f"# issue-{number}\n")
    (tmp_path / "d.md").write_text("tissue 3, nixl#1628, PR #661, 19 issues, seed + k\n")  # fine
    (tmp_path / "f.py").write_text("# The " + "issue's case\n")
    (tmp_path / "g.md").write_text("Done" + "-when: x; the " + "se" + "ed kit's run\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "e.py").write_text(f"# issue {number}\n")
    assert [hit.split(":")[0] for hit in issue_mentions(tmp_path)] == [
        ".env.example",
        "a.md",
        "b.py",
        "c.json",
        "f.py",
        "g.md",
    ]
