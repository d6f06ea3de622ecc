"""Ascend KV-cache layouts survive store -> overwrite -> load byte for byte.

Synthetic caches in the shapes and dtypes vllm-ascend allocates: (K, V)
tuples, MLA (nope, rope) tuples with different widths, Mamba state lists,
2 MiB-aligned allocations and several KV cache groups.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.unit.kv_helpers import make_worker, parts_of, running
from vllm_ascend.kv_offload.kv_layout import KVLayoutError, block_view, canonicalize

NUM_BLOCKS = 6
BLOCK = 128
ALIGN = 2 << 20


def aligned_randn(shape, dtype, gen) -> torch.Tensor:
    """A tensor whose data starts on a 2 MiB boundary inside a larger buffer,
    as vllm-ascend allocates caches when a KV connector is configured."""
    numel = torch.Size(shape).numel()
    elem = torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(numel * elem + ALIGN, dtype=torch.int8)
    offset = (-raw.data_ptr()) % ALIGN
    data = raw[offset : offset + numel * elem].view(dtype).view(shape)
    data.copy_(torch.randn(shape, generator=gen).to(dtype))
    return data


def pair_layers(n, shapes=((2, 64), (2, 64)), kind="attn", seed=0):
    """``n`` layers of two bf16 parts each, of ``shapes`` per block (default:
    K and V of 2 heads of 64)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.{kind}": tuple(
            aligned_randn((NUM_BLOCKS, BLOCK, *s), torch.bfloat16, gen) for s in shapes
        )
        for i in range(n)
    }


def all_parts(kv_caches):
    for cache in kv_caches.values():
        yield from parts_of(cache)


