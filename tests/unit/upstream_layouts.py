"""KV-cache layouts as upstream vllm-ascend 0.30.0rc2 builds them, on CPU.

A :class:`Scenario` is a model's layers, with specs built with the arguments
upstream's ``get_kv_cache_spec`` (model_runner_v1.py:6144) passes (line cited
per layout in :func:`scenarios`), and the runner settings that pick one of
upstream's allocation paths. :func:`build` plans the ``KVCacheConfig`` with
vLLM's own planner (``get_kv_cache_config_from_groups``, as the engine core
does) and runs upstream's ``initialize_kv_cache_tensors``
(tests/unit/upstream_runner.py) to get the ``kv_caches`` dict upstream hands
to ``register_kv_caches`` (model_runner_v1.py:4692).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    MambaSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from tests.unit.kv_helpers import parts_of
from tests.unit.upstream_runner import C8MXFPImpl, Layer, MLALayer

NUM_BLOCKS = 6


@dataclass
class Scenario:
    """A model's KV cache layers and the upstream runner settings for it."""

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


ATTN = "AscendAttentionBackend"
MLA = "AscendMLABackend"
SFA = "AscendSFABackend"
INDEXER = "AscendSFAIndexerBackend"


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _indexer(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


def _mla_layer() -> MLALayer:
    return MLALayer(kv_lora_rank=512, qk_rope_head_dim=64)


def _layers(spec, backend, stand_in=Layer, name=_attn, ids=range(2)) -> dict:
    """Layers ``name(i)`` for each i in ``ids``: ``spec``, a fresh
    ``stand_in()`` and ``backend`` each."""
    return {name(i): (spec, stand_in(), backend) for i in ids}


def scenarios(upstream) -> dict[str, Scenario]:
    """Every layout covered, by name. Specs are built with the arguments
    upstream's get_kv_cache_spec passes (model_runner_v1.py line cited)."""
    ns, specs = upstream.ns, upstream.specs
    bf16 = torch.bfloat16
    # vLLM's Attention.get_kv_cache_spec, kept as is (:6183-6186).
    dense = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=bf16)
    # AscendMLAAttentionSpec from vLLM's MLA spec (:6237-6268): head_size is
    # kv_lora_rank + qk_rope_head_dim = 512 + 64.
    mla = specs.AscendMLAAttentionSpec(
        block_size=128, num_kv_heads=1, head_size=576, dtype=bf16
    )
    # DeepSeek-V3.2 indexer with indexer_kv_dtype=int8 (:6270-6300, dtypes
    # of :469-476): int8 K, one fp16 scale per token.
    indexer_c8 = specs.AscendSFAIndexerCacheSpec(
        block_size=128,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.int8,
        cache_dtype_str="int8",
        scale_dim=1,
        scale_dtype=torch.float16,
        cache_sparse_li_c8=True,
    )
    indexers_c8 = lambda: _layers(indexer_c8, INDEXER, name=_indexer)  # noqa: E731
    kv_quant = upstream.kv_quant()
    kv_quant.enable_fa_quant = True  # a ModelSlim C8 checkpoint's setting
    kv_quant.kvcache_quant_layers = {0, 1}

    def mxfp_layers(block_size: int):
        # mxfp_cache_spec of vLLM's spec (:6185).
        spec = ns["mxfp_cache_spec"](
            FullAttentionSpec(
                block_size=block_size, num_kv_heads=2, head_size=128, dtype=bf16
            )
        )
        # Each layer's checkpoint's static V scales: one E8M0 byte per KV channel.
        scales = lambda: torch.randint(0, 256, (2 * 128,), dtype=torch.uint8)  # noqa: E731
        return _layers(spec, ATTN, lambda: Layer(C8MXFPImpl(), v_cache_scale=scales()))

    # :6207-6235: one int8 row of latent, bf16 rope and fp32 tile scales
    # (get_sfa_qsfa_packed_head_dim).
    sfa_c8 = replace(
        mla,
        head_size=ns["get_sfa_qsfa_packed_head_dim"](512, 64),
        dtype=torch.int8,
        cache_dtype_str="int8",
        cache_sparse_sfa_c8=True,
    )
    # Padded to the attention page, as vLLM unifies hybrid page sizes.
    mamba = MambaSpec(
        block_size=64,
        shapes=((3, 256), (4, 32, 32)),
        dtypes=(bf16, torch.float32),
        page_size_padded=replace(dense, block_size=64).page_size_bytes,
    )
    # _reshape_kv_cache_tensors, :5520-5535: with DSV4_COMPRESSED_CACHE the
    # layer also gets a full view of the same page bytes (overlap_full_kv_cache).
    dsv4 = specs.AscendMLAAttentionSpec(
        block_size=128,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.int8,
        scale_dim=4,
        scale_dtype=torch.float32,
        tokens_per_state=4,
        model_version="deepseek_v4",
    )
    return {
        # paged-attention layers: K and V apart
        "bf16 (k, v)": Scenario([_layers(dense, ATTN)], contiguous_pa=True),
        "bf16 (k, v) interleaved in one allocation": Scenario([_layers(dense, ATTN)]),
        # kv_c8.py:125 sets the layer's cache dtype to int8; its scales are
        # per-layer weights (kv_c8.py:132-139), not cache.
        "C8 INT8 dense (k, v)": Scenario(
            [_layers(replace(dense, dtype=torch.int8), ATTN)], cache_dtype="int8"
        ),
        "MLA (nope, rope)": Scenario([_layers(mla, MLA, _mla_layer)]),
        # fa_quant layer (:6238-6239): head_size = 576 + 64, int8.
        "MLA C8 (int8 nope, bf16 rope)": Scenario(
            [_layers(replace(mla, head_size=640, dtype=torch.int8), MLA, _mla_layer)],
            cache_dtype="int8",
            fa_quant=True,
            quant_config=kv_quant,
        ),
        # 512-token kernel blocks: the C8-MXFP backend's only size
        # (attention_c8_mxfp.py:397-399).
        "C8-MXFP (k, v, k_scale, v_scale)": Scenario(
            [mxfp_layers(512)], kernel_block_sizes=[512], cache_dtype="mxfp8"
        ),
        # A larger scheduler block spans several kernel packets
        # (mxfp_cache_views_for_spec, attention_c8_mxfp.py:236-252).
        "C8-MXFP, 1024-token blocks over 512-token kernel blocks": Scenario(
            [mxfp_layers(1024)], kernel_block_sizes=[512], cache_dtype="mxfp8"
        ),
        "DSA: MLA (nope, rope) + indexer C8 (k, scale)": Scenario(
            [{**_layers(mla, SFA, _mla_layer), **indexers_c8()}], use_sparse=True
        ),
        "sparse-SFA C8 packed latent + indexer C8 (k, scale)": Scenario(
            [{**_layers(sfa_c8, SFA, _mla_layer), **indexers_c8()}],
            use_sparse=True,
            cache_dtype="int8",
            c8_cache_dtype=torch.int8,
        ),
        "hybrid attention + Mamba": Scenario(
            [
                _layers(replace(dense, block_size=64), ATTN, ids=(1, 3)),
                _layers(
                    mamba, None, name="model.layers.{}.linear_attn".format, ids=(0, 2)
                ),
            ]
        ),
        "DSV4 indexer: (k, scale) + overlapping full-page view": Scenario(
            [_layers(dsv4, MLA, name=_indexer, ids=range(1))],
            layout=KVCacheLayout.BLHNC,
            use_compress=True,
            capabilities=frozenset({"DSV4_COMPRESSED_CACHE"}),
        ),
    }


def register_ascend_specs(upstream) -> None:
    """What upstream's ``register_ascend_kv_cache_specs``
    (core/kv_cache_interface.py:372) registers for the specs used here (its
    other registrations need NPU managers), so vLLM groups them. vLLM's own
    specs first, as its engine core registers them at start: vLLM registers
    its own only into an empty registry, and a later connector in this
    process would find no manager for a plain FullAttentionSpec."""
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager
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
    assert scenario.capabilities <= ns["HardwareCapability"].__members__.keys()
    profile = SimpleNamespace(supports=lambda c: c.name in scenario.capabilities)
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
        # None of the model types upstream's code singles out (deepseek_v4, ...).
        hf_text_config=SimpleNamespace(model_type="upstream_layouts"),
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
    storages = [p.untyped_storage() for c in kv_caches.values() for p in parts_of(c)]
    for storage in {s.data_ptr(): s for s in storages}.values():
        raw = torch.tensor([], dtype=torch.uint8).set_(storage)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return Built(scenario, kv_cache_config, kv_caches)
