"""MLA under tensor parallelism with the guide's spec, end to end on vLLM's
CPU backend: a tiny DeepSeek-V2-style model (testing/tiny_model.py) at
``tensor_parallel_size=2``. Both workers hold the same latent; vLLM flags
the layout as replicated, and the two workers share one copy in a
``/dev/shm`` region that rank 0 writes and both load from.

What is compared: on vLLM's AMX MLA backend (the CPU MLA backend that keeps
prefix caching on; its reference backend turns it off, and with it
offloading) a prompt whose prefix comes from a cache runs its extend kernel,
which in bfloat16 decodes differently from a full prefill (this model's
outputs differ after the first token, offloading off). A CPU hit takes the
same path as a device prefix-cache hit, so each phase is compared with the
same phase offloading off: cold prompts with cold prompts, CPU hits with
device hits.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import (
    GUIDE_OFFLOAD,
    PROMPTS_BY_DOC,
    TP2,
    cached,
    remove_vllm_tp_shm,
    run_scenario,
    scenario_log,
    token_ids,
)
from vllm_ascend.kv_offload.region import MARK_PREFIX, MARK_SUFFIX
from vllm_ascend.kv_offload.testing.engine import TERMINATE_WORKERS_ENV

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not torch.cpu._is_amx_tile_supported(),
        reason="vLLM's CPU MLA backend with prefix caching (AMX_MLA) needs AMX "
        "tiles; without them it turns prefix caching off, and offloading with it",
    ),
]

TP = TP2["engine"]["tensor_parallel_size"]
# Two documents' first questions: 4 full 128-token blocks each are cached.
PROMPTS = [PROMPTS_BY_DOC[0][0], PROMPTS_BY_DOC[1][0]]
CACHED_TOKENS = 4 * 128
NUM_CPU_BLOCKS = GUIDE_OFFLOAD["num_cpu_blocks"]


def latent_block_bytes(model_dir: str) -> int:
    """Bytes of one 128-token block of every layer's latent, one worker
    (bfloat16): what each rank holds, the same on both."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    return cfg["num_hidden_layers"] * 128 * latent * 2


@pytest.fixture(scope="module")
def runs(scenario_dir, mla_model) -> dict:
    """Offloading off, then the guide's config, one engine after the other
    in one process: cold prompts, then the same prompts (offloading on:
    after the device prefix cache was reset)."""
    # bfloat16: the AMX MLA backend runs nothing else.
    engine = {"model": mla_model, "engine": {**TP2["engine"], "dtype": "bfloat16"}}
    again = {"prompts": PROMPTS}
    result = run_scenario(
        scenario_dir,
        "mla-tp2",
        {
            # Each engine's TP workers terminated 1 s into its shutdown:
            # exiting on their own takes them longer than vLLM's 5 s grace on
            # a loaded machine, offloading on or off (CPython's finalization;
            # testing/engine.py). The region and its mark are gone all the
            # same (test_dev_shm_is_clean_afterwards).
            "env": {**TP2["env"], **TERMINATE_WORKERS_ENV},
            "sequence": [
                {**engine, "offload": None, "phases": [{"prompts": PROMPTS}, again]},
                {
                    **engine,
                    "offload": GUIDE_OFFLOAD,
                    "phases": [
                        {"prompts": PROMPTS},
                        {**again, "reset_prefix_cache": True},
                    ],
                },
            ],
        },
        timeout_s=1200,
    )
    off, on = result["runs"]
    log = scenario_log(scenario_dir, "mla-tp2")
    remove_vllm_tp_shm(log)
    return {"off": off, "on": on, "log": log}


def test_greedy_outputs_match_offloading_off_and_cpu_hits_serve_the_prefix(runs):
    off, on = runs["off"]["phases"], runs["on"]["phases"]
    assert token_ids(on[0]) == token_ids(off[0])  # cold: full prefill
    assert cached(off[1]) == [CACHED_TOKENS] * len(PROMPTS)  # device hits
    assert cached(on[1]) == [CACHED_TOKENS] * len(PROMPTS)  # CPU hits
    assert token_ids(on[1]) == token_ids(off[1])


def test_rank_0_alone_stores_and_both_ranks_load(runs, mla_model):
    """vLLM sums the transfer bytes of all workers: one rank's stores, both
    ranks' loads of the same blocks."""
    block = latent_block_bytes(mla_model)
    stored_blocks = len(PROMPTS) * CACHED_TOKENS // 128
    after_cold, after_hits = runs["on"]["phase_counters"]
    assert after_cold["vllm:kv_offload_store_bytes"] == stored_blocks * block
    assert after_hits["vllm:kv_offload_load_bytes"] == TP * stored_blocks * block
    # /metrics counts the one copy the host holds.
    assert after_hits["vllm:kv_offload_cpu_pool_capacity_bytes"] == (
        NUM_CPU_BLOCKS * block
    )


def test_the_host_holds_one_copy_half_of_two_private_pools(runs, mla_model):
    """Measured from the run: the one region vLLM created in /dev/shm (its
    size as vLLM's region reports it) against what the two ranks' private
    pools were (each a slot's bytes per CPU block, as our worker logs it)."""
    log = runs["log"]
    created = re.findall(r"Created mmap file (\S+) \(([\d.]+) GB\)", log)
    workers = re.findall(
        r"worker on shared region (\S+) \((\d+) bytes: (\d+) rows of (\d+) bytes\), "
        r"this rank's slot (\d+) bytes at offset 0, shared by every rank",
        log,
    )
    assert len(created) == 1, created  # one region on the host
    assert len(workers) == TP, workers  # both ranks on it, slot 0
    assert {w[0] for w in workers} == {created[0][0]}
    region_bytes, rows, _, slot = map(int, workers[0][1:])
    assert rows == NUM_CPU_BLOCKS and slot == latent_block_bytes(mla_model)
    private_pools_bytes = TP * rows * slot
    print(
        f"MLA TP={TP}: one shared region of {region_bytes} bytes; private "
        f"pools would be {private_pools_bytes} bytes"
    )
    assert region_bytes * TP == private_pools_bytes
    assert "CPU block pool of" not in log  # no private pool was allocated


def test_dev_shm_is_clean_afterwards(runs):
    (region,) = re.findall(r"Created mmap file (\S+) ", runs["log"])
    engine_id = Path(region).name.removeprefix("vllm_offload_").removesuffix(".mmap")
    assert not os.path.exists(region)
    assert not os.path.exists(f"/dev/shm/{MARK_PREFIX}{engine_id}{MARK_SUFFIX}")
