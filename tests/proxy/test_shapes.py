"""The request-shape table (pd_proxy/routing/shapes.yaml) and the classifier that reads it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from pd_proxy.routing import shapes
from pd_proxy.routing.shapes import FANOUT, LOCAL, PD, REFUSE, TABLE, classify, parse_table

ROOT = Path(__file__).resolve().parents[2]
YAML = (ROOT / "proxy" / "pd_proxy" / "routing" / "shapes.yaml").read_text()


def base(endpoint: str) -> dict:
    if endpoint == COMPLETIONS:
        return {"model": "m", "prompt": "The capital of France is", "max_tokens": 8}
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


CASES = [
    pytest.param(row, endpoint, id=f"{row.name}-{'chat' if 'chat' in endpoint else 'completions'}")
    for row in TABLE.shapes
    for endpoint in row.endpoints
]


@pytest.mark.parametrize(("row", "endpoint"), CASES)
def test_each_shape_example_takes_its_route(row: shapes.Shape, endpoint: str) -> None:
    body = {**base(endpoint), **row.example}
    decision = classify(body, endpoint)
    assert decision.route == row.route
    assert decision.shape.name == row.name


def test_every_route_is_used_and_every_matcher_has_a_row() -> None:
    assert {row.route for row in TABLE.shapes} == {PD, FANOUT, LOCAL, REFUSE}
    assert {row.name for row in TABLE.shapes} == set(shapes.MATCHERS)


def test_refusal_names_the_parameter_and_the_reason() -> None:
    body = {**base(COMPLETIONS), "kv_transfer_params": {"do_remote_prefill": True}}
    decision = classify(body, COMPLETIONS)
    assert decision.route == REFUSE
    assert decision.refusal().startswith("'kv_transfer_params' is not served")
    assert "blocks" in decision.refusal()


def test_null_kv_transfer_params_is_plain() -> None:
    body = {**base(CHAT_COMPLETIONS), "kv_transfer_params": None}
    assert classify(body, CHAT_COMPLETIONS).route == PD


@pytest.mark.parametrize(
    ("extra", "route", "name"),
    [
        ({"n": 1}, PD, "plain"),
        ({"n": True}, PD, "plain"),  # vLLM's to refuse
        ({"n": "3"}, PD, "plain"),
        ({"n": 2, "prompt_logprobs": 0}, LOCAL, "prompt_logprobs"),  # local wins over fan-out
        ({"n": 64}, FANOUT, "n"),
        ({"n": 65}, REFUSE, "fanout_too_large"),
        ({"n": 65, "use_beam_search": True}, LOCAL, "beam_search"),
        ({"prompt": ["a"] * 8, "n": 8}, FANOUT, "n"),
        ({"prompt": ["a"] * 8, "n": 9}, REFUSE, "fanout_too_large"),
        ({"prompt": ["one"]}, PD, "plain"),
        ({"prompt": [[1, 2]]}, PD, "plain"),
        ({"prompt": ["a", [1, 2]]}, PD, "plain"),  # mixed: vLLM's to refuse
        ({"prompt": []}, PD, "prompt_token_ids"),
        ({"prompt_logprobs": None}, PD, "plain"),
        ({"n": 2, "temperature": 0}, PD, "greedy_n"),  # vLLM's 400, relayed
        ({"prompt": ["a", "b"], "n": 2, "temperature": 0.0}, PD, "greedy_n"),
        ({"prompt": ["a", "b"], "temperature": 0.0}, FANOUT, "prompt_list"),
        ({"n": 3, "temperature": 1e-6}, PD, "greedy_n"),
        ({"stream_options": {"include_usage": False}}, LOCAL, "stream_options_without_stream"),
        ({"stream_options": {"include_usage": False}, "stream": True}, PD, "plain"),
    ],
)
def test_edges(extra: dict, route: str, name: str) -> None:
    decision = classify({**base(COMPLETIONS), **extra}, COMPLETIONS)
    assert (decision.route, decision.shape.name) == (route, name)


def test_prompt_lists_do_not_exist_on_chat() -> None:
    body = {**base(CHAT_COMPLETIONS), "prompt": ["a", "b"]}
    assert classify(body, CHAT_COMPLETIONS).shape.name == "plain"


def test_fanout_size() -> None:
    body = {**base(COMPLETIONS), "prompt": ["a", "b", "c"], "n": 2}
    assert shapes.fanout_size(body, COMPLETIONS) == 6
    assert shapes.fanout_size({**base(CHAT_COMPLETIONS), "n": 3}, CHAT_COMPLETIONS) == 3


def test_table_order_is_enforced() -> None:
    broken = YAML.replace(
        "route: refuse\n    endpoints: [completions, chat]\n    example: {kv_transfer_params",
        "route: pd\n    endpoints: [completions, chat]\n    example: {kv_transfer_params",
        1,
    )
    assert broken != YAML
    with pytest.raises(ValueError, match="listed refuse, then local"):
        parse_table(broken)


def test_unknown_shape_or_route_is_refused() -> None:
    with pytest.raises(ValueError, match="no matcher"):
        parse_table(YAML.replace("name: echo", "name: echoes"))
    with pytest.raises(ValueError, match="route 'maybe'"):
        parse_table(YAML.replace("route: local", "route: maybe", 1))


def test_readme_table_is_the_data() -> None:
    readme = (ROOT / "proxy" / "README.md").read_text()
    found = re.search(
        r"<!-- shapes table: generated .*? -->\n(.*?)<!-- end of shapes table -->", readme, re.S
    )
    assert found, "proxy/README.md lacks the generated shapes table"
    assert found.group(1) == shapes.markdown_table()
