"""One client request as several P/D requests, and their answers merged back into one.

A request for ``n`` samples, or for several prompts, becomes one P/D request per choice so the
prefill hands over (and frees) the KV of every one. The answers are merged as vLLM numbers its
own: choice ``prompt_index * n + k`` (vLLM's completions ``index``), sample ``k`` seeded with
``seed + k`` (vLLM's ``ParentRequest`` seeds its children so), usage with each prompt counted
once and every generated token. Pure functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_proxy.protocol.codec import dumps, loads
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, Endpoint
from pd_proxy.protocol.pd_bodies import usage
from pd_proxy.protocol.sse import DONE, EventSplitter, event, event_json, events
from pd_proxy.routing.shapes import prompts, samples


def split(body: Mapping[str, Any], endpoint: Endpoint) -> list[dict[str, Any]]:
    """The legs' bodies, in choice order: for each prompt, its ``n`` samples."""
    n = samples(body)
    listed = prompts(body, endpoint)
    seed = body.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        seed = None
    legs = []
    for prompt in listed if listed is not None else [body.get("prompt")]:
        for k in range(n):
            leg = dict(body)
            if listed is not None:
                leg["prompt"] = prompt
            leg.pop("n", None)
            if seed is not None:
                leg["seed"] = seed + k
            legs.append(leg)
    return legs


def merge_usage(
    endpoint: Endpoint, n: int, usages: list[Mapping[str, Any] | None]
) -> dict[str, Any] | None:
    """Every generated token, each prompt once: a chat's one prompt, or each listed prompt's
    first sample (vLLM counts a prompt once however many samples it has)."""
    if any(u is None for u in usages):
        return None
    prompt = 0
    completion = 0
    for i, counted in enumerate(usages):
        assert counted is not None
        completion += int(counted.get("completion_tokens") or 0)
        first_sample = i == 0 if endpoint == CHAT_COMPLETIONS else i % n == 0
        if first_sample:
            prompt += int(counted.get("prompt_tokens") or 0)
    counts = usage(prompt, completion)
    # vLLM's other usage fields (prompt_tokens_details: null) as the first leg has them
    first = usages[0] if usages else None
    return {**first, **counts} if first is not None else counts


def merge_json(endpoint: Endpoint, n: int, answers: list[bytes]) -> bytes:
    """The legs' JSON answers (in choice order) as one; ``ValueError`` when one is not a single
    choice answer."""
    merged: dict[str, Any] | None = None
    choices = []
    usages = []
    for index, data in enumerate(answers):
        obj = loads(data)
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            raise ValueError("a fan-out leg's answer is not a completion")
        if len(obj["choices"]) != 1 or not isinstance(obj["choices"][0], dict):
            raise ValueError("a fan-out leg answered more than one choice")
        choice = obj["choices"][0]
        choice["index"] = index
        choices.append(choice)
        usages.append(obj.get("usage") if isinstance(obj.get("usage"), dict) else None)
        if merged is None:
            merged = obj
    if merged is None:
        raise ValueError("no answers to merge")
    merged["choices"] = choices
    merged["usage"] = merge_usage(endpoint, n, usages)
    if "kv_transfer_params" in merged:
        merged["kv_transfer_params"] = None
    return dumps(merged)


class StreamMerge:
    """The legs' event streams as one: chunks re-indexed to their choice under one id, each leg's
    ``[DONE]`` and usage-only chunk held back, then one usage chunk (when the client asked for
    it) and one ``[DONE]`` at the end. Feed each leg's bytes as they come; events stay whole."""

    def __init__(self, endpoint: Endpoint, n: int, legs: int) -> None:
        self.endpoint = endpoint
        self.n = n
        self._splitters = [EventSplitter() for _ in range(legs)]
        self._usage: list[Mapping[str, Any] | None] = [None] * legs
        self._id: str | None = None
        self._template: dict[str, Any] | None = None  # id, object, created, model

    def feed(self, leg: int, data: bytes) -> bytes:
        """The complete events of leg ``leg``'s ``data`` (after what came before), rewritten."""
        return b"".join(self._event(leg, e) for e in events(self._splitters[leg].feed(data)))

    def _event(self, leg: int, data: bytes) -> bytes:
        """One of leg ``leg``'s events, rewritten, with its separator (b"": held back)."""
        if data.strip() == DONE.strip():
            return b""
        obj = event_json(data)
        if obj is None or not isinstance(obj.get("choices"), list):
            return data + b"\n\n"  # comments, other fields and error events pass
        if self._id is None:
            self._id = obj.get("id")
            self._template = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        obj["id"] = self._id
        if not obj["choices"]:
            if isinstance(obj.get("usage"), dict):
                self._usage[leg] = obj["usage"]
            return b""  # the leg's usage-only chunk: merged into the final one
        for choice in obj["choices"]:
            if isinstance(choice, dict):
                choice["index"] = leg
        return event(obj)

    def finish(self, include_usage: bool) -> bytes:
        """What ends the merged stream: the summed usage chunk when asked for, then ``[DONE]``."""
        merged = merge_usage(self.endpoint, self.n, self._usage) if include_usage else None
        if merged is None:
            return DONE
        return event({**(self._template or {}), "choices": [], "usage": merged}) + DONE
