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


def _refuse_conflicting_upstream() -> None:
    """Refuses an upstream vllm-ascend that owns ``vllm_ascend/kv_offload``
    itself: releases < 0.30 (their own offloading, for vLLM 0.23), or a
    release with this subtree grafted in while this distribution is installed
    too. Either way the two would overwrite each other's files."""
    from importlib import metadata

    try:
        upstream = metadata.distribution("vllm-ascend")
    except metadata.PackageNotFoundError:
        return
    from packaging.version import InvalidVersion, Version

    try:
        too_old = Version(upstream.version) < Version("0.30.0rc0")
    except InvalidVersion:
        too_old = False
    try:
        metadata.distribution("vllm-ascend-kv-offload")
    except metadata.PackageNotFoundError:
        ours_installed = False  # e.g. grafted into upstream: this IS upstream
    else:
        ours_installed = True
    owns_subtree = any(
        str(f).startswith("vllm_ascend/kv_offload/") for f in upstream.files or ()
    )
    if too_old:
        raise ImportError(
            f"vllm-ascend-kv-offload {__version__} cannot run next to "
            f"vllm-ascend {upstream.version}: vllm-ascend < 0.30 has its own "
            "vllm_ascend/kv_offload package (for vLLM 0.23), which shares files "
            "with this one. Upgrade to vllm-ascend >= 0.30 (vLLM 0.30-0.33), then "
            "reinstall vllm-ascend-kv-offload; or uninstall "
            "vllm-ascend-kv-offload to keep vllm-ascend "
            f"{upstream.version}'s own offloading."
        )
    if ours_installed and owns_subtree:
        raise ImportError(
            f"vllm-ascend {upstream.version} ships vllm_ascend/kv_offload itself "
            f"(this feature, built in); vllm-ascend-kv-offload {__version__} is "
            "installed over the same files. Uninstall vllm-ascend-kv-offload, "
            "then reinstall vllm-ascend to restore its files."
        )


_refuse_conflicting_upstream()

from vllm_ascend.kv_offload import ops  # noqa: E402

__all__ = ["__version__", "ops"]
