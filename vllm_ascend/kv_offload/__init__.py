"""KV-cache CPU offloading for vLLM on Ascend NPUs (and CUDA / CPU).

Distribution ``vllm-ascend-kv-offload``. It installs this subpackage only, so
that it lives next to upstream vllm-ascend (which owns ``vllm_ascend``) or,
without it, in a namespace package ``vllm_ascend``.

Importing this package loads the batched-copy op
(``torch.ops._C_ascend.kv_offload_swap_blocks``) or, without the native
extension, its pure-Python fallback. The spec lives in
``vllm_ascend.kv_offload.npu``.
"""

__version__ = "0.2.0"


def _refuse_old_upstream() -> None:
    """Upstream vllm-ascend < 0.30 ships a ``vllm_ascend/kv_offload`` of its
    own (for vLLM 0.23); the two would overwrite each other's files."""
    from importlib import metadata

    try:
        upstream = metadata.version("vllm-ascend")
    except metadata.PackageNotFoundError:
        return
    from packaging.version import InvalidVersion, Version

    try:
        too_old = Version(upstream) < Version("0.30.0rc0")
    except InvalidVersion:
        return
    if too_old:
        raise ImportError(
            f"vllm-ascend-kv-offload {__version__} cannot run next to "
            f"vllm-ascend {upstream}: vllm-ascend < 0.30 has its own "
            "vllm_ascend/kv_offload package (for vLLM 0.23), which shares files "
            "with this one. Upgrade to vllm-ascend >= 0.30 (vLLM 0.30-0.33), then "
            "reinstall vllm-ascend-kv-offload; or uninstall "
            "vllm-ascend-kv-offload to keep vllm-ascend "
            f"{upstream}'s own offloading."
        )


_refuse_old_upstream()

from vllm_ascend.kv_offload import ops  # noqa: E402

__all__ = ["__version__", "ops"]
