"""docs/proxy's reference tables say what the code does.

- docs/proxy/flags.md: every option of ``pd-proxy --help`` (pd_proxy.config.build_parser, whose
  rows come from pd_proxy.config.OPTIONS) has one row, with its ``PD_PROXY_*`` variable and its
  default as in ``ProxyConfig``; no row names a flag the parser lacks. Variables merged into
  another (pd_proxy.config.flags.GONE) are named on the page as refused.
- docs/proxy/metrics.md: the metric families an app registers (pd_proxy.metrics.ProxyMetrics,
  pd_proxy.routing.cache.metrics.CacheMetrics, pd_proxy.admission.metrics.AdmissionMetrics and
  the canary's) are the names the tables list, each with its type.

The meaning column is prose and not checked. ``python -m tests.proxy.test_proxy_reference_docs``
prints the flags table as the code sees it (meanings kept from the page, the help text for a new
flag), to paste over a drifted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, cast

from prometheus_client import CollectorRegistry

from pd_proxy.admission.metrics import AdmissionMetrics
from pd_proxy.api.canary import Canary
from pd_proxy.config import ENV_PREFIX, OPTIONS, ProxyConfig, build_parser
from pd_proxy.config.flags import GONE
from pd_proxy.config.values import parse_size
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.routing.cache.metrics import CacheMetrics
from tests.support.paths import REPO

FLAGS_DOC = REPO / "docs" / "proxy" / "flags.md"
METRICS_DOC = REPO / "docs" / "proxy" / "metrics.md"

FLAGS_HEADER = re.compile(r"^\|\s*flag\s*\|\s*variable\s*\|\s*default\s*\|", re.IGNORECASE)
METRICS_HEADER = re.compile(r"^\|\s*name\s*\|\s*type\s*\|", re.IGNORECASE)
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
VARIABLE = re.compile(rf"{ENV_PREFIX}[A-Z0-9_]+")
METRIC = re.compile(r"`(pd_proxy_[a-z0-9_]+)`")
# Settings in seconds: their default reads "5 s".
SECONDS = ("_timeout", "_interval", "_s")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One setting as pd-proxy --help has it: its option strings, variable and default."""

    dest: str
    flags: tuple[str, ...]
    variable: str
    default: str
    help: str


def default_cell(dest: str, value: object) -> str:
    """A ``ProxyConfig`` default as the table writes it."""
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if any(conv is parse_size for d, _f, _e, conv, _t in OPTIONS if d == dest):
        assert isinstance(value, int)
        for power, suffix in ((3, "G"), (2, "M"), (1, "k")):
            if value % 1024**power == 0:
                return f"{value // 1024**power}{suffix}"
        return str(value)
    if isinstance(value, float):
        text = f"{value:g}"
        return f"{text} s" if dest.endswith(SECONDS) else text
    return str(value)


def expected_flags() -> list[Flag]:
    """Every setting of ``pd-proxy --help``, in the parser's order."""
    defaults = {f.name: f.default for f in dataclasses.fields(ProxyConfig)}
    found: dict[str, dict[str, Any]] = {}
    for action in build_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        row = found.setdefault(action.dest, {"flags": [], "variable": None, "help": ""})
        row["flags"] += action.option_strings
        named = VARIABLE.search(action.help or "")
        if named is not None and row["variable"] is None:
            row["variable"], row["help"] = named.group(0), action.help or ""
    for dest, _flag, env, _conv, _text in OPTIONS:
        assert found[dest]["variable"] == f"{ENV_PREFIX}{env}", dest
    out = []
    for dest, row in found.items():
        assert row["variable"] is not None, f"--help names no variable for {dest}"
        assert dest in defaults, f"{dest} is no ProxyConfig field"
        help_text = re.sub(r"\s*\[[^\]]*\]\s*$", "", row["help"]).replace("|", "/")
        default = default_cell(dest, defaults[dest])
        out.append(Flag(dest, tuple(row["flags"]), row["variable"], default, help_text))
    return out


def table_rows(text: str, header: re.Pattern[str]) -> list[list[str]]:
    """The cells of each body row of each table whose header matches."""
    rows, inside = [], False
    for line in text.splitlines():
        if header.match(line):
            inside = True
            continue
        if not inside or not line.startswith("|"):
            inside = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= set("-: "):
            continue
        rows.append(cells)
    return rows


