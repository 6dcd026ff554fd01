"""A second ``MultiConnector`` child that keeps vLLM's default ``get_finished_count()`` (None),
as vLLM's OffloadingConnector and most others do: it loads nothing, saves nothing, holds no block.

Loaded by vLLM's connector factory through ``kv_connector_module_path``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class CountlessConnector(KVConnectorBase_V1, SupportsHMA):
    """Does nothing on either side; its only effect is ``get_finished_count() is None``."""

    # -- worker side --
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side --
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


class CountedConnector(CountlessConnector):
    """The same, but with a count of its own: one report per request (TP x PP of a TP1 PP1
    engine), so a MultiConnector around it keeps the other children's count if they agree."""

    def get_finished_count(self) -> int | None:
        return 1
