"""The documentation stays readable in one sitting: docs/ and the README and every component README
together at most 200 KB of prose; the committed bench summaries (docs/results/, generated records
every figure cites) at most 92 KB of their own, so each new figure can bring its summary without
the prose paying for it, and the records still cannot pile up unread. (88: the fleet bench's
events runs, alternated three times with the code before because one run's p99 moves with the
host; 92: the serve run behind the handover's read-posted stamp.)"""

from __future__ import annotations

from pathlib import Path

from tests.support import doc_citations as dc
from tests.support.paths import REPO

LIMIT_BYTES = 200 * 1024
RESULTS_LIMIT_BYTES = 92 * 1024


def documentation(root: Path) -> list[Path]:
    """Every file under docs/ but its results, and every README.md of the repository."""
    results = root / "docs" / "results"
    docs = {p for p in (root / "docs").rglob("*") if p.is_file() and results not in p.parents}
    readmes = {p for p in dc.repo_files(root) if p.name == "README.md"}
    return sorted(docs | readmes)


def summaries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "docs" / "results").rglob("*") if p.is_file())


def total_bytes(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


def test_the_documentation_totals_at_most_200_kb() -> None:
    files = documentation(REPO)
    size = total_bytes(files)
    largest = sorted(files, key=lambda p: -p.stat().st_size)[:5]
    top = ", ".join(f"{p.relative_to(REPO)} {p.stat().st_size} B" for p in largest)
    assert size <= LIMIT_BYTES, f"the docs total {size} bytes (limit {LIMIT_BYTES}); largest: {top}"


def test_the_committed_bench_summaries_total_at_most_92_kb() -> None:
    size = total_bytes(summaries(REPO))
    assert 0 < size <= RESULTS_LIMIT_BYTES, f"docs/results holds {size} bytes"


def test_the_walk_counts_docs_and_component_readmes_and_results_apart(tmp_path: Path) -> None:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "run.json").write_text("x" * 300)
    (tmp_path / "docs" / "guide.md").write_text("w" * 100)
    (tmp_path / "proxy").mkdir()
    (tmp_path / "proxy" / "README.md").write_text("y" * 200)
    (tmp_path / "proxy" / "notes.md").write_text("not documentation of the kit's own")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "README.md").write_text("z" * 5000)
    assert total_bytes(documentation(tmp_path)) == 300
    assert total_bytes(summaries(tmp_path)) == 300
