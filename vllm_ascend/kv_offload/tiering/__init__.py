"""Device -> CPU -> shared storage tiering, loaded by vLLM's
``OffloadingConnector`` through ``"spec_name": "NPUTieringOffloadingSpec"``
and ``"spec_module_path": "vllm_ascend.kv_offload.tiering"``.

Modules: ``spec`` (the spec, its config checks), ``fs`` (the verified
``fs`` tier), ``block_file`` (the file format), ``identity`` (which
writers' files a reader may use). The shared ``/dev/shm`` region, its block
pool, its registration and the worker on it are the package's
(``region.py``, ``region_worker.py``): the guide's
spec stores a replicated KV layout in one too.
"""

from vllm_ascend.kv_offload.tiering.spec import NPUTieringOffloadingSpec

__all__ = ["NPUTieringOffloadingSpec"]
