"""Refuses an upstream vllm-ascend that owns ``vllm_ascend/kv_offload``.

A leaf (the standard library and ``packaging`` only): the general plugin runs
it in every process, the doctor reports it, and
``scripts/install_next_to_vllm_ascend.sh`` loads this file from the checkout
to refuse before it builds or installs anything.
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import InvalidVersion, Version


def refuse_conflicting_upstream(ours: str) -> None:
    """Raises ImportError next to an upstream vllm-ascend that owns this
    subtree itself: releases < 0.30 (their own offloading, for vLLM 0.23), or
    a release with this subtree grafted in while this distribution (version
    ``ours``) is installed too. Either way the two would overwrite each
    other's files."""
    try:
        upstream = metadata.distribution("vllm-ascend")
    except metadata.PackageNotFoundError:
        return
    try:
        too_old = Version(upstream.version) < Version("0.30.0rc0")
    except InvalidVersion:
        too_old = False
    if too_old:
        raise ImportError(
            f"vllm-ascend-kv-offload {ours} cannot run next to "
            f"vllm-ascend {upstream.version}: vllm-ascend < 0.30 has its own "
            "vllm_ascend/kv_offload package (for vLLM 0.23), which shares files "
            "with this one. Upgrade to vllm-ascend >= 0.30 (vLLM 0.30-0.33), then "
            "reinstall vllm-ascend-kv-offload; or uninstall "
            "vllm-ascend-kv-offload to keep vllm-ascend "
            f"{upstream.version}'s own offloading."
        )
    try:
        metadata.distribution("vllm-ascend-kv-offload")
    except metadata.PackageNotFoundError:
        return  # e.g. grafted into upstream: this IS upstream
    # Upstream's RECORD is read only here, not at every import.
    if any(str(f).startswith("vllm_ascend/kv_offload/") for f in upstream.files or ()):
        raise ImportError(
            f"vllm-ascend {upstream.version} ships vllm_ascend/kv_offload itself "
            f"(this feature, built in); vllm-ascend-kv-offload {ours} is "
            "installed over the same files. Uninstall vllm-ascend-kv-offload, "
            "then reinstall vllm-ascend to restore its files."
        )
