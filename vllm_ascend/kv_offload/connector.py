"""``OffloadingConnector`` for Ascend KV-cache layouts, registered by plugin.

vLLM's connector turns each layer's cache into one block view and fails on
vllm-ascend's tuples (``(k, v)``, MLA's ``(nope, rope)``, Mamba state lists).
This variant hands such layouts to ``kv_layout.canonicalize`` and leaves
single-tensor layouts to vLLM. The ``vllm.general_plugins`` entry point
``register`` puts it under the name ``OffloadingConnector``, so the guide's
``kv_connector="OffloadingConnector"`` selects it with no extra setting.
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from vllm_ascend.kv_offload.kv_layout import KVCacheParts, canonicalize
from vllm_ascend.logger import init_logger

logger = init_logger(__name__)

CONNECTOR_NAME = "OffloadingConnector"


class AscendOffloadingConnector(OffloadingConnector):
    """vLLM's offloading connector, plus per-part views of tuple layouts."""

    def register_kv_caches(self, kv_caches: dict[str, KVCacheParts]) -> None:
        worker = self.connector_worker
        assert worker is not None
        if all(isinstance(c, torch.Tensor) for c in kv_caches.values()):
            worker.register_kv_caches(kv_caches)
            return
        config = worker.kv_cache_config
        groups = [
            config.kv_cache_groups[g].layer_names
            for g in get_offloading_group_ids(config)
        ]
        canonical = canonicalize(kv_caches, groups, config.num_blocks)
        logger.info(
            "KV offload: %d layers in %d groups as %d per-part block views",
            sum(len(g) for g in groups),
            len(groups),
            len(canonical.tensors),
        )
        worker._init_worker(canonical)


def register() -> None:
    """``vllm.general_plugins`` hook: serve ``OffloadingConnector`` with ours.

    vLLM may load plugins several times per process; this is idempotent.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    KVConnectorFactory._registry[CONNECTOR_NAME] = lambda: AscendOffloadingConnector
