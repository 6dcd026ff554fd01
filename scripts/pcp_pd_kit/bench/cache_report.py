"""The cache bench's tables and goals from what its runs recorded. No I/O. A proxy's figure counts
only when its path counter says its requests went to decode alone; else its goal is NOT MEASURED.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pcp_pd_kit.bench.cache_plan import CachePlan
from pcp_pd_kit.bench.metrics import paths
from pcp_pd_kit.bench.tables import (
    VERDICT,
    fmt_num,
    fmt_ratio,
    markdown_table,
    median,
    percentile,
    ratio,
    versus,
)


@dataclass(frozen=True)
class Goal:
    """One goal at one concurrency: met True/False, or None (not measured)."""

    goal: str
    mode: str
    concurrency: int
    measured: str
    met: bool | None
    value: float | None = None
    limit: float | None = None

    @property
    def verdict(self) -> str:
        return VERDICT[self.met]


FOLLOW_UP_LIMIT = 1.1  # follow-up TTFT, kit / warm single, c=1
HIT_FRACTION_GOAL = 0.9  # cache-hit tokens / ideal, cache-aware
SHARED_TTFT_LIMIT = 0.6  # TTFT median, cache-aware / least outstanding
SHORT_LIMIT = 1.1  # short prompts through the proxy with the local tokenizer / single
HITS = "vllm:prefix_cache_hits_total"
SUCCESS = "vllm:request_success_total"
TARGET_TITLES = {
    "kit": "kit (proxy, cache routing, local prefill)",
    "single": "single vLLM",
    "tokenize": "proxy, N counted by decode /tokenize",
    "tokenizer": "proxy, N counted by --tokenizer",
}
MODE_TITLES = {"events": "cache-aware (events)", "off": "least outstanding (off)"}
HELD_TITLES = {"kit": "pd-proxy, cache-aware (events)", "pinned": "client pinning each prefix"}
HELD_MARGIN_MS = 5.0  # TTFT median, kit - pinning client
FULL_HIT_MARGIN = 0.01  # full caches: each run's hits of ideal, pinning client - kit, at most
FULL_SHARE_LIMIT = 0.6  # full caches: the most requests one decode gets, of the kit's


def median_ms(seconds: Sequence[float]) -> float | None:
    found = median(seconds)
    return None if found is None else found * 1000


def counter(grown: Mapping[str, float], name: str) -> float:
    """The growth of an unlabelled counter (summed over its label sets)."""
    return sum(v for k, v in grown.items() if k == name or k.startswith(name + "{"))


@dataclass(frozen=True)
class PathCheck:
    """Whether at least ``wanted`` requests of a run went to decode alone (path local)."""

    wanted: int
    local: float
    pd: float

    @property
    def measured(self) -> bool:
        return self.wanted > 0 and self.local >= self.wanted

    def text(self) -> str:
        got = f"local {self.local:.0f}, pd {self.pd:.0f} (want {self.wanted} local)"
        return got if self.measured else f"NOT MEASURED: {got}"


def path_check(grown: Mapping[str, float], wanted_local: int) -> PathCheck:
    found = paths(grown)
    return PathCheck(wanted_local, found["local"], found["pd"])


# --- multi-turn ------------------------------------------------------------------------------
def multi_turn_rows(runs: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per level: kit and single follow-up TTFT medians, their ratio and the kit's paths."""
    rows = []
    for level, run in sorted(runs.items()):
        ttft = run.get("ttft_s", {})
        kit, single = median_ms(ttft.get("kit", [])), median_ms(ttft.get("single", []))
        n = int(run.get("conversations", 0))
        check = path_check(run.get("proxy", {}), n)
        rows.append({"concurrency": level, "kit_ms": kit, "single_ms": single,
                     "kit_over_single": ratio(kit, single), "conversations": n,
                     "paths": paths(run.get("proxy", {})), "follow_ups_local": check.measured,
                     "path_text": check.text(),
                     "decode_hit_tokens": counter(run.get("decode", {}), HITS),
                     "single_hit_tokens": counter(run.get("reference", {}), HITS)})  # fmt: skip
    return rows


def format_multi_turn(rows: Sequence[Mapping[str, Any]], context: int, new: int) -> str:
    table = markdown_table(
        ["c", "kit TTFT p50 (ms)", "single TTFT p50 (ms)", "kit/single", "n", "kit paths"],
        [[r["concurrency"], fmt_num(r["kit_ms"]), fmt_num(r["single_ms"]),
          fmt_ratio(r["kit_over_single"]), r["conversations"], r["path_text"]] for r in rows],
    )  # fmt: skip
    return (
        f"Follow-up turn ({context} cached + {new} new tokens, max_tokens 1), both warm, "
        "prefix caching on in both:\n\n" + table
    )


