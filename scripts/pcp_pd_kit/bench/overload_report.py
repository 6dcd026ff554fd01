"""`bench overload`'s pure part: key file, sums per mode, goals, table; tested on fixed replies."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pcp_pd_kit.bench.tables import fmt_num, fmt_ratio, markdown_table, median, percentile, ratio

FLOOD, LIGHT = "flood", "light"
MODES = ("admission", "no-admission")
# The admission control's goals under a crowd: a refusal comes within 2 s, no served request
# waits over 90 s for its first token, the light client stays within 5x its TTFT alone.
REFUSAL_MAX_S, TTFT_MAX_S, LIGHT_RATIO_MAX = 2.0, 90.0, 5.0


@dataclass(frozen=True)
class Reply:
    """One request's answer: status 0 when none came (a reset, a client timeout)."""

    client: str
    status: int
    seconds: float  # until the first token (200) or the refusal's answer
    code: str | None = None  # the error body's code
    retry_after: str | None = None
    complete: bool = False  # a 200 whose stream reached [DONE]
    during: bool = True  # sent while the flood was in flight: only those count beside it

    @property
    def served(self) -> bool:
        return self.status == 200 and self.complete

    @property
    def outcome(self) -> str:
        """'served', or '<status> <code>' ('0 no answer', '200 cut' for a stream cut short)."""
        if self.served:
            return "served"
        if self.status == 200:
            return "200 cut"
        return f"{self.status} {self.code or ('no answer' if self.status == 0 else '-')}"


def key_file_text(keys: Mapping[str, str]) -> str:
    """The proxy's --api-key-file: one `KEY flow=NAME` line per client."""
    return "".join(f"{key} flow={flow}\n" for flow, key in keys.items())


def kv_growth(
    before: Mapping[str, float | None], after: Mapping[str, float | None]
) -> dict[str, float | None]:
    """The prefill's held and freed counters' growth and its KV usage after (None: absent)."""
    out: dict[str, float | None] = {"usage": after.get("usage")}
    for name in ("held", "freed"):
        later = after.get(name)
        out[name] = None if later is None else later - (before.get(name) or 0.0)
    return out


def summarize(
    replies: Sequence[Reply], light_alone_s: Sequence[float], kv: Mapping[str, float | None]
) -> dict[str, Any]:
    """One mode's figures: outcomes, TTFTs (s), the light client against alone, the KV."""
    served = [r.seconds for r in replies if r.served]
    light = [r.seconds for r in replies if r.served and r.client == LIGHT and r.during]
    refused = [r for r in replies if r.status in (429, 503)]
    by_client = {
        c: dict(Counter(r.outcome for r in replies if r.client == c)) for c in (FLOOD, LIGHT)
    }
    held, freed = kv.get("held"), kv.get("freed")
    return {
        "requests": len(replies), "served": len(served),
        "refused": dict(Counter(r.outcome for r in refused)),
        "errors": sum(1 for r in replies if not r.served and r.status not in (429, 503)),
        "by_client": by_client,
        "ttft_s": {"p50": percentile(served, 50), "p90": percentile(served, 90),
                   "max": max(served, default=None)},  # fmt: skip
        "refusal_max_s": max((r.seconds for r in refused), default=None),
        "refusals_without_retry_after": sum(1 for r in refused if not r.retry_after),
        "light_ttft_s": median(light), "light_ttft_max_s": max(light, default=None),
        "light_during": len(light), "light_alone_s": median(light_alone_s),
        "light_ratio": ratio(median(light), median(light_alone_s)),
        "light_refused": sum(1 for r in refused if r.client == LIGHT),
        "kv_held": held, "kv_freed": freed, "kv_usage_after": kv.get("usage"),
        "kv_all_freed": held is not None and freed is not None and freed >= held
        and kv.get("usage") == 0,
    }  # fmt: skip


@dataclass(frozen=True)
class Goal:
    name: str
    ok: bool
    detail: str


def goals(s: Mapping[str, Any]) -> list[Goal]:
    """The admission control's goals, from the admission mode's summary (reported, not failed)."""
    ttft_max, refusal_max, light = s["ttft_s"]["max"], s["refusal_max_s"], s["light_ratio"]
    errors, unmarked = s["errors"], s["refusals_without_retry_after"]
    return [
        Goal("every request served or refused (429/503)", errors == 0, f"{errors} others"),
        Goal(f"refusals 429/503 with Retry-After within {REFUSAL_MAX_S:g} s",
             unmarked == 0 and (refusal_max is None or refusal_max <= REFUSAL_MAX_S),
             f"slowest {fmt_num(refusal_max)} s, {unmarked} without"),
        Goal(f"some served, none waited over {TTFT_MAX_S:g} s",
             s["served"] > 0 and ttft_max is not None and ttft_max <= TTFT_MAX_S,
             f"{s['served']} served, max TTFT {fmt_num(ttft_max)} s"),
        Goal(f"light client never refused, median TTFT <= {LIGHT_RATIO_MAX:g}x alone",
             s["light_refused"] == 0 and light is not None and light <= LIGHT_RATIO_MAX,
             f"{s['light_refused']} refused, {fmt_ratio(light)}"),
        Goal("the prefill's KV freed", bool(s["kv_all_freed"]), _kv(s)),
    ]  # fmt: skip


def _kv(s: Mapping[str, Any]) -> str:
    held, freed = fmt_num(s["kv_held"]), fmt_num(s["kv_freed"])
    return f"held {held}, freed {freed}, usage {s['kv_usage_after']}"


def format_table(summaries: Mapping[str, Mapping[str, Any]], plan: Mapping[str, Any]) -> str:
    """Both modes side by side, then the goals for the admission mode."""
    headers = ["proxy", "served", "refused", "other", "TTFT p50 s", "TTFT p90 s", "TTFT max s",
               "light TTFT p50 (max) s", "light alone s", "light ratio", "prefill KV"]  # fmt: skip
    rows = [
        [mode, f"{s['served']}/{s['requests']}",
         ", ".join(f"{k}: {v}" for k, v in sorted(s["refused"].items())) or "0", s["errors"],
         fmt_num(s["ttft_s"]["p50"]), fmt_num(s["ttft_s"]["p90"]), fmt_num(s["ttft_s"]["max"]),
         f"{fmt_num(s['light_ttft_s'])} ({fmt_num(s.get('light_ttft_max_s'))})",
         fmt_num(s["light_alone_s"]), fmt_ratio(s["light_ratio"]),
         _kv(s)]
        for mode, s in summaries.items()
    ]  # fmt: skip
    text = [
        "## overload: a flood and a light client, pd-proxy with and without admission", "",
        f"Flood: {plan['flood_prompts']} prompts of {plan['flood_input_len']} token ids at once "
        f"(key flow={FLOOD}); light: prompts of {plan['light_input_len']} one after another "
        f"(flow={LIGHT}) from 1 s after the flood until it is over (at least "
        f"{plan['light_requests']}; its TTFT counts those sent during the flood); "
        f"{plan['output_len']} tokens out each. TTFT: the served requests, both clients.", "",
        markdown_table(headers, rows),
    ]  # fmt: skip
    if "admission" in summaries:
        text += ["", "Goals (admission on):"]
        text += [f"- [{'met' if g.ok else 'MISSED'}] {g.name}: {g.detail}"
                 for g in goals(summaries["admission"])]  # fmt: skip
    return "\n".join(text)