def flags_problems(text: str, expected: list[Flag]) -> list[str]:
    """What the flags table says that the parser does not, and what it leaves out."""
    by_flag = {f: row for row in expected for f in row.flags}
    problems, seen = [], set()
    for cells in table_rows(text, FLAGS_HEADER):
        flags = FLAG.findall(cells[0])
        if not flags:
            problems.append(f"a row names no flag: {cells[0]!r}")
            continue
        unknown = [f for f in flags if f not in by_flag]
        if unknown:
            problems.append(f"{', '.join(unknown)}: not an option of pd-proxy --help")
            continue
        rows = {by_flag[f].dest: by_flag[f] for f in flags}
        if len(rows) > 1:
            problems.append(f"one row for several settings: {', '.join(flags)}")
            continue
        row = next(iter(rows.values()))
        if row.dest in seen:
            problems.append(f"{row.flags[0]}: more than one row")
        seen.add(row.dest)
        if set(flags) != set(row.flags):
            problems.append(f"{row.flags[0]}: the row names {flags}, --help {list(row.flags)}")
        variables = VARIABLE.findall(cells[1]) if len(cells) > 1 else []
        if variables != [row.variable]:
            problems.append(f"{row.flags[0]}: variable {variables}, the code reads {row.variable}")
        default = cells[2].replace("`", "").strip() if len(cells) > 2 else ""
        if default != row.default:
            problems.append(f"{row.flags[0]}: default {default!r}, ProxyConfig's {row.default!r}")
    for row in expected:
        if row.dest not in seen:
            problems.append(f"{row.flags[0]} ({row.variable}): no row")
    return problems


def gone_problems(text: str) -> list[str]:
    """Each variable pd-proxy refuses by name must be named on the page, with its successor."""
    return [
        f"{ENV_PREFIX}{old} (refused, use {ENV_PREFIX}{new}) is not named"
        for old, new in GONE.items()
        if f"{ENV_PREFIX}{old}" not in text or f"{ENV_PREFIX}{new}" not in text
    ]


def registered_metrics() -> dict[str, str]:
    """Family name as exposed (counters with ``_total``) -> type, for every part of an app."""
    proxy = ProxyMetrics((), ())
    registry: CollectorRegistry = proxy.registry
    CacheMetrics(registry)
    AdmissionMetrics(registry)
    unused = cast(Any, None)  # the canary's series only: its legs, exchange and pool stay unused
    Canary(
        unused,
        unused,
        unused,
        backend_key=None,
        prefill_timeout=60.0,
        registry=registry,
        interval_s=60.0,
        timeout_s=60.0,
    )
    out = {}
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = family.type
    return out


def metrics_problems(text: str, registered: dict[str, str]) -> list[str]:
    problems, seen = [], set()
    for cells in table_rows(text, METRICS_HEADER):
        names = METRIC.findall(cells[0])
        if not names:
            problems.append(f"a row names no metric: {cells[0]!r}")
            continue
        types = [t.split()[0] if t.split() else "" for t in cells[1].split(",")]
        if len(types) == 1:
            types *= len(names)
        if len(types) != len(names):
            problems.append(f"{names}: {len(types)} types for {len(names)} names")
            continue
        for name, kind in zip(names, types, strict=True):
            if name in seen:
                problems.append(f"{name}: more than one row")
            seen.add(name)
            if name not in registered:
                problems.append(f"{name}: the proxy registers no such metric")
            elif kind != registered[name]:
                problems.append(f"{name}: documented {kind!r}, registered {registered[name]!r}")
    problems += [f"{n} ({t}): no row" for n, t in registered.items() if n not in seen]
    return problems


def expected_flags_table(text: str) -> str:
    """The flags table as the code has it, keeping the page's meaning of each known flag."""
    meanings = {}
    for cells in table_rows(text, FLAGS_HEADER):
        for flag in FLAG.findall(cells[0]):
            meanings[flag] = " | ".join(cells[3:])
    lines = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for row in expected_flags():
        flags = " / ".join(f"`{f}`" for f in row.flags)
        meaning = next((meanings[f] for f in row.flags if f in meanings), row.help)
        lines.append(f"| {flags} | `{row.variable}` | {row.default} | {meaning} |")
    return "\n".join(lines) + "\n"


# --- the pages ---------------------------------------------------------------------------------


def test_flags_table_is_the_parser() -> None:
    text = FLAGS_DOC.read_text()
    problems = flags_problems(text, expected_flags())
    assert problems == [], (
        "docs/proxy/flags.md drifted from pd_proxy.config; the table as the code has it "
        "(python -m tests.proxy.test_proxy_reference_docs):\n" + expected_flags_table(text)
    )


def test_refused_variables_are_named() -> None:
    assert gone_problems(FLAGS_DOC.read_text()) == []