def round_trip(kv_caches, groups, bpc, group_sizes, block_indices):
    """Store each group's blocks, poison them on the device, load them back."""
    canonical = canonicalize(kv_caches, groups, NUM_BLOCKS)
    before = [p.clone() for p in all_parts(kv_caches)]
    dev_blocks, cpu_blocks, per_group, next_cpu = [], [], [], 7
    for g, (n, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
        per_group.append([(5 - g - k) % NUM_BLOCKS for k in range(n)])
        dev_blocks += per_group[-1]
        n_cpu = -(-(first % bpc + n) // bpc)
        cpu_blocks += list(range(next_cpu, next_cpu - n_cpu, -1))
        next_cpu -= n_cpu
    spec = GPULoadStoreSpec(dev_blocks, group_sizes, block_indices)
    with running(make_worker(canonical, bpc, 8)) as worker:
        worker.submit_store(1, spec, CPULoadStoreSpec(cpu_blocks))
        worker.wait({1})
        for layers, blocks in zip(groups, per_group, strict=True):
            for layer in layers:
                for part in parts_of(kv_caches[layer]):
                    part.view(torch.int8)[blocks] = 0x7F
        worker.submit_load(2, CPULoadStoreSpec(cpu_blocks), spec)
        worker.wait({2})
        assert all(r.success for r in worker.get_finished())
        for part, expected in zip(all_parts(kv_caches), before, strict=True):
            assert torch.equal(part.view(torch.int8), expected.view(torch.int8))
    return canonical


@pytest.mark.parametrize("bpc, first", [(1, 0), (2, 0), (4, 3)])
def test_28_layers_of_bf16_k_v_tuples(bpc, first):
    kv = pair_layers(28, [(8, 128)] * 2)
    canonical = round_trip(kv, [list(kv)], bpc, [4], [first])
    # K and V of every layer are separate parts of 128 x 8 x 128 bf16.
    assert len(canonical.tensors) == 56
    assert {t.page_size_bytes for t in canonical.tensors} == {BLOCK * 8 * 128 * 2}


@pytest.mark.parametrize("bpc, first", [(1, 0), (2, 1)])
def test_61_mla_layers_with_different_nope_and_rope_widths(bpc, first):
    kv = pair_layers(61, [(1, 512), (1, 64)], "mla", seed=1)
    canonical = round_trip(kv, [list(kv)], bpc, [3], [first])
    pages = [t.page_size_bytes for t in canonical.tensors]
    assert pages[:2] == [BLOCK * 512 * 2, BLOCK * 64 * 2]
    assert len(pages) == 122


def test_two_groups_with_different_block_counts_and_a_mamba_state():
    kv = pair_layers(2)
    gen = torch.Generator().manual_seed(2)
    kv["layers.9.mamba"] = [
        aligned_randn((NUM_BLOCKS, 3, 1024), torch.bfloat16, gen),
        aligned_randn((NUM_BLOCKS, 16, 64, 16), torch.float32, gen),
    ]
    groups = [["layers.0.attn", "layers.1.attn"], ["layers.9.mamba"]]
    # The attention group moves 4 blocks starting mid-CPU-block, the Mamba
    # group 1 block.
    round_trip(kv, groups, bpc=2, group_sizes=[4, 1], block_indices=[3, 2])


def test_layers_sharing_one_cache_are_transferred_once():
    kv = pair_layers(2)
    kv["layers.1.attn"] = kv["layers.0.attn"]
    canonical = canonicalize(kv, [list(kv)], NUM_BLOCKS)
    assert len(canonical.tensors) == 2
    assert [r.tensor_idx for r in canonical.group_data_refs[0]] == [0, 1, 0, 1]


def test_views_share_memory_with_the_device_cache():
    k, _ = pair_layers(1)["layers.0.attn"]
    view = block_view(k, NUM_BLOCKS, "k")
    assert view.data_ptr() == k.data_ptr()
    assert view.shape == (NUM_BLOCKS, BLOCK * 2 * 64 * 2)
    view[3].fill_(1)
    assert torch.all(k[3].view(torch.int8) == 1)


def test_kernel_blocks_inside_a_manager_block_form_one_page():
    # Dim 0 counts 4 kernel blocks of 32 tokens per manager block.
    part = torch.randn(NUM_BLOCKS * 4, 32, 2, 64)
    view = block_view(part, NUM_BLOCKS, "k")
    assert view.shape == (NUM_BLOCKS, 4 * 32 * 2 * 64 * 4)


def test_a_layout_not_contiguous_within_a_block_is_rejected_by_name():
    # Heads before tokens through a permuted view: a block is not one run.
    base = torch.randn(NUM_BLOCKS, 2, BLOCK, 64)
    permuted = base.permute(0, 2, 1, 3)
    with pytest.raises(KVLayoutError, match=r"layers\.3\.attn\[1\].*not contiguous"):
        canonicalize(
            {"layers.3.attn": (base, permuted)}, [["layers.3.attn"]], NUM_BLOCKS
        )


def test_a_part_without_a_block_dimension_is_rejected():
    with pytest.raises(KVLayoutError, match="multiple of 6 blocks"):
        block_view(torch.randn(5, 4), NUM_BLOCKS, "layers.0.attn[0]")


# -- what canonicalize refuses ------------------------------------------------


# bf16 K (or V) of one block of 2 heads of 64.
KV_PAGE = BLOCK * 2 * 64 * 2


def test_parts_must_add_up_to_the_page_of_vllms_kv_cache_spec():
    kv = pair_layers(1)
    page = 2 * KV_PAGE  # K and V
    ok = canonicalize(kv, [list(kv)], NUM_BLOCKS, {"layers.0.attn": (page, page)})
    assert len(ok.tensors) == 2
    # A spec page between unpadded and padded size is fine too.
    canonicalize(kv, [list(kv)], NUM_BLOCKS, {"layers.0.attn": (page, 2 * page)})
    with pytest.raises(KVLayoutError, match=rf"layers\.0\.attn .* says {page + 4096};"):
        canonicalize(
            kv, [list(kv)], NUM_BLOCKS, {"layers.0.attn": (page + 4096, page + 4096)}
        )


def test_interleaved_k_and_v_of_one_allocation_are_two_disjoint_views():
    base = torch.randn(NUM_BLOCKS, 2, BLOCK, 64)  # per block: K then V
    canonical = canonicalize(
        {"layers.0.attn": (base[:, 0], base[:, 1])}, [["layers.0.attn"]], NUM_BLOCKS
    )
    assert len(canonical.tensors) == 2


def test_views_that_overlap_without_being_the_same_are_refused_by_name():
    page = KV_PAGE
    buf = torch.zeros((NUM_BLOCKS + 1) * page, dtype=torch.int8)
    layer0 = buf[: NUM_BLOCKS * page].view(NUM_BLOCKS, page)
    # Layer 1 starts half a block into layer 0: every block straddles two.
    layer1 = buf[page // 2 : page // 2 + NUM_BLOCKS * page].view(NUM_BLOCKS, page)
    kv = {"layers.0.attn": (layer0,), "layers.1.attn": (layer1,)}
    with pytest.raises(
        KVLayoutError, match=r"layers\.0\.attn\[0\] and layers\.1\.attn\[0\] overlap"
    ):
        canonicalize(kv, [list(kv)], NUM_BLOCKS)


# -- overlapping views that upstream vllm-ascend builds -----------------------


def components_and_full_view(page=4096, split=3072):
    """One allocation viewed as K (first ``split`` bytes of each page), its
    scales (the rest) and the whole page, as upstream's DeepSeek-V4 indexer
    hands them over."""
    raw = torch.randint(-128, 128, (NUM_BLOCKS, page), dtype=torch.int8)
    return raw[:, :split], raw[:, split:], raw


def test_a_full_page_view_beside_its_components_is_copied_alone():
    k, scale, full = components_and_full_view()
    kv = {"layers.0.indexer": (k, scale, full)}
    canonical = canonicalize(
        kv, [list(kv)], NUM_BLOCKS, {"layers.0.indexer": (4096, 4096)}
    )
    assert [t.page_size_bytes for t in canonical.tensors] == [4096]
    assert canonical.tensors[0].tensor.data_ptr() == full.data_ptr()


def test_a_view_covering_only_some_of_the_components_is_still_refused():
    k, scale, full = components_and_full_view()
    partial = full[:, 1024:]  # holds the scales and part of K
    with pytest.raises(KVLayoutError, match=r"layers\.0\.indexer\[\d\] and .* overlap"):
        canonicalize(
            {"layers.0.indexer": (k, scale, partial)},
            [["layers.0.indexer"]],
            NUM_BLOCKS,
        )


def overlaid_groups(page=4096, conv=1024, shift=0):
    """A hybrid model's two groups over one allocation, as vLLM's planner
    and upstream's runner lay them out: an attention layer's K and V and a
    Mamba layer's conv and SSM states, both in each page of the same slot."""
    raw = torch.randint(-128, 128, ((NUM_BLOCKS + 1) * page,), dtype=torch.int8)
    pages = raw[shift : shift + NUM_BLOCKS * page].view(NUM_BLOCKS, page)
    base = raw[: NUM_BLOCKS * page].view(NUM_BLOCKS, page)
    attn = (base[:, : page // 2], base[:, page // 2 :])
    mamba = [pages[:, :conv], pages[:, conv : page // 2]]
    return {"layers.1.attn": attn, "layers.0.mamba": mamba}


def test_groups_that_overlay_the_same_pages_copy_one_page_each_its_own_prefix():
    kv = overlaid_groups()
    groups = [["layers.1.attn"], ["layers.0.mamba"]]
    canonical = canonicalize(kv, groups, NUM_BLOCKS)
    assert [t.page_size_bytes for t in canonical.tensors] == [4096]
    # Attention copies its whole page, Mamba the 2048 bytes holding its states.
    assert [
        [r.page_size_bytes for r in refs] for refs in canonical.group_data_refs
    ] == [[4096, 4096], [2048, 2048]]
    # A block id belongs to one group at a time: here 5 to attention, 4 to Mamba.
    round_trip(kv, groups, bpc=1, group_sizes=[1, 1], block_indices=[0, 0])


def test_groups_that_overlay_pages_with_a_shift_are_refused_by_name():
    kv = overlaid_groups(shift=3072)  # Mamba's block b reaches into page b + 1
    with pytest.raises(
        KVLayoutError,
        match=r"layers\.1\.attn\[0\] and layers\.0\.mamba\[0\] of different KV cache "
        r"groups overlap in memory, but not page for page",
    ):
        canonicalize(kv, [["layers.1.attn"], ["layers.0.mamba"]], NUM_BLOCKS)


def packets(kernel_blocks_per_block=2, sections=(3072, 512, 1024)):
    """Parts of one allocation of packets [a | b | c], several packets per
    block (as C8-MXFP's [K | K scale | V | V scale] kernel packets inside a
    larger scheduler block): each part is one run per packet."""
    pitch = sum(sections)
    shape = (NUM_BLOCKS, kernel_blocks_per_block, pitch)
    raw = torch.randint(-128, 128, shape).to(torch.int8)
    starts = [sum(sections[:i]) for i in range(len(sections))]
    return [raw[:, :, s : s + n] for s, n in zip(starts, sections, strict=True)]


def test_parts_that_tile_each_block_together_are_copied_as_that_block():
    parts = packets()
    kv = {"layers.0.attn": parts}
    page = 2 * 4608
    canonical = round_trip(
        kv, [["layers.0.attn"]], bpc=2, group_sizes=[3], block_indices=[1]
    )
    assert [t.page_size_bytes for t in canonical.tensors] == [page]
    canonicalize(kv, [list(kv)], NUM_BLOCKS, {"layers.0.attn": (page, page)})


def test_parts_that_leave_a_gap_in_each_block_are_refused_by_name():
    a, _, c = packets()  # the middle section of every packet is nobody's
    with pytest.raises(KVLayoutError, match=r"layers\.0\.attn\[0\] .* not contiguous"):
        canonicalize({"layers.0.attn": (a, c)}, [["layers.0.attn"]], NUM_BLOCKS)
