"""`bench scale`'s pure part: the prompts and key files, /metrics read line by line, each phase's
figures, the scale goals and the table; tested on fixed figures."""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping, Sequence
from typing import Any

from pcp_pd_kit.bench.tables import VERDICT, fmt_num, markdown_table, percentile

# /metrics the bench reads (pd_proxy.routing.cache.metrics)
EVENTS_TOTAL = "pd_proxy_kv_events_total"  # {backend, kind}: kind="events" counts applied ones
LAG = "pd_proxy_kv_events_lag_seconds"  # {backend}: wall clock - newest batch's ts, once applied
BLOCKS = "pd_proxy_cache_blocks"  # {backend, source}: entries of the index per replica
INDEX_BLOCKS = "pd_proxy_cache_index_blocks"  # {role}: pairs in a role's index, where bounded
INDEX_EVICTED = "pd_proxy_cache_index_evicted_blocks_total"  # {role}: pairs the bound dropped
PREDICTED = "pd_proxy_cache_predicted_hit_tokens_total"
# The scale goals: a proxy in front of a cluster's replicas, keys and KV events
WALL_MAX_S, ADDED_P50_MAX_MS, CPU_RATIO_MAX = 600.0, 0.3, 1.5
GOAL_RATE, LAG_P99_MAX_MS, GAP_GROWTH_MAX = 40_000, 100.0, 1.10
BYTES_PER_PAIR_MAX, ADMISSION_CPU_RATIO_MAX = 150.0, 2.0
APPLIED_SHARE_MIN = 0.95  # a step keeps up when it applied this share of what was sent in it
HELD_SHARE = 7 / 8  # of each prompt, the prefix every replica's cache holds


@functools.lru_cache(maxsize=64)
def _ids(seed: str, count: int) -> tuple[int, ...]:
    return tuple(random.Random(seed).choices(range(1000, 30000), k=count))


def held_prefix(length: int, prefix: int, block_size: int) -> list[int]:
    """Prefix ``prefix``'s part that the fleet's caches hold: ``HELD_SHARE``, whole blocks."""
    count = int(length * HELD_SHARE) // block_size * block_size
    return list(_ids(f"prefix-{length}-{prefix}", count))


def prompt(length: int, prefix: int, request: int, block_size: int) -> list[int]:
    """Request ``request``'s token ids: the held prefix, then tokens of its own."""
    head = held_prefix(length, prefix, block_size)
    return head + list(random.Random(f"{length}-{prefix}-{request}").choices(
        range(1000, 30000), k=length - len(head)))  # fmt: skip


def key_file(keys: Sequence[str]) -> str:
    """The proxy's --api-key-file: each key its own flow."""
    return "".join(f"{key} flow=flow-{i}\n" for i, key in enumerate(keys))


def samples(text: str, name: str, **labels: str) -> list[tuple[str, float]]:
    """(label text, value) of each sample of ``name`` whose labels include ``labels``; read line
    by line, since a fleet's /metrics is too long to parse four times a second."""
    out: list[tuple[str, float]] = []
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            head, _, value = line.rpartition(" ")
            if all(w in head for w in wanted):
                out.append((head[len(name) :], float(value)))
    return out


def total(text: str, name: str, **labels: str) -> float:
    return sum(v for _, v in samples(text, name, **labels))


def held_pairs(text: str) -> float:
    """Block-replica pairs in the proxy's index: the replicas' gauges, else the roles'."""
    found = samples(text, BLOCKS, source="events")
    return sum(v for _, v in found) if found else total(text, INDEX_BLOCKS)


def timing(latencies_s: Sequence[float], cpu_s: float, requests: int, errors: int) -> dict:
    """One proxy's run: latency p50/p99 (ms) and its CPU per request (us)."""
    ms = [x * 1e3 for x in latencies_s]
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "n": len(ms),
            "cpu_us": cpu_s * 1e6 / max(requests, 1), "errors": errors}  # fmt: skip


