"""KV-cache CPU offloading for vLLM on Ascend NPUs (and CUDA / CPU).

Importing this package loads the batched-copy op
(``torch.ops._C_ascend.swap_blocks_batch``) or, without the native extension,
its pure-Python fallback. The spec lives in ``vllm_ascend.kv_offload.npu``.
"""

from vllm_ascend.kv_offload import ops

__all__ = ["ops"]
