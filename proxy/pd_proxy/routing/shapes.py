"""Which way a request goes through P/D, decided from its body alone, before any backend is touched.

vLLM turns some request shapes into several engine requests (``n`` above 1, a list of prompts)
while answering only one ``kv_transfer_params``: on the prefill the other copies keep their KV
until the lease expires. Others cannot be served by a decode that reads the prompt's KV
(``prompt_logprobs``). The decisions and their reasons are data, in ``shapes.yaml`` next to this
module (one source for the classifier, the tests and the README's table); the predicates that
recognise each shape are here, keyed by the shape's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Final, Literal

import yaml

from pd_proxy.backends.route import LOCAL, PD
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoint
from pd_proxy.routing.token_ids import is_token_ids

# The ways a shape sends a request, as one type mypy checks: pd_proxy.backends.route's two paths
# (LOCAL, PD), one P/D request per choice (FANOUT), or a 400 (REFUSE).
ShapeRoute = Literal["refuse", "local", "fanout", "pd"]
FANOUT: Final = "fanout"
REFUSE: Final = "refuse"
ROUTES: tuple[ShapeRoute, ...] = (REFUSE, LOCAL, FANOUT, PD)  # the order the table checks them in
ENDPOINTS: dict[str, Endpoint] = {"completions": COMPLETIONS, "chat": CHAT_COMPLETIONS}
# What recognises a shape in a body sent to an endpoint.
Matcher = Callable[[Mapping[str, Any], Endpoint], bool]


@dataclass(frozen=True)
class Shape:
    """One row of the table: a request shape, the route it takes and why."""

    name: str
    param: str | None
    route: ShapeRoute
    endpoints: tuple[Endpoint, ...]
    why: str
    example: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Table:
    shapes: tuple[Shape, ...]
    max_fanout: int


@dataclass(frozen=True)
class Decision:
    route: ShapeRoute
    shape: Shape

    def refusal(self) -> str:
        """The 400 message of a refused request: the parameter and why P/D cannot serve it."""
        return f"'{self.shape.param}' is not served by this P/D proxy: {self.shape.why}"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def samples(body: Mapping[str, Any]) -> int:
    """``n`` when it asks for several samples, else 1 (an invalid ``n`` is vLLM's to refuse)."""
    n = _int(body.get("n"))
    return n if n is not None and n > 1 else 1


def greedy_samples(body: Mapping[str, Any]) -> bool:
    """``n`` above 1 at temperature 0: vLLM refuses it (400), so it must reach vLLM as it is."""
    temperature = body.get("temperature")
    greedy = isinstance(temperature, (int, float)) and temperature < 1e-5
    return greedy and samples(body) > 1


def prompts(body: Mapping[str, Any], endpoint: Endpoint) -> list[Any] | None:
    """The prompts of a completions request that lists several (texts or token-id lists)."""
    prompt = body.get("prompt")
    if endpoint != COMPLETIONS or not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    return None


def fanout_size(body: Mapping[str, Any], endpoint: Endpoint) -> int:
    """How many P/D requests the request becomes: prompts x n."""
    listed = prompts(body, endpoint)
    return (1 if listed is None else len(listed)) * samples(body)


def _text_prompts(body: Mapping[str, Any], endpoint: Endpoint) -> bool:
    listed = prompts(body, endpoint)
    return listed is not None and isinstance(listed[0], str)


def _id_prompts(body: Mapping[str, Any], endpoint: Endpoint) -> bool:
    listed = prompts(body, endpoint)
    return listed is not None and isinstance(listed[0], list)


def _present(param: str) -> Matcher:
    return lambda body, endpoint: body.get(param) not in (None, False)


def _multimodal(body: Mapping[str, Any], endpoint: Endpoint) -> bool:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") != "text" for part in content
        ):
            return True
    return False


