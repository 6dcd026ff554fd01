"""The two legs as pure functions: every field the NIXL P/D protocol cares about."""

from __future__ import annotations

import copy
import json

import pytest

from pd_proxy.protocol.codec import dumps
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from pd_proxy.protocol.parse import BadRequest, parse_request
from pd_proxy.protocol.pd_bodies import (
    decode_body,
    decode_payload,
    kv_params_from_prefill,
    prefill_body,
)
from tests.proxy.proxy_harness import EXPECTED_PREFILL_KV

FULL_COMPLETION = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 64,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 5,
    "temperature": 0.0,
    "kv_transfer_params": {"client": "supplied"},
}

FULL_CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 64,
    "max_completion_tokens": 32,
    "min_completion_tokens": 3,
    "stream": True,
    "stream_options": {"include_usage": True},
    "top_p": 0.5,
    "response_format": {"type": "json_object"},
    "structured_outputs": {"choice": ["a", "b"]},
}


def test_prefill_leg_of_a_completion_rewrites_every_field():
    original = copy.deepcopy(FULL_COMPLETION)
    body = prefill_body(FULL_COMPLETION)
    assert body == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.0,
        "kv_transfer_params": EXPECTED_PREFILL_KV,
    }
    assert FULL_COMPLETION == original  # the client's body is not mutated


def test_prefill_leg_of_a_chat_caps_max_completion_tokens_drops_min_and_grammar_fields():
    body = prefill_body(FULL_CHAT)
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "top_p": 0.5,
        "kv_transfer_params": EXPECTED_PREFILL_KV,
    }


def test_prefill_leg_adds_max_tokens_but_not_max_completion_tokens_when_absent():
    body = prefill_body({"prompt": "x"})
    assert body["max_tokens"] == 1
    assert "max_completion_tokens" not in body
    assert body["stream"] is False


def test_each_prefill_leg_gets_its_own_kv_params_dict():
    a = prefill_body({"prompt": "x"})
    a["kv_transfer_params"]["remote_host"] = "mutated"
    assert prefill_body({"prompt": "x"})["kv_transfer_params"] == EXPECTED_PREFILL_KV


def test_decode_leg_is_the_original_body_plus_the_prefill_params():
    kv = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
    body = decode_body(FULL_CHAT, kv)
    expected = dict(FULL_CHAT)
    expected["kv_transfer_params"] = kv
    assert body == expected
    assert "kv_transfer_params" not in FULL_CHAT


def test_decode_leg_replaces_client_supplied_kv_params():
    body = decode_body(FULL_COMPLETION, None)
    assert body["kv_transfer_params"] is None
    assert body["stream_options"] == {"include_usage": True}
    assert body["min_tokens"] == 5


@pytest.mark.parametrize(
    ("raw", "endpoint", "message"),
    [
        (b"{not json", COMPLETIONS, "not valid JSON"),
        (b"\xff\xfe", COMPLETIONS, "not valid JSON"),
        (b"[1, 2]", COMPLETIONS, "JSON object"),
        (b'{"model": "m"}', COMPLETIONS, "'prompt' is required"),
        (b'{"prompt": null}', COMPLETIONS, "'prompt' is required"),
        (b'{"prompt": "x"}', CHAT_COMPLETIONS, "'messages' is required"),
    ],
)
def test_parse_request_rejects(raw, endpoint, message):
    with pytest.raises(BadRequest, match=message):
        parse_request(raw, endpoint)


def test_parse_request_accepts_each_endpoints_required_field():
    assert parse_request(b'{"prompt": [1, 2]}', COMPLETIONS) == {"prompt": [1, 2]}
    assert parse_request(b'{"messages": []}', CHAT_COMPLETIONS) == {"messages": []}


def test_kv_params_from_prefill():
    kv = {"remote_block_ids": [3], "do_remote_prefill": True}
    assert kv_params_from_prefill(json.dumps({"kv_transfer_params": kv}).encode()) == kv
    assert kv_params_from_prefill(b'{"choices": []}') is None
    with pytest.raises(ValueError):
        kv_params_from_prefill(b"[]")
    with pytest.raises(ValueError):
        kv_params_from_prefill(b"<html>")


def test_decode_payload_splices_the_client_bytes():
    raw = b' {"prompt": "hi \\u00e9", "max_tokens": 5, "x": 1.50} \n'
    kv = {"remote_engine_id": "e", "remote_block_ids": [1, 2]}
    out = decode_payload(raw, parse_request(raw, COMPLETIONS), kv)
    assert out.startswith(b'{"prompt": "hi \\u00e9", "max_tokens": 5, "x": 1.50,')
    assert json.loads(out) == decode_body(json.loads(raw), kv)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "a", "kv_transfer_params": {"old": 1}}',  # replaced, not duplicated
        '{"prompt": "a"}'.encode("utf-16"),  # not UTF-8: re-encoded
    ],
)
def test_decode_payload_falls_back_to_reencoding(raw):
    request = parse_request(raw, COMPLETIONS)
    out = decode_payload(raw, request, None)
    assert out.count(b"kv_transfer_params") == 1
    assert json.loads(out) == decode_body(request, None)


