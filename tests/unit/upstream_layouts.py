"""KV-cache layouts as upstream vllm-ascend 0.30.0rc2 builds them, on CPU.

A :class:`Scenario` is a model's layers, with specs built as upstream's
``get_kv_cache_spec`` builds them (tests/unit/upstream_scenarios.py), and the
runner settings that pick one of upstream's allocation paths. :func:`build`
plans the ``KVCacheConfig`` with vLLM's own planner
(``get_kv_cache_config_from_groups``, as the engine core does) and runs
upstream's ``initialize_kv_cache_tensors`` (tests/unit/upstream_runner.py) to
get the ``kv_caches`` dict upstream hands to ``register_kv_caches``
(model_runner_v1.py:4692).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config.cache import KVCacheLayout
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from tests.unit.kv_helpers import parts_of
from tests.unit.upstream_runner import HardwareProfile

NUM_BLOCKS = 6


@dataclass
class Scenario:
    """A model's KV cache layers and the upstream runner settings for it."""

    name: str
    # Per KV cache group: {layer name: (spec, layer stand-in, backend)}, the
    # backend being the name of upstream's class (upstream_runner.BACKENDS),
    # or None for Mamba layers (their reshape asks no backend).
    groups: list[dict[str, tuple[KVCacheSpec, Any, str | None]]]
    kernel_block_sizes: list[int] | None = None
    cache_dtype: str = "auto"
    use_sparse: bool = False
    use_compress: bool = False
    fa_quant: bool = False  # enable_fa_quant's answer (FP8/INT8 attention)
    contiguous_pa: bool = False  # requires_contiguous_pa_kv_cache's answer
    capabilities: frozenset[str] = frozenset()
    quant_config: Any = None
    c8_cache_dtype: torch.dtype | None = None
    # vLLM's resolved layout; the DeepSeek-V4 indexer's backend declares
    # block-outermost ones (vLLM validate_kv_cache_layout).
    layout: KVCacheLayout = KVCacheLayout.LBNHC

    @property
    def layers(self) -> dict[str, Any]:
        return {n: layer for g in self.groups for n, (_, layer, _) in g.items()}

    @property
    def specs(self) -> dict[str, KVCacheSpec]:
        return {n: spec for g in self.groups for n, (spec, _, _) in g.items()}


@dataclass
class Built:
    scenario: Scenario
    kv_cache_config: KVCacheConfig
    kv_caches: dict[str, Any]

    @property
    def group_layer_names(self) -> list[list[str]]:
        return [g.layer_names for g in self.kv_cache_config.kv_cache_groups]


def register_ascend_specs(upstream) -> None:
    """What upstream's ``register_ascend_kv_cache_specs``
    (core/kv_cache_interface.py:372) registers for the specs used here (its
    other registrations need NPU managers), so vLLM groups them."""
    for cls in (
        upstream.specs.AscendMLAAttentionSpec,
        upstream.specs.AscendSFAIndexerCacheSpec,
    ):
        try:
            KVCacheSpecRegistry.register(
                kvcache_spec_cls=cls,
                manager_class=FullAttentionManager,
                uniform_type_base_spec=FullAttentionSpec,
            )
        except AssertionError:
            pass  # registered by an earlier build in this process


def _group_spec(specs: dict[str, KVCacheSpec]) -> KVCacheSpec:
    first = next(iter(specs.values()))
    if all(s == first for s in specs.values()):
        return first
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None, f"specs of one group are not of one type: {specs}"
    return uniform


def plan(scenario: Scenario, layout: KVCacheLayout) -> KVCacheConfig:
    """vLLM's planner on the scenario's groups, for NUM_BLOCKS blocks."""
    groups = [
        KVCacheGroupSpec(list(g), _group_spec({n: s for n, (s, _, _) in g.items()}))
        for g in scenario.groups
    ]
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            num_gpu_blocks_override=NUM_BLOCKS,
            prefix_cache_retention_interval=None,
            get_resolved_kv_cache_layout=lambda: layout,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    return get_kv_cache_config_from_groups(config, groups, available_memory=1 << 40)


