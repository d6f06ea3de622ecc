"""KV-cache CPU offloading for vLLM on Ascend NPUs (and CUDA / CPU).

Distribution ``vllm-ascend-kv-offload``. It installs this subpackage only, so
that it lives next to upstream vllm-ascend (which owns ``vllm_ascend``) or,
without it, in a namespace package ``vllm_ascend``.

Importing this package loads nothing else: every submodule import runs it, in
every process (the API server's too). The spec lives in
``vllm_ascend.kv_offload.npu``; the batched-copy op in ``ops`` (its native
library is loaded on first use); vLLM's general plugin ``plugin.register``
claims the connector name and refuses an upstream vllm-ascend that owns this
subtree.
"""

__version__ = "0.2.0"
