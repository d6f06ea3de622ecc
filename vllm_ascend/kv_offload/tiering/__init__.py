"""Device -> CPU -> shared storage tiering, loaded by vLLM's
``OffloadingConnector`` through ``"spec_name": "NPUTieringOffloadingSpec"``
and ``"spec_module_path": "vllm_ascend.kv_offload.tiering"``.

Modules: ``spec`` (the spec, its worker, its config checks), ``fs`` (the
verified ``fs`` tier), ``block_file`` (the file format), ``identity`` (which
writers' files a reader may use), ``region`` (the shared ``/dev/shm``
region and its block pool), ``host_register`` (ACL/CUDA registration).
"""

from vllm_ascend.kv_offload.tiering.spec import NPUTieringOffloadingSpec

__all__ = ["NPUTieringOffloadingSpec"]
