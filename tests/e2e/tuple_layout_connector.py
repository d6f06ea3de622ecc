"""Test-only connector: present each layer's cache as Ascend does, a tuple.

vLLM's CPU backend gives one tensor per layer. This connector cuts every
block of it into two parts of unequal size (3/4 and 1/4, like MLA's nope and
rope) and registers the layers as ``(part0, part1)`` tuples, so a real engine
runs the Ascend tuple path of ``AscendOffloadingConnector`` end to end.
"""

from __future__ import annotations

from vllm_ascend.kv_offload.connector import AscendOffloadingConnector
from vllm_ascend.kv_offload.kv_layout import block_view


class TupleLayoutOffloadingConnector(AscendOffloadingConnector):
    registered_as_tuples = False

    def register_kv_caches(self, kv_caches):
        num_blocks = self.connector_worker.kv_cache_config.num_blocks
        tuples = {}
        for name, cache in kv_caches.items():
            blocks = block_view(cache, num_blocks, name)
            cut = blocks.shape[1] * 3 // 4
            tuples[name] = (blocks[:, :cut], blocks[:, cut:])
        super().register_kv_caches(tuples)
        worker = self.connector_worker.worker
        # Two parts per layer must have reached the offloading worker.
        assert len(worker.engine.groups[0].page_bytes) == 2 * len(kv_caches)
