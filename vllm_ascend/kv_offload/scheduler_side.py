"""The connector's scheduler-side additions to vLLM's ``OffloadingConnector``.

``connector.AscendOffloadingConnector`` calls these from vLLM's scheduler
hooks, around vLLM's own code:

* failed transfers: the manager told (``failures.FailureRouter``), and the
  device blocks of a sync load kept out of reach of other requests until it
  is known to have succeeded (``failures.SyncLoadQuarantine``);
* a bounded wait for CPU hits (``load_wait.LoadWaitBound``,
  ``max_load_wait_ratio``): fed with the figures the workers report, the
  manager recomputes a hit that would wait longer than recomputing it.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from vllm_ascend.kv_offload.config import float_setting
from vllm_ascend.kv_offload.failures import FailureRouter, SyncLoadQuarantine
from vllm_ascend.kv_offload.load_wait import LoadWaitBound
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.manager import FailureAwareManager

logger = init_logger(__name__)

# max_load_wait_ratio when not set: a CPU hit waits at most as long as
# recomputing its tokens would take (docs/user_guide.md).
DEFAULT_MAX_LOAD_WAIT_RATIO = 1.0


class SchedulerSide:
    """Failure routing, the sync-load quarantine and the hits' wait bound."""

    def __init__(
        self,
        manager: Any,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        quarantine_group: int | None,
        worker_bytes_per_token: float,
    ):
        """``manager``: vLLM's connector scheduler's (ours, the spec's
        ``FailureAwareManager``). ``quarantine_group``: the offloaded group
        whose sync loads are quarantined (None: failed sync loads cannot be
        reported by block, so there are none: ``connector.py``).
        ``worker_bytes_per_token``: what a load of one token copies on one
        worker."""
        if not isinstance(manager, FailureAwareManager):
            raise TypeError(
                "AscendOffloadingConnector needs NPUOffloadingSpec's manager "
                f"(FailureAwareManager), got {type(manager).__name__}"
            )
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        self._quarantine: SyncLoadQuarantine | None = None
        if quarantine_group is not None:
            group = kv_cache_config.kv_cache_groups[quarantine_group]
            self._quarantine = SyncLoadQuarantine(
                group.kv_cache_spec.block_size, group_idx=quarantine_group
            )
        self._failure_router = FailureRouter(
            manager, vllm_config.parallel_config.world_size, self._quarantine
        )
        extra = transfer_config.kv_connector_extra_config
        ratio = float_setting(extra, "max_load_wait_ratio")
        ratio = DEFAULT_MAX_LOAD_WAIT_RATIO if ratio is None else ratio
        self._wait_bound: LoadWaitBound | None = None
        if ratio > 0:
            self._wait_bound = LoadWaitBound(ratio, worker_bytes_per_token)
        manager.wait_bound = self._wait_bound
        policy = getattr(transfer_config, "kv_load_failure_policy", "fail")
        if policy != "recompute":
            logger.info(
                "KV offload: kv_load_failure_policy=%r: a request whose "
                "CPU->device load fails will fail; 'recompute' recomputes "
                "its blocks instead",
                policy,
            )

    def bind(self, kv_cache_manager: Any) -> None:
        """vLLM's device KV cache manager, once the scheduler has one."""
        if self._quarantine is not None:
            self._quarantine.bind(kv_cache_manager)

    def must_wait(self, request: Request) -> bool:
        """Not yet while its prefix is in device blocks a sync load is filling."""
        return self._quarantine is not None and self._quarantine.must_wait(request)

    def begin_lookup(self, request: Request, num_computed_tokens: int) -> None:
        """Before vLLM looks ``request`` up in the CPU pool."""
        if self._wait_bound is not None:
            self._wait_bound.begin_lookup(
                request.request_id, num_computed_tokens, request.num_prompt_tokens
            )

    def end_lookup(
        self,
        request: Request,
        num_computed_tokens: int,
        result: tuple[int | None, bool],
    ) -> None:
        """What vLLM's lookup of ``request`` answered."""
        if self._quarantine is not None:
            self._quarantine.on_lookup(request, num_computed_tokens, result)

    def on_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        """vLLM allocated ``request``'s device blocks (``blocks``)."""
        if self._quarantine is not None:
            self._quarantine.on_alloc(request, blocks, num_external_tokens)

    def on_metadata(self, meta: OffloadingConnectorMetadata) -> None:
        """The step's jobs, as vLLM's connector hands them to the workers."""
        self._failure_router.expect(meta)

    def on_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' output; before vLLM completes the jobs: complete_store
        must already know that a failed store's keys hold nothing."""
        self._failure_router.invalidate_blocks(connector_output.invalid_block_ids)
        self._failure_router.route(connector_output.kv_connector_worker_meta)
        if self._wait_bound is not None:
            self._wait_bound.observe(connector_output.kv_connector_worker_meta)
