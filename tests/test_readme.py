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


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def missing_anchors(path: Path) -> list[str]:
    """``file.md#anchor`` links whose file has no heading with that anchor."""
    missing = []
    for target in relative_links(path):
        name, _, anchor = target.partition("#")
        if not anchor or not name.endswith(".md"):
            continue
        text = (path.parent / name).resolve().read_text()
        headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
        if anchor not in {heading_anchor(h) for h in headings}:
            missing.append(target)
    return missing


def test_verification_links_land_on_a_heading() -> None:
    """The verification table's figure links point at sections that exist."""
    assert missing_anchors(REPO / "docs" / "verification.md") == []


def test_a_link_to_a_missing_heading_is_found(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Figures: the 2-core CPU machine\n## P/D `make x` (y)\n")
    doc = tmp_path / "a.md"
    links = "[a](b.md#figures-the-2-core-cpu-machine) [b](b.md#pd-make-x-y) [c](b.md#gone)"
    doc.write_text(links + "\n")
    assert missing_anchors(doc) == ["b.md#gone"]


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("[ok](x.md) [gone](nope.md#a) [web](https://example.com) [here](#top)\n")
    assert relative_links(doc) == ["x.md", "nope.md#a"]
    assert missing_targets(doc) == ["nope.md#a"]
