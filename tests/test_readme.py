"""README.md is the front door: short, and every relative link in it (and in the docs it sends
readers to) points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.paths import REPO

README = REPO / "README.md"
README_LIMIT_BYTES = 10 * 1024
# [text](target): the target up to a space or ')'; images and reference links alike.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(path: Path) -> list[str]:
    """Link targets that are files of this repository (no scheme, no pure #anchor)."""
    targets = (m.group(1) for m in LINK.finditer(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def missing_targets(path: Path) -> list[str]:
    return [
        t for t in relative_links(path) if not (path.parent / t.split("#", 1)[0]).resolve().exists()
    ]


def test_readme_stays_under_10_kb() -> None:
    size = len(README.read_bytes())
    assert size < README_LIMIT_BYTES, f"README.md is {size} bytes; move detail into docs/"


@pytest.mark.parametrize(
    "doc",
    [README, *(REPO / "docs" / n for n in ("verification.md", "local.md", "development.md"))],
    ids=lambda p: p.name,
)
def test_relative_links_resolve(doc: Path) -> None:
    assert relative_links(doc), f"{doc.name} links nowhere"
    assert missing_targets(doc) == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("[ok](x.md) [gone](nope.md#a) [web](https://example.com) [here](#top)\n")
    assert relative_links(doc) == ["x.md", "nope.md#a"]
    assert missing_targets(doc) == ["nope.md#a"]
