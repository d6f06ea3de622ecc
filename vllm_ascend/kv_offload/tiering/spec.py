"""``NPUTieringOffloadingSpec``: vLLM's tiering framework (a CPU primary tier
in one shared ``/dev/shm`` region, secondary tiers such as ``fs``) with
``NPUOffloadingSpec``'s configuration, connector and worker; the config
checks of what it cannot do.

vLLM's inherited ``get_worker`` refuses every platform but CUDA and XPU;
this one builds our worker on the region (``region_worker.py``), which runs
on cpu, cuda and npu (``host_register``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from functools import cached_property
from typing import Any

from typing_extensions import override
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from vllm_ascend.kv_offload.config import (
    PREFIX,
    TIERING_KEYS,
    TIERING_SPEC,
    OffloadConfigError,
    check_keys,
    int_setting,
)
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec
from vllm_ascend.kv_offload.region import RegionMark, hold_mark
from vllm_ascend.kv_offload.region_worker import build_region_worker
from vllm_ascend.kv_offload.tiering.auth_key import AUTH_KEY_FILE, read_auth_key
from vllm_ascend.kv_offload.tiering.fs import VERIFIED_FS_TYPE, tier_dir_usable
from vllm_ascend.kv_offload.tiering.fs_budget import (
    MAX_BYTES_KEY,
    budget_metric_definitions,
)
from vllm_ascend.kv_offload.tiering.identity import (
    SHARED_ID,
    check_shared_id,
    storage_identity,
)

logger = init_logger(__name__)
# The secondary tier types that run as ours (tiering/fs.py).
FS_TYPES = ("fs", VERIFIED_FS_TYPE)


class _TieringManager(FailureAwareManager):
    """Ends the scheduler's hold on a region it created itself (no worker of
    its engine had mapped it): vLLM's cleanup removed the region, so the
    mark goes too rather than waiting for the next start's sweep."""

    def __init__(self, inner, capacity, own_mark: RegionMark | None):
        super().__init__(inner, capacity)
        self._own_mark = own_mark

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        finally:
            mark, self._own_mark = self._own_mark, None
            if mark is not None:
                mark.release_name()
                mark.close()