# --- short prompts -----------------------------------------------------------------------------
def short_rows(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per target: TTFT median, ratio to single and, for the proxies, the path check."""
    ttft = run.get("ttft_s", {})
    single = median_ms(ttft.get("single", []))
    n = int(run.get("requests", 0))
    rows = []
    for target in ("single", "tokenize", "tokenizer"):
        mine = median_ms(ttft.get(target, []))
        check = None if target == "single" else path_check(run["proxies"].get(target, {}), n)
        rows.append({"target": target, "ttft_ms": mine, "over_single": ratio(mine, single),
                     "measured": check is None or check.measured,
                     "path_text": "" if check is None else check.text()})  # fmt: skip
    return rows


def format_short(rows: Sequence[Mapping[str, Any]], words: int, requests: int) -> str:
    table = markdown_table(
        ["target", "TTFT p50 (ms)", "/single", "paths"],
        [[TARGET_TITLES[r["target"]], fmt_num(r["ttft_ms"]), fmt_ratio(r["over_single"]),
          r["path_text"] or "-"] for r in rows],
    )  # fmt: skip
    return (
        f"Short text prompts ({words} words, about 32 tokens, max_tokens 1, c=1, {requests} per "
        "target, interleaved):\n\n" + table
    )


# --- shared prefixes across two decodes -------------------------------------------------------
def shared_rows(runs: Sequence[Mapping[str, Any]], ideal: int) -> list[dict[str, Any]]:
    """Per run: TTFT, cache-hit tokens over both decodes (and of ideal), requests per decode."""
    rows = []
    for run in runs:
        result = run.get("result") or {}
        decodes = run.get("decodes", {})
        hits = sum(counter(g, HITS) for g in decodes.values())
        rows.append({"mode": run["mode"], "round": run["round"],
                     "ttft_ms": result.get("median_ttft_ms"),
                     "p99_ttft_ms": result.get("p99_ttft_ms"), "completed": result.get("completed"),
                     "hit_tokens": hits, "hit_fraction": hits / ideal if ideal else None,
                     "requests_per_decode": {k: counter(g, SUCCESS) for k, g in decodes.items()},
                     "paths": paths(run.get("proxy", {}))})  # fmt: skip
    return rows


def shared_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per mode: the median of its runs' TTFT medians and hit fractions."""
    out: dict[str, dict[str, float | None]] = {}
    for mode in ("events", "off"):
        mine = [r for r in rows if r["mode"] == mode]
        ttfts = [r["ttft_ms"] for r in mine if r["ttft_ms"] is not None]
        fractions = [r["hit_fraction"] for r in mine if r["hit_fraction"] is not None]
        out[mode] = {"ttft_ms": median(ttfts), "hit_fraction": median(fractions),
                     "runs": float(len(mine))}  # fmt: skip
    return out


def format_shared(
    rows: Sequence[Mapping[str, Any]], ideal: int, description: str, prompts: int
) -> str:
    table = markdown_table(
        ["run", "routing", "TTFT p50 (ms)", "TTFT p99 (ms)", "done", "hit tokens", "of ideal",
         "per decode"],
        [[i + 1, MODE_TITLES[r["mode"]], fmt_num(r["ttft_ms"]), fmt_num(r["p99_ttft_ms"]),
          f"{int(r['completed'] or 0)}/{prompts}", f"{r['hit_tokens']:.0f}",
          fmt_ratio(r["hit_fraction"]).rstrip("x"),
          " / ".join(f"{v:.0f}" for v in r["requests_per_decode"].values())]
         for i, r in enumerate(rows)],
    )  # fmt: skip
    summary = shared_summary(rows)
    ev, off = summary["events"], summary["off"]
    line = (
        f"Medians of the runs: cache-aware TTFT {fmt_num(ev['ttft_ms'])} ms, hits "
        f"{fmt_ratio(ev['hit_fraction']).rstrip('x')} of ideal; least outstanding "
        f"{fmt_num(off['ttft_ms'])} ms, {fmt_ratio(off['hit_fraction']).rstrip('x')}; "
        f"cache-aware / least outstanding TTFT {fmt_ratio(ratio(ev['ttft_ms'], off['ttft_ms']))}."
    )
    return f"{description} (ideal {ideal} hit tokens a run):\n\n{table}\n\n{line}"


# --- caches holding every prefix: the kit against a client pinning each prefix --------------------
def held_rows(runs: Sequence[Mapping[str, Any]], ideal: int) -> list[dict[str, Any]]:
    """Per arm over its runs: TTFT median and p90 of every request, hit tokens of ideal."""
    rows = []
    for arm in sorted({r["arm"] for r in runs}):
        mine = [r for r in runs if r["arm"] == arm]
        ttfts = [t for r in mine for t in r["ttft_s"]]
        p90 = percentile(ttfts, 90)
        hits = sum(counter(g, HITS) for r in mine for g in r["decodes"].values())
        per = {k: sum(counter(r["decodes"][k], SUCCESS) for r in mine) for k in mine[0]["decodes"]}
        rows.append({"arm": arm, "requests": len(ttfts), "ttft_ms": median_ms(ttfts),
                     "p90_ttft_ms": None if p90 is None else p90 * 1000,
                     "hit_fraction": hits / (ideal * len(mine)) if ideal else None,
                     "requests_per_decode": per,
                     "concurrency": mine[0].get("concurrency", 4)})  # fmt: skip
    return rows


def held_goal(held: Sequence[Mapping[str, Any]]) -> Goal:
    """The kit's TTFT median within HELD_MARGIN_MS of the pinning client's, the same hits."""
    by = {r["arm"]: r for r in held}
    text = f"held prefixes: TTFT p50 <= pinning client + {HELD_MARGIN_MS:g} ms, same hits"
    kit, pinned = by.get("kit"), by.get("pinned")
    if not kit or not pinned or kit["ttft_ms"] is None or pinned["ttft_ms"] is None:
        return Goal(text, "events", 0, "not run", None)
    gap = kit["ttft_ms"] - pinned["ttft_ms"]
    same = abs((kit["hit_fraction"] or 0) - (pinned["hit_fraction"] or 0)) < 0.01
    measured = f"{gap:+.1f} ms, hits {kit['hit_fraction']:.2f} vs {pinned['hit_fraction']:.2f}"
    met = gap <= HELD_MARGIN_MS and same
    return Goal(text, "events", kit["concurrency"], measured, met, gap, HELD_MARGIN_MS)


def format_held(rows: Sequence[Mapping[str, Any]], plan: CachePlan) -> str:
    table = markdown_table(
        ["client", "requests", "TTFT p50 (ms)", "TTFT p90 (ms)", "hits of ideal", "per decode"],
        [[HELD_TITLES[r["arm"]], r["requests"], fmt_num(r["ttft_ms"]), fmt_num(r["p90_ttft_ms"]),
          fmt_ratio(r["hit_fraction"]).rstrip("x"),
          " / ".join(f"{v:.0f}" for v in r["requests_per_decode"].values())] for r in rows],
    )  # fmt: skip
    return (
        f"Caches holding every prefix (prefix i warmed on decode i % 2, {plan.prefixes} x "
        f"{plan.prefix_len} token ids, {plan.per_prefix} requests each with a "
        f"{plan.suffix_len}-id suffix, max_tokens 1, c={plan.shared_concurrency}, "
        f"{plan.shared_rounds} runs per client, alternating):\n\n{table}"
    )


# --- full caches: new prefixes placed by the kit, against a client pinning each prefix ----------
def full_rows(runs: Sequence[Mapping[str, Any]], ideal: int) -> list[dict[str, Any]]:
    """Per run (arm and round): TTFT median, hit tokens of ideal, requests per decode and the
    largest share of them one decode got."""
    rows = []
    for run in runs:
        hits = sum(counter(g, HITS) for g in run["decodes"].values())
        per = {k: counter(g, SUCCESS) for k, g in run["decodes"].items()}
        total = sum(per.values())
        rows.append({"arm": run["arm"], "round": run["round"], "ttft_ms": median_ms(run["ttft_s"]),
                     "hit_fraction": hits / ideal if ideal else None, "requests_per_decode": per,
                     "largest_share": max(per.values()) / total if total else None,
                     "concurrency": run.get("concurrency", 4)})  # fmt: skip
    return rows


def full_goals(rows: Sequence[Mapping[str, Any]]) -> list[Goal]:
    """In every round, the kit's hits at least the pinning client's less FULL_HIT_MARGIN, and
    no decode given more than FULL_SHARE_LIMIT of the kit's requests (the worst round shown)."""
    hits_text = f"full caches: each run's hits >= pinning client's - {FULL_HIT_MARGIN:g}"
    share_text = f"full caches: no decode gets > {FULL_SHARE_LIMIT:.0%} of the requests (kit)"
    kit = {r["round"]: r for r in rows if r["arm"] == "kit"}
    pinned = {r["round"]: r for r in rows if r["arm"] == "pinned"}
    rounds = sorted(set(kit) & set(pinned))
    if not rounds:
        return [Goal(text, "events", 4, "not run", None) for text in (hits_text, share_text)]
    c = kit[rounds[0]]["concurrency"]
    gaps = {n: (kit[n]["hit_fraction"] or 0.0) - (pinned[n]["hit_fraction"] or 0.0) for n in rounds}
    worst = min(rounds, key=lambda n: gaps[n])
    within = sum(gaps[n] >= -FULL_HIT_MARGIN for n in rounds)
    k, p = kit[worst]["hit_fraction"] or 0.0, pinned[worst]["hit_fraction"] or 0.0
    measured = f"worst run {worst}: {k:.4f} vs {p:.4f}; {within}/{len(rounds)} runs within"
    most = max(rounds, key=lambda n: kit[n]["largest_share"] or 0.0)
    share = kit[most]["largest_share"] or 0.0
    return [Goal(hits_text, "events", c, measured, gaps[worst] >= -FULL_HIT_MARGIN),
            Goal(share_text, "events", c, f"largest share {share:.0%} (run {most})",
                 share <= FULL_SHARE_LIMIT)]  # fmt: skip


def format_full(rows: Sequence[Mapping[str, Any]], plan: CachePlan) -> str:
    table = markdown_table(
        ["run", "client", "TTFT p50 (ms)", "hits of ideal", "per decode", "largest share"],
        [[r["round"], HELD_TITLES[r["arm"]], fmt_num(r["ttft_ms"]),
          f"{r['hit_fraction']:.3f}" if r["hit_fraction"] is not None else "-",
          " / ".join(f"{v:.0f}" for v in r["requests_per_decode"].values()),
          f"{r['largest_share']:.0%}" if r["largest_share"] is not None else "-"]
         for r in rows],
    )  # fmt: skip
    return (f"Full caches ({plan.kv_blocks} KV blocks per decode, empty at each run, and for the "
            f"kit a fresh proxy; {plan.prefixes} x {plan.prefix_len} token ids, {plan.per_prefix} "
            f"requests each with a {plan.suffix_len}-id suffix, max_tokens 1, c="
            f"{plan.shared_concurrency}; prefix i pinned to decode i % 2):\n\n{table}")  # fmt: skip


# --- goals -------------------------------------------------------------------------------------
def goals(
    multi: Sequence[Mapping[str, Any]],
    short: Sequence[Mapping[str, Any]],
    shared: Sequence[Mapping[str, Any]],
    held: Sequence[Mapping[str, Any]] = (),
    full: Sequence[Mapping[str, Any]] = (),
) -> list[Goal]:
    """The cache goals; reported, never a failure."""
    out: list[Goal] = []
    for row in multi:
        level, why = row["concurrency"], None if row["follow_ups_local"] else row["path_text"]
        measured, met, r = versus(row["kit_ms"], row["single_ms"], FOLLOW_UP_LIMIT, None, why)
        text = f"follow-up TTFT <= {FOLLOW_UP_LIMIT:g}x warm single" + " (reported)" * (level != 1)
        out.append(
            Goal(text, "kit", level, measured, met if level == 1 else None, r, FOLLOW_UP_LIMIT)
        )
    ev, off = shared_summary(shared).values() if shared else ({}, {})
    fraction = ev.get("hit_fraction")
    text = f"shared prefixes: hit tokens >= {HIT_FRACTION_GOAL:g} of ideal (cache-aware)"
    met = None if fraction is None else fraction >= HIT_FRACTION_GOAL
    measured = "not run" if fraction is None else f"{fraction:.2f}"
    out.append(Goal(text, "events", 4, measured, met, fraction, HIT_FRACTION_GOAL))
    why = None if shared else "not run"
    found = versus(ev.get("ttft_ms"), off.get("ttft_ms"), SHARED_TTFT_LIMIT, None, why)
    text = f"shared prefixes: TTFT p50 <= {SHARED_TTFT_LIMIT:g}x least outstanding"
    out.append(Goal(text, "events", 4, *found, SHARED_TTFT_LIMIT))
    by = {row["target"]: row for row in short}
    local, single = by.get("tokenizer") or {}, by.get("single") or {}
    why = "not run" if not local else None if local["measured"] else local["path_text"]
    found = versus(None if why else local["ttft_ms"], single.get("ttft_ms"), SHORT_LIMIT, None, why)
    text = f"short prompts <= {SHORT_LIMIT:g}x single (local tokenizer)"
    out.append(Goal(text, "tokenizer", 1, *found, SHORT_LIMIT))
    return [*out, held_goal(held), *full_goals(full)]


def format_goals(found: Sequence[Goal]) -> str:
    return markdown_table(
        ["goal (reported, never a failure)", "c", "measured", "result"],
        [[g.goal, g.concurrency, g.measured, g.verdict] for g in found],
    )
