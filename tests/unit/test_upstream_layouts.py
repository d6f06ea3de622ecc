"""Every KV-cache layout upstream vllm-ascend 0.30.0rc2 builds is offloaded
byte for byte, or refused at start-up by name.

The KV caches here are made by upstream's own allocation and view code
(``_allocate_kv_cache_tensors``, ``_allocate_sparse_c8_indexer_tensors``,
``_reshape_kv_cache_tensors``, ``mxfp_cache_views_for_spec``, called through
``initialize_kv_cache_tensors``) run on CPU from the sdist's source
(tests/unit/upstream_runner.py lists what stands in for the NPU and why;
tests/unit/upstream_layouts.py builds each layout's specs as upstream does).
Each layout is registered with the real connector, stored from the device
to CPU blocks through the real worker and copy op, the device overwritten,
loaded back, and compared part by part, scales included.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.unit.conftest import make_connector
from tests.unit.kv_helpers import make_worker, parts_of, running
from tests.unit.upstream_layouts import build, scenarios
from tests.unit.upstream_runner import REPLACEMENTS, RUNNER, RUNNER_METHODS
from vllm_ascend.kv_offload.kv_layout import canonicalize

NUM_CPU_BLOCKS = 8
POISON = 0x5A
# Device blocks each KV cache group stores and loads (a block id belongs to
# one group at a time), and the CPU blocks they go to.
DEVICE_BLOCKS = [[1, 3, 4], [5]]
CPU_BLOCKS = [[6, 2, 7], [0]]

LAYOUTS = [
    "bf16 (k, v)",
    "bf16 (k, v) interleaved in one allocation",
    "C8 INT8 dense (k, v)",
    "MLA (nope, rope)",
    "MLA C8 (int8 nope, bf16 rope)",
    "C8-MXFP (k, v, k_scale, v_scale)",
    "C8-MXFP, 1024-token blocks over 512-token kernel blocks",
    "DSA: MLA (nope, rope) + indexer C8 (k, scale)",
    "sparse-SFA C8 packed latent + indexer C8 (k, scale)",
    "hybrid attention + Mamba",
    "DSV4 indexer: (k, scale) + overlapping full-page view",
]


def test_every_layout_listed_here_is_one_upstream_builds(upstream):
    assert sorted(LAYOUTS) == sorted(scenarios(upstream))


def test_every_replacement_stands_for_a_name_upstreams_runner_code_reads(upstream):
    """REPLACEMENTS lists what runs instead of NPU-only upstream code; each
    entry is a name the cut-out runner methods really read."""
    read = set()
    for method in RUNNER_METHODS:
        code = getattr(upstream.runner_methods, method).__code__
        read |= set(code.co_names) | {
            name
            for c in code.co_consts
            if hasattr(c, "co_names")
            for name in c.co_names
        }
    for name in REPLACEMENTS:
        assert name.removeprefix("self.") in read, f"{RUNNER} does not read {name}"


@pytest.fixture(params=LAYOUTS)
def layout(request, upstream):
    return build(upstream, scenarios(upstream)[request.param])


def block_size(built) -> int:
    return built.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size


def blocks_of(part: torch.Tensor, num_blocks: int, ids: list[int]) -> torch.Tensor:
    """The bytes of manager blocks ``ids`` of one cache part."""
    return part.unflatten(0, (num_blocks, -1))[ids].view(torch.uint8)


def round_trip(worker, built) -> list[str]:
    """Stores each group's DEVICE_BLOCKS, overwrites every byte of the
    device caches, loads the blocks back; returns the parts (``layer[i]``)
    whose bytes in those blocks differ from before the store."""
    groups = built.group_layer_names
    n = built.kv_cache_config.num_blocks
    expected = {}
    for layers, ids in zip(groups, DEVICE_BLOCKS, strict=False):
        for layer in layers:
            for i, part in enumerate(parts_of(built.kv_caches[layer])):
                expected[f"{layer}[{i}]"] = (part, ids, blocks_of(part, n, ids).clone())
    device = GPULoadStoreSpec(
        [b for ids in DEVICE_BLOCKS[: len(groups)] for b in ids],
        [len(ids) for ids in DEVICE_BLOCKS[: len(groups)]],
        [0] * len(groups),
    )
    cpu = CPULoadStoreSpec([b for ids in CPU_BLOCKS[: len(groups)] for b in ids])
    assert worker.submit_store(1, device, cpu)
    worker.wait({1})
    for part, _, _ in expected.values():
        torch.tensor([], dtype=torch.uint8).set_(part.untyped_storage()).fill_(POISON)
    assert worker.submit_load(2, cpu, device)
    worker.wait({2})
    assert all(r.success for r in worker.get_finished())
    return [
        name
        for name, (part, ids, before) in expected.items()
        if not torch.equal(blocks_of(part, n, ids), before)
    ]


def spec_bytes_per_block(built) -> int:
    """Device bytes of one block by vLLM's KV cache spec: each group's layer
    pages side by side, groups overlaying each other (vLLM's hybrid
    allocation: a block id belongs to one group at a time)."""
    config = built.kv_cache_config
    specs = built.scenario.specs
    return max(
        sum(specs[n].page_size_bytes for n in g.layer_names)
        for g in config.kv_cache_groups
    )


def test_is_registered_with_the_spec_bytes_and_every_part_survives_a_round_trip(
    layout,
):
    """Through the real connector's worker side (vLLM's connector worker: its
    spec and our worker), one device block per CPU block."""
    side = make_connector(
        "worker",
        extra={
            "num_cpu_blocks": NUM_CPU_BLOCKS,
            "block_size": block_size(layout),
            "spec_name": "FaultInjectingOffloadingSpec",
            "spec_module_path": "tests.fault_injection",
        },
        kv_cache_config=layout.kv_cache_config,
        kv_caches=layout.kv_caches,
    ).connector_worker
    with running(side.worker):
        spec_bytes = spec_bytes_per_block(layout)
        assert side.worker.pool.row_bytes == spec_bytes
        # vLLM's own figure from the KVCacheConfig, which sizes the pool.
        assert side.spec.config.worker_kv_bytes_per_block == spec_bytes
        assert round_trip(side.worker, layout) == []


# HF configs of the layouts sizing.py can size (dense and MLA attention; it
# knows no scale tensors, Ascend indexers or mixed-dtype MLA), each a model
# vLLM's ModelConfig knows, with the --kv-cache-dtype each was built with.
GQA = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MLA = {
    "model_type": "deepseek_v2",
    "architectures": ["DeepseekV2ForCausalLM"],
    "num_attention_heads": 4,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
}
SIZABLE = {
    "bf16 (k, v)": (GQA, "auto"),
    "bf16 (k, v) interleaved in one allocation": (GQA, "auto"),
    "C8 INT8 dense (k, v)": (GQA, "int8"),
    "MLA (nope, rope)": (MLA, "auto"),
}


@pytest.mark.parametrize("name", SIZABLE)
def test_sizing_gives_the_bytes_per_cpu_block_the_pool_holds(upstream, name, size_kv):
    built = build(upstream, scenarios(upstream)[name])
    model, kv_cache_dtype = SIZABLE[name]
    sizing = size_kv(
        {**model, "num_hidden_layers": 2, "head_dim": 64, "torch_dtype": "bfloat16"},
        block_size=block_size(built),
        device_block_size=block_size(built),
        kv_cache_dtype=kv_cache_dtype,
    )
    # = the pool's bytes per CPU block (the round-trip test above)
    assert sizing.worker_bytes_per_cpu_block == spec_bytes_per_block(built)


def without_tensor(canonical: CanonicalKVCaches, drop: int) -> CanonicalKVCaches:
    """``canonical`` with one of its tensors (a part, or a page shared by
    several) left out, as a canonicaliser that forgot it would produce; if it
    is the only one, with its last byte left out instead."""
    if len(canonical.tensors) == 1:
        return CanonicalKVCaches(
            tensors=canonical.tensors,
            group_data_refs=[
                [CanonicalKVCacheRef(r.tensor_idx, r.page_size_bytes - 1) for r in refs]
                for refs in canonical.group_data_refs
            ],
        )
    keep = [i for i in range(len(canonical.tensors)) if i != drop]
    new_index = {old: new for new, old in enumerate(keep)}
    return CanonicalKVCaches(
        tensors=[canonical.tensors[i] for i in keep],
        group_data_refs=[
            [
                CanonicalKVCacheRef(new_index[r.tensor_idx], r.page_size_bytes)
                for r in refs
                if r.tensor_idx != drop
            ]
            for refs in canonical.group_data_refs
        ],
    )


def test_the_round_trip_check_catches_a_part_left_out(layout):
    """The byte comparison above would fail if canonicalisation dropped any
    one part: each canonical tensor left out in turn breaks the round trip."""
    canonical = canonicalize(
        layout.kv_caches, layout.group_layer_names, layout.kv_cache_config.num_blocks
    )
    for drop in range(len(canonical.tensors)):
        worker = make_worker(without_tensor(canonical, drop), 1, NUM_CPU_BLOCKS)
        with running(worker):
            assert round_trip(worker, layout) != [], f"tensor {drop} left out"