def check_tiering_config(extra: Mapping[str, Any]) -> None:
    """What this spec cannot do, refused before anything is allocated;
    ``extra``'s keys and their types passed ``config.check_keys``."""
    threshold = extra.get("store_threshold")  # a number (check_keys) or None
    if threshold is not None and threshold >= 2:
        raise OffloadConfigError(
            f"{PREFIX}['store_threshold']={threshold!r} is not supported by "
            f"{TIERING_SPEC} (vLLM's tiering manager stores every block); "
            "remove store_threshold, or use spec_name='NPUOffloadingSpec'"
        )
    for i, tier in enumerate(extra.get("secondary_tiers") or []):
        where = f"{PREFIX}['secondary_tiers'][{i}]"
        if not isinstance(tier, Mapping) or not tier.get("type"):
            raise OffloadConfigError(
                f"{where} must be a dict with a 'type', e.g. "
                '{"type": "fs", "root_dir": "/mnt/shared/kv"}'
            )
        is_fs = tier["type"] in FS_TYPES
        if MAX_BYTES_KEY in tier:  # the fs tier's size bound (fs_budget)
            value = tier[MAX_BYTES_KEY]
            if not is_fs:
                raise OffloadConfigError(
                    f"{where}['{MAX_BYTES_KEY}'] bounds the fs tier only (this "
                    f"tier is {tier.get('type')!r}); remove it"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise OffloadConfigError(
                    f"{where}['{MAX_BYTES_KEY}']={value!r} must be a positive "
                    f'integer number of bytes, e.g. "{MAX_BYTES_KEY}": '
                    f"{100 * 2**30} (100 GiB); remove it for an unbounded tier"
                )
        if is_fs:
            root = tier.get("root_dir")
            if not isinstance(root, str) or not root:
                raise OffloadConfigError(
                    f"{where} (type {tier['type']!r}) needs 'root_dir', a "
                    "directory on a file system every node mounts, e.g. "
                    '"root_dir": "/mnt/shared/kv"'
                )
            if tier.get(AUTH_KEY_FILE) is not None:
                read_auth_key(tier[AUTH_KEY_FILE], f"{where}['{AUTH_KEY_FILE}']")
            if SHARED_ID in tier:
                check_shared_id(tier[SHARED_ID], where)
        else:
            for key in (AUTH_KEY_FILE, SHARED_ID):
                if tier.get(key) is not None:
                    raise OffloadConfigError(
                        f"{where}['{key}'] is read by 'fs' tiers only (this "
                        f"one is {tier['type']!r}); remove it"
                    )


class NPUTieringOffloadingSpec(TieringOffloadingSpec, NPUOffloadingSpec):
    """Keys: the guide's (``num_cpu_blocks``, ``block_size``) or vLLM's
    (``cpu_bytes_to_use``, ``blocks_per_chunk``, ``eviction_policy``, ...),
    plus tiering's ``secondary_tiers`` and ``backpressure``. The pool is the
    region: ``num_cpu_blocks`` rows of all ranks' KV of one CPU block.
    """

    extra_config_keys = NPUOffloadingSpec.extra_config_keys | TIERING_KEYS

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        # vLLM asks the class of each tier's configured type ("fs" is vLLM's)
        # and the spec: the size bound's eviction metrics are defined here.
        metrics = super().build_metric_definitions(extra_config)
        tiers = extra_config.get("secondary_tiers") or []
        if any(t.get("type") in FS_TYPES for t in tiers):
            metrics.update(budget_metric_definitions())
        return metrics

    def __init__(self, config: OffloadingConfig):
        check_keys(config.extra_config, self.extra_config_keys)
        check_tiering_config(config.extra_config)
        # MRO: TieringOffloadingSpec -> NPUOffloadingSpec (keys, num_cpu_blocks)
        # -> CPUOffloadingSpec; then tiering reads secondary_tiers.
        super().__init__(config)
        # Our connector builds the spec inside set_current_vllm_config, so
        # the identity can see the resolved model config (None otherwise:
        # the weights are then unidentified and nothing is shared).
        self._vllm_config = get_current_vllm_config_or_none()
        self.secondary_tier_configs = copy.deepcopy(self.secondary_tier_configs)
        for tier in self.secondary_tier_configs:
            if tier.get("type") == "fs":
                tier["type"] = VERIFIED_FS_TYPE
            elif tier.get("type") != VERIFIED_FS_TYPE:
                logger.warning(
                    "KV offload: secondary tier %r runs as vLLM ships it; the "
                    "identity and checksum checks of this package cover 'fs' only",
                    tier.get("type"),
                )

    @cached_property
    def storage_identity(self) -> dict[str, Any]:
        """Read by the fs tiers only (scheduler side): the weights are
        fingerprinted once, and only where a tier needs them."""
        from vllm.platforms import current_platform

        device_type = str(current_platform.device_type)
        return storage_identity(self.config, device_type, self._vllm_config)

    @override
    def get_manager(self) -> OffloadingManager:
        if self._failure_aware_manager is None:
            self.secondary_tier_configs = [
                t
                for t in self.secondary_tier_configs
                if t["type"] != VERIFIED_FS_TYPE or tier_dir_usable(t, self)
            ]
            mark = hold_mark(self.config.engine_id)
            try:
                inner = TieringOffloadingSpec.get_manager(self)
                if mark.region_existed:
                    # vLLM builds the scheduler after every worker mapped the
                    # region: no one needs its name now (region.py).
                    mark.release_name()
            finally:
                if mark.region_existed:
                    mark.close()
            # A region this process created: workers may join later; the
            # hold ends with the manager (or the process).
            own_mark = None if mark.region_existed else mark
            self._failure_aware_manager = _TieringManager(
                inner, self.pool_capacity(), own_mark
            )
        return self._failure_aware_manager

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._npu_worker is None:  # the worker, built once (NPUOffloadingSpec's)
            self._npu_worker = build_region_worker(
                kv_caches,
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                slot_rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                slot_bytes=self.cpu_page_size_per_worker,
                blocks_per_chunk=self.blocks_per_chunk,
                copy_path=self.config.extra_config.get("copy_path") or "auto",
                shared_slot=self.replicated_layout,
                piece_bytes=int_setting(self.config.extra_config, "host_piece_bytes"),
            )
        return self._npu_worker