def test_json_the_fast_parser_refuses_still_parses():
    body = parse_request(b'{"prompt": "a", "temperature": NaN}', COMPLETIONS)
    assert body["temperature"] != body["temperature"]  # NaN, read by the stdlib fallback
    assert json.loads(dumps(body))["prompt"] == "a"


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys: {keys}"
    return dict(pairs)


ODD_CHAT_BODIES = [
    # Raw UTF-8 in every script, and the same characters escaped.
    '{"messages": [{"role": "user", "content": "héllo ☃ 日本語 😀"}], "model": "m"}'.encode(),
    b'{"messages":[{"role":"user","content":"h\\u00e9llo \\u2603 \\ud83d\\ude00"}]}',
    # Escaped quotes, backslashes, a closing brace and the key's name inside strings.
    b'{"messages":[{"role":"user","content":"say \\"}\\" \\\\ \\"kv_transfer_params\\": 1"}]}',
    # Nested objects and arrays: tools, response_format, multi-part content, nulls.
    b'{"messages": [{"role": "system", "content": null}, {"role": "user", "content": '
    b'[{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": '
    b'"data:image/png;base64,AAAA"}}]}], "tools": [{"type": "function", "function": {"name": '
    b'"f", "parameters": {"type": "object", "properties": {"a": {"type": ["string", "null"]}}}}}],'
    b' "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}, "n": 1}',
    # The key nested below the top level is the client's own business.
    b'{"messages": [{"role": "user", "content": "x"}], "metadata": {"kv_transfer_params": {}}}',
    # Whitespace everywhere JSON allows it.
    b'\r\n\t {\n  "messages" :\n  [ { "role" : "user" , "content" : "x" } ] ,\n'
    b'  "stream" : true\n}\n\t ',
    # Numbers as the client wrote them (exponents, trailing zeros) stay as written.
    b'{"messages":[{"role":"user","content":"x"}],"temperature":1.50,"top_p":1e-1,"seed":-0}',
]
CLIENT_KV_CHAT_BODIES = [
    b'{"messages":[{"role":"user","content":"x"}],"kv_transfer_params":{"do_remote_prefill":1}}',
    b'{"kv_transfer_params": null, "messages": [{"role": "user", "content": "\\u00e9"}]}',
    # An escaped spelling of the key is the same key once parsed.
    b'{"messages":[{"role":"user","content":"x"}],"kv_transfer_param\\u0073":{"old":true}}',
]
KV_VALUES = [
    None,
    {"do_remote_prefill": True, "remote_block_ids": [1, 2, [3]], "remote_host": "h\u00e9",
     "remote_engine_id": "e\"\\}", "nested": {"a": {"b": None}}},
]  # fmt: skip


@pytest.mark.parametrize("kv", KV_VALUES)
@pytest.mark.parametrize("raw", ODD_CHAT_BODIES)
def test_chat_decode_leg_splices_odd_bodies(raw, kv):
    """The chat decode leg is the client's bytes plus the key: it parses, with one such key, to
    exactly the semantic rewrite."""
    request = parse_request(raw, CHAT_COMPLETIONS)
    out = decode_payload(raw, request, kv)
    assert out.startswith(raw.strip(b" \t\r\n")[:-1])  # spliced, not re-encoded
    assert json.loads(out, object_pairs_hook=_no_duplicate_keys) == decode_body(json.loads(raw), kv)


@pytest.mark.parametrize("kv", KV_VALUES)
@pytest.mark.parametrize("raw", CLIENT_KV_CHAT_BODIES)
def test_chat_decode_leg_replaces_client_kv_params(raw, kv):
    request = parse_request(raw, CHAT_COMPLETIONS)
    out = decode_payload(raw, request, kv)
    parsed = json.loads(out, object_pairs_hook=_no_duplicate_keys)
    assert parsed == decode_body(json.loads(raw), kv)
    assert parsed["kv_transfer_params"] == kv


@pytest.mark.parametrize("raw", ODD_CHAT_BODIES + CLIENT_KV_CHAT_BODIES)
def test_completion_bodies_take_the_same_path(raw):
    """Completions and chat share the decode-leg builder: the same bytes give the same leg."""
    chat = parse_request(raw, CHAT_COMPLETIONS)
    completion = raw.replace(b'"messages"', b'"prompt"', 1)
    out = decode_payload(completion, parse_request(completion, COMPLETIONS), KV_VALUES[1])
    assert out == decode_payload(raw, chat, KV_VALUES[1]).replace(b'"messages"', b'"prompt"', 1)
