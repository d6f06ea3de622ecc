"""TEST ONLY: vLLM's ExampleConnector as the P/D stand-in, with a failed load
reported the way MooncakeConnector reports one.

vLLM's ``ExampleConnector`` (shared-storage P/D on CPU) raises in the forward
when a KV file it matched is gone by the time it loads, which ends the
engine. Mooncake instead reports the blocks it could not fill
(``get_block_ids_with_load_errors``) and vLLM recomputes them under
``kv_load_failure_policy="recompute"``. This subclass does the same, so a
failed P/D load can be exercised beside our offloading connector.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)

from vllm_ascend.kv_offload.logger import init_logger

logger = init_logger(__name__)


class ReportingExampleConnector(ExampleConnector):
    """ExampleConnector whose failed loads become load errors, not a crash."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.block_tokens = vllm_config.cache_config.block_size
        self.meta: ExampleConnectorMetadata | None = None
        self._failed_block_ids: set[int] = set()

    def bind_connector_metadata(self, connector_metadata) -> None:
        self.meta = connector_metadata
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        try:
            super().start_load_kv(forward_context, **kwargs)
        except FileNotFoundError as e:
            assert isinstance(self.meta, ExampleConnectorMetadata)
            for req in self.meta.requests:
                if not req.is_store:
                    blocks = (req.slot_mapping // self.block_tokens).tolist()
                    self._failed_block_ids.update(blocks)
            logger.warning("P/D stand-in: load failed (%s); reporting blocks", e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed
