"""`pcp-pd-kit bench KIND`: one command, one results layout, one Markdown table printer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pcp_pd_kit.bench import kinds, results, tables
from pcp_pd_kit.cli import main


def test_markdown_table_has_a_header_rule_and_one_line_per_row() -> None:
    text = tables.markdown_table(["a", "b"], [[1, "x"], [2.5, "y"]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | y |"]


def test_markdown_table_refuses_a_row_of_the_wrong_width() -> None:
    with pytest.raises(ValueError, match="2 cells for 3 headers"):
        tables.markdown_table(["a", "b", "c"], [[1, 2]])


def test_run_dir_is_named_by_kind_and_time_and_never_reused(tmp_path: Path) -> None:
    out = results.run_dir("proxy", tmp_path, "20260102T030405Z")
    assert out == tmp_path / "proxy-20260102T030405Z" and out.is_dir()
    with pytest.raises(FileExistsError):
        results.run_dir("proxy", tmp_path, "20260102T030405Z")


def test_help_lists_every_kind(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    every = ("serve", "local-prefill", "proxy", "connector", "prefill", "tokenize", "xpyd", "cache")
    for kind in (*every, "prefix-ttft"):
        assert kind in kinds.KINDS and re.search(rf"^\s+{re.escape(kind)}\s", out, re.M), kind


def test_a_kind_is_required_and_an_unknown_one_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (["bench"], ["bench", "no-such-kind"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert "no-such-kind" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["connector", "--steps", "0"], "--steps and --repeats must be >= 1"),
        (["proxy", "--workers", "1", "1"], "--workers takes distinct counts"),
        (["proxy", "--also", "floor=x"], "--also 'floor=x'"),
        (["proxy", "--also", "old=x --workers {workers}"], "--also old: {workers} unknown"),
        (["tokenize", "--requests", "0"], "--requests must be >= 1"),
        (["prefill", "--lengths", "0"], "--repeats and --lengths must be >= 1"),
        (["xpyd", "--concurrency", "4,x"], "--concurrency '4,x'"),
        (["cache", "--kv-blocks", "256"], "--kv-blocks 256 holds every prefix"),
        (["prefix-ttft", "--rounds", "0"], "--rounds, --context and --new must be >= 1"),
    ],
)
def test_bad_options_fail_in_one_line_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert main(["bench", *argv, "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and f"bench {argv[0]}" in err
    assert list(tmp_path.iterdir()) == []


def test_the_local_prefill_kind_runs_the_short_workload_targets() -> None:
    from pcp_pd_kit.cli import build_parser

    args = build_parser().parse_args(["bench", "local-prefill"])
    assert args.kind == "local-prefill" and args.targets == "single,pd,pd-local"
    assert build_parser().parse_args(["bench", "serve"]).targets != args.targets


def test_proxy_bench_runs_for_real_and_writes_the_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real pd-proxy between fake vLLMs, the smallest run: the three files, one table."""
    argv = ["bench", "proxy", "--concurrency", "2", "--tokens", "4", "--requests", "10"]
    argv += ["--rounds", "1", "--warmup", "2", "--endpoint", "completions"]
    assert main([*argv, "--results-dir", str(tmp_path)]) == 0
    [run] = list(tmp_path.iterdir())
    assert re.fullmatch(r"proxy-\d{8}T\d{6}Z", run.name)
    result = json.loads((run / "result.json").read_text())
    assert result["errors"] == 0
    assert set(result["summary"]) == {"floor:completions", "proxy:completions"}
    assert result["summary"]["proxy:completions"]["req_s"] > 0
    assert "proxy:completions" in result["ratios"]
    table = (run / "table.md").read_text()
    assert "| mode | p50 ms |" in table and "| proxy:completions |" in table
    assert table.strip() in capsys.readouterr().out
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["kind"] == "proxy" and manifest["bench"]["requests"] == 10
    assert manifest["command"][-2:] == ["--results-dir", str(tmp_path)]
    assert (run / "proxy.log").is_file()
    brief = json.loads((run / "summary.json").read_text())
    assert brief["kind"] == "proxy" and brief["figures"] == result
    assert brief["git"]["commit"] == manifest["git"]["commit"]


def test_the_summary_is_written_where_a_document_can_cite_it(tmp_path: Path) -> None:
    """--summary-dir: DIR/<kind>-<UTC time>.md, naming the command and the figures (its JSON
    twin stays in the run folder)."""
    argv = ["bench", "proxy", "--concurrency", "1", "--tokens", "2", "--requests", "4"]
    argv += ["--rounds", "1", "--warmup", "1", "--endpoint", "chat"]
    argv += ["--results-dir", str(tmp_path / "r"), "--summary-dir", str(tmp_path / "docs")]
    assert main(argv) == 0
    [run] = list((tmp_path / "r").iterdir())
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == [f"{run.name}.md"]
    text = (tmp_path / "docs" / f"{run.name}.md").read_text()
    assert text.startswith(f"# bench proxy, {run.name.removeprefix('proxy-')}")
    assert "- command: `pcp-pd-kit bench proxy --concurrency 1" in text
    assert "| proxy:chat |" in text
    data = json.loads((run / "summary.json").read_text())
    assert data["figures"]["summary"]["proxy:chat"]["errors"] == 0


def test_the_summary_names_the_stack_settings_a_run_changed() -> None:
    """An environment knob (NIXL_EARLY_KV_LOAD=1) is not in the command: the summary names it."""
    import dataclasses

    from pcp_pd_kit.bench import results as res
    from pcp_pd_kit.settings import kit_env, settings_from_env

    settings = dataclasses.asdict(settings_from_env(kit_env({"NIXL_EARLY_KV_LOAD": "1"})))
    settings["proxy_port"] += 400  # the bench's own ports are not a change worth naming
    data = res.summary({"kind": "serve", "settings": settings}, {})
    assert data["settings"] == {"nixl_early_kv_load": True}
    text = res.summary_markdown(data, "| table |")
    assert "- stack settings other than the kit's defaults: nixl_early_kv_load=True" in text
    assert "stack settings" not in res.summary_markdown(res.summary({"kind": "x"}, {}), "")


@pytest.mark.vllm
def test_connector_bench_runs_with_vllms_classes(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    assert (
        main(
            ["bench", "connector", "--steps", "5", "--repeats", "1", "--results-dir", str(tmp_path)]
        )
        == 0
    )
    [run] = list(tmp_path.iterdir())
    result = json.loads((run / "result.json").read_text())
    assert set(result["median_ns_per_step"]) == {"stock", "ours"}
    assert all(v > 0 for v in result["median_ns_per_step"]["ours"].values())
    assert "| get_finished x2 ranks |" in (run / "table.md").read_text()
