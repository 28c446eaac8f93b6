"""A minimal vLLM KV connector that records the calls it receives (harness tests only).

Loaded by vLLM through `kv_connector_module_path="recording_connector"`; the worker role
records its calls on the instance, the scheduler role never offers external tokens.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class RecordingMetadata(KVConnectorMetadata):
    """Carries the step's scheduled request ids to the worker role."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    """Record every worker-role call; plan nothing."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: list[str] = []
        self.registered: dict[str, Any] = {}

    # worker role
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.registered = dict(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.calls.append("handle_preemptions")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.calls.append("bind_connector_metadata")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.calls.append("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append("wait_for_layer_load")

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.calls.append("save_kv_layer")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        self.calls.append("get_finished")
        return None, None

    def build_connector_worker_meta(self) -> None:
        self.calls.append("build_connector_worker_meta")

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.calls.append("clear_connector_metadata")

    # scheduler role
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> RecordingMetadata:
        return RecordingMetadata(list(scheduler_output.num_scheduled_tokens))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return False, None