def test_metrics_tables_are_the_registry() -> None:
    assert metrics_problems(METRICS_DOC.read_text(), registered_metrics()) == []


# --- the checks themselves find each kind of drift -----------------------------------------------


def test_the_expected_flags_come_from_the_code() -> None:
    rows = {r.dest: r for r in expected_flags()}
    assert rows["tokenize_timeout"].flags == ("--tokenize-timeout",)
    assert rows["tokenize_timeout"].variable == "PD_PROXY_TOKENIZE_TIMEOUT"
    assert rows["tokenize_timeout"].default == "2 s"
    assert rows["metrics"].flags == ("--metrics", "--no-metrics")
    assert rows["metrics"].default == "on"
    assert rows["prefill"].variable == "PD_PROXY_PREFILL"
    assert rows["max_body_bytes"].default == "16M"
    assert rows["cache_overlap_weight"].default == "4"
    assert rows["host"].default == "0.0.0.0"
    assert "side_call_timeout" not in rows


def test_a_drifted_flags_table_is_found() -> None:
    expected = [
        Flag("port", ("--port",), "PD_PROXY_PORT", "8000", ""),
        Flag("metrics", ("--metrics", "--no-metrics"), "PD_PROXY_METRICS", "on", ""),
        Flag("tokenize_timeout", ("--tokenize-timeout",), "PD_PROXY_TOKENIZE_TIMEOUT", "2 s", ""),
        Flag("queue_size", ("--queue-size",), "PD_PROXY_QUEUE_SIZE", "64", ""),
    ]
    doc = (
        "| flag | variable | default | meaning |\n|---|---|---|---|\n"
        "| `--port` | `PD_PROXY_PORT` | `8000` | fine |\n"
        "| `--metrics` | `PD_PROXY_METRICS` | on | half the pair |\n"
        "| `--tokenize-timeout` | `PD_PROXY_TOKENIZE_TIMEOUT` | 1 s | old default |\n"
        "| `--side-call-timeout` | `PD_PROXY_SIDE_CALL_TIMEOUT` | 2 s | gone |\n"
        "| `--port` | `PD_PROXY_PORTS` | 8000 | twice, wrong variable |\n"
        "| nothing | | | |\n"
    )
    assert flags_problems(doc, expected) == [
        "--metrics: the row names ['--metrics'], --help ['--metrics', '--no-metrics']",
        "--tokenize-timeout: default '1 s', ProxyConfig's '2 s'",
        "--side-call-timeout: not an option of pd-proxy --help",
        "--port: more than one row",
        "--port: variable ['PD_PROXY_PORTS'], the code reads PD_PROXY_PORT",
        "a row names no flag: 'nothing'",
        "--queue-size (PD_PROXY_QUEUE_SIZE): no row",
    ]


def test_a_page_without_the_refused_variable_is_found() -> None:
    assert gone_problems("| flag | variable | default |\n") != []


def test_the_registry_has_every_part() -> None:
    registered = registered_metrics()
    for name in (
        "pd_proxy_requests_total",  # ProxyMetrics
        "pd_proxy_path_decisions_total",  # CacheMetrics
        "pd_proxy_admission_total",  # AdmissionMetrics
        "pd_proxy_queue_wait_seconds",
        "pd_proxy_canary_runs_total",  # the canary
    ):
        assert name in registered
    assert registered["pd_proxy_queue_wait_seconds"] == "histogram"
    assert registered["pd_proxy_admitted_in_flight"] == "gauge"


def test_a_drifted_metrics_table_is_found() -> None:
    registered = {
        "pd_proxy_a_total": "counter",
        "pd_proxy_b": "gauge",
        "pd_proxy_c_total": "counter",
    }
    doc = (
        "| name | type | labels |\n|---|---|---|\n"
        "| `pd_proxy_a_total`, `pd_proxy_b` | counter, histogram | wrong second type |\n"
        "| `pd_proxy_gone_total` | counter | not registered |\n"
        "| `pd_proxy_a_total` | counter | twice |\n"
    )
    assert metrics_problems(doc, registered) == [
        "pd_proxy_b: documented 'histogram', registered 'gauge'",
        "pd_proxy_gone_total: the proxy registers no such metric",
        "pd_proxy_a_total: more than one row",
        "pd_proxy_c_total (counter): no row",
    ]


def main() -> None:
    text = FLAGS_DOC.read_text() if FLAGS_DOC.is_file() else ""
    print(expected_flags_table(text), end="")


if __name__ == "__main__":
    main()
