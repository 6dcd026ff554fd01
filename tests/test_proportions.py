"""The product stays in proportion: pd-proxy's package grouped (at most 15 top-level modules, none
over 500 lines), the serving entrypoint a package of modules under 400 lines, and the benchmarks
under 5,150 lines, so the bench never again outgrows the connector the kit exists for by much
(4,000 until the prefill's profile by function group and each run's prefix-cache hit rate, which
measuring the P/D path honestly needed; 4,300 until pd-proxy was measured at a fleet's scale, whose
fake fleet lives in pd_proxy.testing; 5,100 until bench scale ran a second pd-proxy revision in the
same turns, the host's drift between two runs being larger than the changes it compared; the
connector grew by its three CPU fixes meanwhile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.paths import REPO

PROXY_PACKAGE = REPO / "proxy" / "pd_proxy"
ENTRYPOINT_PACKAGE = REPO / "compose" / "entrypoint" / "vllm_serve"
BENCH_PACKAGE = REPO / "scripts" / "pcp_pd_kit" / "bench"


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def modules(package: Path) -> list[Path]:
    return sorted(package.rglob("*.py"))


def over(package: Path, limit: int) -> dict[str, int]:
    """The package's modules longer than ``limit`` lines, by path."""
    return {str(p.relative_to(package)): n for p in modules(package) if (n := lines(p)) > limit}


def test_pd_proxy_has_at_most_15_top_level_modules() -> None:
    top = sorted(p.name for p in PROXY_PACKAGE.glob("*.py"))
    assert len(top) <= 15, top


@pytest.mark.parametrize(("package", "limit"), [(PROXY_PACKAGE, 500), (ENTRYPOINT_PACKAGE, 400)])
def test_no_module_is_over_its_limit(package: Path, limit: int) -> None:
    assert modules(package), f"{package} has no modules: the check would pass on nothing"
    assert over(package, limit) == {}


def test_the_benchmarks_stay_under_5150_lines() -> None:
    total = sum(lines(p) for p in modules(BENCH_PACKAGE))
    assert 0 < total < 5150, f"the bench package is {total} lines"


def test_a_long_module_is_found(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "short.py").write_text("x = 1\n" * 10)
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 401)
    assert over(tmp_path, 400) == {"sub/long.py": 401}