def _less(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def routing_row(replicas: int, tokens: int, off: Mapping[str, Any], on: Mapping[str, Any],
                predicted_share: float | None) -> dict[str, Any]:  # fmt: skip
    """Routing on (events) against off, for one fleet size and prompt length."""
    return {"replicas": replicas, "tokens": tokens, "off": dict(off), "events": dict(on),
            "added_p50_ms": _less(on["p50_ms"], off["p50_ms"]),
            "added_p99_ms": _less(on["p99_ms"], off["p99_ms"]),
            "cpu_ratio": on["cpu_us"] / off["cpu_us"] if off["cpu_us"] else None,
            "predicted_hit_share": predicted_share}  # fmt: skip


def event_step(rate: float, seconds: float, sent: float, applied: float, lags_s: Sequence[float],
               gaps_s: Sequence[float], drained: bool) -> dict[str, Any]:  # fmt: skip
    """One pump rate: sent and applied per second, the lag and the relay's inter-token gaps."""
    lag, gap = [x * 1e3 for x in lags_s], [x * 1e3 for x in gaps_s]
    step = {"rate": rate, "sent_per_s": sent / seconds, "applied_per_s": applied / seconds,
            "lag_p50_ms": percentile(lag, 50), "lag_p99_ms": percentile(lag, 99),
            "lag_max_ms": max(lag, default=None), "lag_samples": len(lag),
            "gap_p50_ms": percentile(gap, 50), "gap_p99_ms": percentile(gap, 99),
            "gaps": len(gap), "drained": drained}  # fmt: skip
    step["keeps_up"] = rate == 0 or keeps_up(step)
    return step


def keeps_up(step: Mapping[str, Any]) -> bool:
    """Applied nearly all it was sent, within the lag goal, and caught up after."""
    lag = step["lag_p99_ms"]
    return (step["applied_per_s"] >= APPLIED_SHARE_MIN * step["sent_per_s"] and step["drained"]
            and lag is not None and lag <= LAG_P99_MAX_MS)  # fmt: skip


def max_kept_rate(steps: Sequence[Mapping[str, Any]]) -> float | None:
    """The most events/s sent in a step the proxy kept up with, every slower step kept too."""
    best = None
    for step in sorted((s for s in steps if s["rate"]), key=lambda s: s["rate"]):
        if not step["keeps_up"]:
            break
        best = step["sent_per_s"]
    return best


def bound_check(text: str, cap: int, per_role: int, flag: str) -> dict[str, Any]:
    """The bound works: each role's gauge within ``cap`` after ``per_role`` pairs, the rest
    counted as evicted."""
    held = dict(samples(text, INDEX_BLOCKS))
    evicted = total(text, INDEX_EVICTED)
    ok = bool(held) and max(held.values()) <= cap and evicted >= 2 * (per_role - cap)
    gauge = ", ".join(f"{k} {v:g}" for k, v in held.items()) or "absent"
    return {"ok": ok, "detail": f"{flag} {cap}, {per_role} pairs sent per role: gauge {gauge}, "
            f"evicted {evicted:g}"}  # fmt: skip


def flow_row(flows: int, requests: int, cpu: Mapping[str, float], text: str, errors: int) -> dict:
    """One key count: CPU per request with admission and without, the /metrics series."""
    lines = [x for x in text.splitlines() if x and not x.startswith("#")]
    return {"flows": flows, "requests": requests, "cpu_us": cpu["admission"],
            "no_admission_cpu_us": cpu["no-admission"],
            "admission_us": cpu["admission"] - cpu["no-admission"], "series": len(lines),
            "flow_series": sum('flow="' in x for x in lines), "errors": errors}  # fmt: skip


def errors(data: Mapping[str, Any]) -> int:
    routing = sum(r["off"]["errors"] + r["events"]["errors"] for r in data.get("routing") or [])
    return routing + sum(f["errors"] for f in data.get("flows") or [])


def _over(value: float | None, limit: float, unit: str) -> str:
    if value is None:
        return "not measured"
    text = f"{fmt_num(value)}{unit}"
    return text if value <= limit else f"{text}, over by {fmt_num(value - limit)}{unit}"


def _within(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _pick(rows: Sequence[Mapping[str, Any]], replicas: int, tokens: int) -> Any:
    """The row of that size, else the nearest measured (by replicas, then tokens)."""
    key = lambda r: (abs(r["replicas"] - replicas), abs(r["tokens"] - tokens))  # noqa: E731
    return min(rows, key=key) if rows else None


def goals(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The scale goals, each met, NOT MET (by how much) or n/a. Reported, never failed."""
    out: list[dict[str, Any]] = []

    def goal(text: str, measured: str, met: bool | None) -> None:
        out.append({"goal": text, "measured": measured, "met": met})

    wall = data.get("wall_s")
    goal(f"the bench runs in <= {WALL_MAX_S:g} s", _over(wall, WALL_MAX_S, " s"),
         _within(wall, WALL_MAX_S))  # fmt: skip
    row = _pick(data.get("routing") or [], 32, 8192) or {}
    at = f" (R={row['replicas']}, {row['tokens']} tokens)" if row else ""
    added, cpu = row.get("added_p50_ms"), row.get("cpu_ratio")
    goal(f"routing adds <= {ADDED_P50_MAX_MS} ms p50{at}", _over(added, ADDED_P50_MAX_MS, " ms"),
         _within(added, ADDED_P50_MAX_MS))  # fmt: skip
    goal(f"routing's CPU per request <= {CPU_RATIO_MAX}x off{at}", _over(cpu, CPU_RATIO_MAX, "x"),
         _within(cpu, CPU_RATIO_MAX))  # fmt: skip
    steps = (data.get("events") or {}).get("steps", [])
    step = next((s for s in steps if s["rate"] == GOAL_RATE), None)
    base = next((s for s in steps if s["rate"] == 0), None)
    name = f"{GOAL_RATE} events/s applied, lag p99 <= {LAG_P99_MAX_MS:g} ms"
    if step is None:
        goal(name, "not measured", None)
    else:
        goal(name, f"{fmt_num(step['applied_per_s'])}/s applied of "
             f"{fmt_num(step['sent_per_s'])}/s sent, lag p99 "
             f"{_over(step['lag_p99_ms'], LAG_P99_MAX_MS, ' ms')}", keeps_up(step))  # fmt: skip
    growth = None
    if step and base and step["gap_p99_ms"] and base["gap_p99_ms"]:
        growth = step["gap_p99_ms"] / base["gap_p99_ms"]
    goal(f"relay's p99 inter-token gap at {GOAL_RATE}/s <= {GAP_GROWTH_MAX:.2f}x without events",
         "not measured" if growth is None or not step or not base else
         f"{fmt_num(step['gap_p99_ms'])} / {fmt_num(base['gap_p99_ms'])} ms = "
         f"{_over(growth, GAP_GROWTH_MAX, 'x')}", _within(growth, GAP_GROWTH_MAX))  # fmt: skip
    mem = data.get("memory") or {}
    per, bound = mem.get("bytes_per_pair"), mem.get("bound")
    goal(f"<= {BYTES_PER_PAIR_MAX:g} bytes per indexed block-replica pair",
         _over(per, BYTES_PER_PAIR_MAX, " B"), _within(per, BYTES_PER_PAIR_MAX))  # fmt: skip
    goal("the index's bound (a setting) and its gauge work",
         bound["detail"] if bound else "this pd-proxy has no bound setting",
         bound["ok"] if bound else (False if mem else None))  # fmt: skip
    flows = {f["flows"]: f for f in data.get("flows") or []}
    counts = sorted(flows)
    share = None
    if len(counts) >= 2 and flows[counts[0]]["admission_us"] > 0:
        share = flows[counts[-1]]["admission_us"] / flows[counts[0]]["admission_us"]
    goal(f"admission's CPU per request at the most flows <= {ADMISSION_CPU_RATIO_MAX:g}x the "
         "fewest", "not measured" if share is None else
         f"{fmt_num(flows[counts[-1]]['admission_us'])} / "
         f"{fmt_num(flows[counts[0]]['admission_us'])} us = "
         f"{_over(share, ADMISSION_CPU_RATIO_MAX, 'x')}",
         _within(share, ADMISSION_CPU_RATIO_MAX))  # fmt: skip
    goal("flow-labelled series capped: no more at the most flows than at the next fewer",
         ", ".join(f"{k} flows: {flows[k]['flow_series']} of {flows[k]['series']}"
                   for k in counts) or "not measured", None if len(counts) < 2 else
         flows[counts[-1]]["flow_series"] <= flows[counts[-2]]["flow_series"])  # fmt: skip
    return out


def format_table(data: Mapping[str, Any]) -> str:
    """Every phase's table, then the goals."""
    text = ["## scale: pd-proxy on a fleet of fake replicas", ""]
    if data.get("proxy_commit"):
        text += [f"pd-proxy as committed at {data['proxy_commit']} (--proxy-ref)", ""]
    if rows := data.get("routing"):
        head = ["replicas", "tokens", "p50 ms off", "p50 ms on", "added p50 ms", "added p99 ms",
                "CPU us off", "CPU us on", "CPU x", "predicted hits", "errors"]  # fmt: skip
        cells = [[r["replicas"], r["tokens"], fmt_num(r["off"]["p50_ms"]),
                  fmt_num(r["events"]["p50_ms"]), fmt_num(r["added_p50_ms"]),
                  fmt_num(r["added_p99_ms"]), fmt_num(r["off"]["cpu_us"]),
                  fmt_num(r["events"]["cpu_us"]), fmt_num(r["cpu_ratio"]),
                  fmt_num(r["predicted_hit_share"]), r["off"]["errors"] + r["events"]["errors"]]
                 for r in rows]  # fmt: skip
        if data.get("before_commit"):  # --before: that ref's two proxies in the same turns
            head += ["added p50 ms before", "CPU us on before", "CPU x before"]
            for r, row in zip(rows, cells, strict=True):
                b = r["before"]
                row += map(fmt_num, (b["added_p50_ms"], b["events"]["cpu_us"], b["cpu_ratio"]))
        text += ["Routing, one request at a time, each prompt 7/8 held by every replica: "
                 "`--prefix-cache-routing events` (on) against `off`"
                 + (f"; before: pd-proxy at {data['before_commit']} in the same turns"
                    if data.get("before_commit") else ""), "",
                 markdown_table(head, cells), ""]  # fmt: skip
    if ev := data.get("events"):
        head = ["rate", "sent/s", "applied/s", "lag p50 ms", "lag p99 ms", "lag max ms",
                "relay gap p50 ms", "gap p99 ms", "caught up", "kept up"]  # fmt: skip
        cells = [[s["rate"], *(fmt_num(s[k]) for k in ("sent_per_s", "applied_per_s",
                  "lag_p50_ms", "lag_p99_ms", "lag_max_ms", "gap_p50_ms", "gap_p99_ms")),
                  s["drained"], s["keeps_up"]] for s in ev["steps"]]  # fmt: skip
        text += [f"KV events, one block each, from {ev['publishers']} publishers "
                 f"({ev['replicas']} prefills, as many decodes), {ev['seconds']:g} s a rate, "
                 f"{ev['streams']} streams of {ev['stream_tokens']} tokens through the proxy "
                 f"meanwhile; most kept up with: {fmt_num(ev['max_kept_per_s'])} events/s", "",
                 markdown_table(head, cells), ""]  # fmt: skip
    if mem := data.get("memory"):
        text += [f"Memory: {mem['pairs']} block-replica pairs more over {mem['publishers']} "
                 f"publishers: RSS {fmt_num(mem['rss_before_mb'])} -> "
                 f"{fmt_num(mem['rss_after_mb'])} MB, {fmt_num(mem['bytes_per_pair'])} bytes "
                 "per pair", ""]  # fmt: skip
    if flows := data.get("flows"):
        head = ["flows", "requests", "CPU us admission", "CPU us without", "admission's us",
                "series", "with flow", "errors"]  # fmt: skip
        cells = [[f["flows"], f["requests"], fmt_num(f["cpu_us"]),
                  fmt_num(f["no_admission_cpu_us"]), fmt_num(f["admission_us"]), f["series"],
                  f["flow_series"], f["errors"]] for f in flows]  # fmt: skip
        text += ["Flows, one key each, routing off, 32 concurrent (admission: "
                 "--decode-max-inflight 8): pd-proxy's CPU per request", "",
                 markdown_table(head, cells), ""]  # fmt: skip
    found = data.get("goals") or goals(data)
    cells = [[g["goal"], g["measured"], VERDICT[g["met"]]] for g in found]
    text += ["Goals (reported, never a failure):", "",
             markdown_table(["goal", "measured", "result"], cells)]  # fmt: skip
    if data.get("problems"):
        text += ["", "Problems: " + "; ".join(data["problems"])]
    return "\n".join(text)