# What recognises each shape of the table (by name); the table says what to do with it.
MATCHERS: dict[str, Matcher] = {
    "client_kv_transfer_params": _present("kv_transfer_params"),
    "fanout_too_large": lambda body, endpoint: False,  # a fan-out past the limit: classify()
    "prompt_logprobs": lambda body, endpoint: body.get("prompt_logprobs") is not None,
    "stream_options_without_stream": lambda body, endpoint: (
        body.get("stream_options") is not None and body.get("stream") is not True
    ),
    "beam_search": _present("use_beam_search"),
    "n": lambda body, endpoint: samples(body) > 1 and not greedy_samples(body),
    "prompt_list": lambda body, endpoint: (
        _text_prompts(body, endpoint) and not greedy_samples(body)
    ),
    "prompt_token_id_lists": lambda body, endpoint: (
        _id_prompts(body, endpoint) and not greedy_samples(body)
    ),
    "greedy_n": lambda body, endpoint: greedy_samples(body),
    "prompt_token_ids": lambda body, endpoint: is_token_ids(body.get("prompt")),
    "echo": _present("echo"),
    "logprobs": lambda body, endpoint: body.get("logprobs") is not None,
    "top_logprobs": lambda body, endpoint: body.get("top_logprobs") is not None,
    "best_of": lambda body, endpoint: body.get("best_of") is not None,
    "stop": _present("stop"),
    "response_format": _present("response_format"),
    "structured_outputs": _present("structured_outputs"),
    "include_usage": lambda body, endpoint: (
        isinstance(body.get("stream_options"), dict)
        and bool(body["stream_options"].get("include_usage"))
    ),
    "min_tokens": _present("min_tokens"),
    "ignore_eos": _present("ignore_eos"),
    "seed": lambda body, endpoint: body.get("seed") is not None,
    "multimodal_content": _multimodal,
    "plain": lambda body, endpoint: True,
}


def parse_table(text: str) -> Table:
    """The table from ``shapes.yaml``'s text; ``ValueError`` when it breaks the file's rules."""
    data = yaml.safe_load(text)
    rows = []
    for row in data["shapes"]:
        route = _shape_route(row)
        if row["name"] not in MATCHERS:
            raise ValueError(f"shape {row['name']} has no matcher in pd_proxy.routing.shapes")
        rows.append(
            Shape(
                name=row["name"],
                param=row["param"],
                route=route,
                endpoints=tuple(ENDPOINTS[e] for e in row["endpoints"]),
                why=" ".join(row["why"].split()),
                example=row.get("example") or {},
            )
        )
    order = [ROUTES.index(s.route) for s in rows]
    if order != sorted(order):
        raise ValueError("shapes must be listed refuse, then local, then fanout, then pd")
    if rows[-1].name != "plain":
        raise ValueError("the last shape must be 'plain' (it matches every request)")
    return Table(tuple(rows), int(data["max_fanout"]))


def _shape_route(row: Mapping[str, Any]) -> ShapeRoute:
    """A row's route as the type says, or ``ValueError`` naming the row."""
    for route in ROUTES:
        if row["route"] == route:
            return route
    raise ValueError(f"shape {row['name']}: route {row['route']!r} is not one of {ROUTES}")


def load_table() -> Table:
    return parse_table(
        resources.files("pd_proxy.routing").joinpath("shapes.yaml").read_text("utf-8")
    )


TABLE = load_table()
_BY_NAME = {shape.name: shape for shape in TABLE.shapes}


def shape(name: str) -> Shape:
    return _BY_NAME[name]


def classify(body: Mapping[str, Any], endpoint: Endpoint, table: Table = TABLE) -> Decision:
    """The route of a parsed client body on ``endpoint``: the first shape of the table it has."""
    for row in table.shapes:
        if endpoint not in row.endpoints:
            continue
        if row.name == "fanout_too_large" or not MATCHERS[row.name](body, endpoint):
            continue
        if row.route == FANOUT and fanout_size(body, endpoint) > table.max_fanout:
            too_large = next(s for s in table.shapes if s.name == "fanout_too_large")
            return Decision(too_large.route, too_large)
        return Decision(row.route, row)
    raise AssertionError("unreachable: 'plain' matches every request")


def markdown_table(table: Table = TABLE) -> str:
    """The README's table of request shapes, generated from the data."""
    lines = ["| shape | parameter | endpoints | route | why |", "|---|---|---|---|---|"]
    names = {v: k for k, v in ENDPOINTS.items()}
    for row in table.shapes:
        endpoints = ", ".join(names[e] for e in row.endpoints)
        param = f"`{row.param}`" if row.param else "-"
        lines.append(f"| {row.name} | {param} | {endpoints} | {row.route} | {row.why} |")
    return "\n".join(lines) + "\n"
