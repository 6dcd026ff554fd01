"""KV_EXTRA_CONNECTORS: the JSON knob turned into vLLM's MultiConnector config, bad input refused
by name, and the result read back by vLLM's own config classes and MultiConnector."""

from __future__ import annotations

import json

import pytest

from pcp_nixl_connector.extra_connectors import parse_extra_connectors, with_extra_connectors

KIT = {
    "kv_connector": "PcpCanonicalNixlConnector",
    "kv_connector_module_path": "pcp_nixl_connector",
    "kv_role": "kv_producer",
    "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {"kv_lease_duration": 30},
}
EXAMPLE = {
    "kv_connector": "ExampleConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"},
}


@pytest.mark.parametrize("raw", ["", "  ", "\n"])
def test_blank_means_the_kits_connector_alone(raw: str) -> None:
    assert parse_extra_connectors(raw) == []
    assert with_extra_connectors(KIT, []) is KIT


def test_extras_wrap_the_kits_connector_first_in_world_size_mode() -> None:
    extras = parse_extra_connectors(json.dumps([EXAMPLE]), kit_connector=KIT["kv_connector"])
    config = with_extra_connectors(KIT, extras)
    assert config["kv_connector"] == "MultiConnector"
    assert config["kv_role"] == "kv_producer" and config["kv_buffer_device"] == "cpu"
    kit, example = config["kv_connector_extra_config"]["connectors"]
    assert example == EXAMPLE
    assert kit["kv_connector_extra_config"] == {
        "kv_lease_duration": 30,
        "pcp_completion_mode": "world_size",
    }
    assert "pcp_completion_mode" not in KIT["kv_connector_extra_config"]  # input untouched


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("[{kv_connector: 1}]", "KV_EXTRA_CONNECTORS is not JSON"),
        ('{"kv_connector": "ExampleConnector"}', "must be a non-empty JSON list"),
        ("[]", "must be a non-empty JSON list"),
        ('["ExampleConnector"]', "KV_EXTRA_CONNECTORS[0] must be an object"),
        ('[{"kv_role": "kv_both"}]', "KV_EXTRA_CONNECTORS[0] has no kv_connector"),
        ('[{"kv_connector": "ExampleConnector"}]', "(ExampleConnector) needs kv_role"),
        ('[{"kv_connector": "MultiConnector", "kv_role": "kv_both"}]', "list only the other"),
        ('[{"kv_connector": "PcpCanonicalNixlConnector", "kv_role": "kv_both"}]', "list only"),
        (
            '[{"kv_connector": "X", "kv_role": "kv_both", "kv_connector_extra_config": []}]',
            "kv_connector_extra_config must be an object",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_knob_and_entry(raw: str, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_extra_connectors(raw, kit_connector="PcpCanonicalNixlConnector")
    assert needle in str(info.value)


@pytest.mark.vllm
def test_vllm_builds_the_wrapper_and_finds_both_children(tmp_path) -> None:
    """vLLM's KVTransferConfig takes the built config, and MultiConnector resolves its children
    to the kit's class (first) and vLLM's ExampleConnector."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from pcp_nixl_connector import PcpCanonicalNixlConnector

    config = with_extra_connectors(KIT, parse_extra_connectors(json.dumps([EXAMPLE])))
    ktc = KVTransferConfig(**config)
    assert ktc.has_connector("PcpCanonicalNixlConnector")
    vllm_config = VllmConfig(kv_transfer_config=ktc)
    children = MultiConnector._get_connector_classes_and_configs(vllm_config)
    assert [cls.__name__ for cls, _cfg in children] == [
        PcpCanonicalNixlConnector.__name__,
        "ExampleConnector",
    ]
    kit_cfg = children[0][1].kv_transfer_config
    assert kit_cfg.kv_connector_extra_config["pcp_completion_mode"] == "world_size"