def runner(upstream, scenario: Scenario, kv_cache_config: KVCacheConfig):
    """An object whose KV-cache methods are upstream's NPUModelRunner's, with
    the attributes those methods read set as the runner's ``__init__`` and
    ``initialize_kv_cache`` (model_runner_v1.py:4591-4620) would set them
    for this scenario, the device being the CPU."""
    ns = upstream.ns
    layers = scenario.layers
    ns["get_layers_from_vllm_config"] = lambda _cfg, _cls, names=None: {
        n: layers[n] for n in (names or layers)
    }
    ns["enable_fa_quant"] = lambda _cfg, layer_name=None: scenario.fa_quant
    ns["requires_contiguous_pa_kv_cache"] = lambda *a: scenario.contiguous_pa
    profile = HardwareProfile(scenario.capabilities)
    ns["get_current_hardware_profile"] = lambda: profile

    # vLLM's attention groups: one per (KV cache group, backend).
    groups = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        by_backend: dict[str | None, list[str]] = {}
        for n in g.layer_names:
            by_backend.setdefault(scenario.groups[i][n][2], []).append(n)
        for backend, names in by_backend.items():
            groups.append(
                SimpleNamespace(
                    kv_cache_group_id=i,
                    layer_names=names,
                    kv_cache_spec=g.kv_cache_spec,
                    backend=upstream.backends.get(backend),
                )
            )
    run = upstream.runner_methods()
    run.device = torch.device("cpu")
    model_config = SimpleNamespace(
        hf_text_config=SimpleNamespace(model_type=scenario.name),
        use_mla=any(hasattr(layer, "kv_lora_rank") for layer in layers.values()),
        dtype=torch.bfloat16,
    )
    run.model_config = model_config
    run.vllm_config = SimpleNamespace(
        # Any KV connector: upstream then 2 MiB-aligns every allocation.
        kv_transfer_config=SimpleNamespace(kv_connector="OffloadingConnector"),
        cache_config=SimpleNamespace(
            cache_dtype=scenario.cache_dtype,
            get_resolved_kv_cache_layout=lambda: scenario.layout,
        ),
        quant_config=scenario.quant_config,
        model_config=model_config,
    )
    run.ascend_config = SimpleNamespace(
        kvpp_config=SimpleNamespace(size=1),
        xlite_graph_config=SimpleNamespace(enabled=False),
    )
    run.compilation_config = SimpleNamespace(static_forward_context=dict(layers))
    run.kv_cache_config = kv_cache_config
    run._kv_cache_spec_attn_group_iterator = lambda: iter(groups)
    run.use_dcp = False
    run.use_sparse = scenario.use_sparse
    run.use_compress = scenario.use_compress
    run.sparse_kv_offload_enabled = False
    run.use_hybrid_blocks = len(groups) > 1  # initialize_kv_cache, :4613
    run.runner_only_attn_layers = set()
    run.shared_kv_cache_layers = {}
    run.kv_caches = []
    run.tp_rank = 0
    run.c8_cache_dtype = scenario.c8_cache_dtype
    return run


def build(upstream, scenario: Scenario, seed: int = 0) -> Built:
    """Upstream's KV caches for ``scenario``, every byte random."""
    register_ascend_specs(upstream)
    kv_cache_config = plan(scenario, scenario.layout)
    run = runner(upstream, scenario, kv_cache_config)
    kv_caches = run.initialize_kv_cache_tensors(
        kv_cache_config, kernel_block_sizes=scenario.kernel_block_sizes
    )
    gen = torch.Generator().manual_seed(seed)
    for storage in {s.data_ptr(): s for s in _storages(kv_caches)}.values():
        raw = torch.tensor([], dtype=torch.uint8).set_(storage)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return Built(scenario, kv_cache_config, kv_caches)


def _storages(kv_caches):
    for cache in kv_caches.values():
        for part in parts_of(cache):
            yield part.untyped_storage()
