"""How many copies of each CPU block's KV an engine stores: one per worker,
or one in all where every worker holds the same KV.

vLLM decides the latter (``OffloadingConfig.replicated_layout``): an MLA
model (DeepSeek-style: one latent per token, the same on every
tensor-parallel rank) under tensor parallelism > 1 with no other
parallelism (pipeline, context), vLLM's ``mp`` executor and one node. Then
the workers of the host share one region holding rank 0's copy
(``region_worker.py``), which rank 0 alone writes and every rank loads.

No vLLM import: the doctor's sizing reads a ``config.json`` only.
"""

from __future__ import annotations


def stored_copies(world_size: int, replicated: bool) -> int:
    """Copies of a CPU block's KV the engine stores (all on one host when
    ``replicated``)."""
    return 1 if replicated else world_size


def predicts_replicated(mla: bool, tensor_parallel_size: int) -> bool:
    """Whether vLLM will call an engine's KV layout replicated, from what a
    model's config and ``--tensor-parallel-size`` say; assumes the rest of
    vLLM's rule holds (one node, no pipeline or context parallelism, the
    ``mp`` executor: vLLM's default on one node)."""
    return mla and tensor_parallel_size > 1
