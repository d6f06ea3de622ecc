"""Tiering end to end on vLLM's CPU backend: two "nodes" share an fs tier.

Engine A (one process) serves three prompts and writes the fs tier; engine
B (another process, cold CPU tier, same directory) serves the same prefixes
from the files. Every engine's greedy outputs must equal offloading off (the
``reference`` fixture). The safety cases run readers on copies of A's
directory: an incompatible engine, corrupted files, a directory that
disappears, and a stale shared-memory region; a forged directory (garbage
under valid headers) is the negative control showing that the output
comparison does catch wrong KV.

Engine A runs in vLLM's default process layout (its region is mapped by
three processes); the readers run in-process, one after the other in one
process (``readers``).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
import zlib

import pytest

from tests.e2e.conftest import (
    ENGINE,
    FIRST_PROMPTS,
    FULL_DOC_TOKENS,
    cached,
    in_process,
    run_scenario,
    run_sequence,
    scenario_log,
    tiering,
    token_ids,
)
from vllm_ascend.kv_offload.region import mark_path, region_path
from vllm_ascend.kv_offload.tiering.block_file import HEADER_BYTES

pytestmark = pytest.mark.e2e

BLOCKS = 4 * len(FIRST_PROMPTS)


def tier_scenario(root: str, **extra) -> dict:
    """FIRST_PROMPTS through an fs tier at ``root`` (run_scenario's
    ``root_dir``), failed loads recomputed."""
    return {
        "engine": ENGINE,
        "offload": tiering(root, **extra.pop("offload", {})),
        "kv_load_failure_policy": "recompute",
        "root_dir": root,
        "phases": [{"prompts": FIRST_PROMPTS}],
        **extra,
    }


@pytest.fixture(scope="module")
def written(scenario_dir) -> tuple[str, dict]:
    """Engine A: serves the prompts, writes the fs tier at ``root``."""
    root = str(scenario_dir / "tier-a")
    # One writer thread: files are written in the order blocks were stored,
    # which the corruption test relies on to find each prompt's blocks.
    scenario = tier_scenario(root, offload={"write_threads": 1})
    return root, run_scenario(scenario_dir, "tier_writer", scenario)


def copy_of(written, scenario_dir, name: str) -> tuple[str, list[str]]:
    root, result = written
    dst = str(scenario_dir / name)
    shutil.copytree(root, dst)
    files = [f.replace(root, dst, 1) for f in result["files"]]
    return dst, files


# Engines on A's model directory (same config.json, same layout) whose KV is
# not A's: another RoPE theta, random (dummy) weights (issue 28, D2).
OTHER_KV = {
    "hf_overrides": {
        "hf_overrides": {
            "rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}
        }
    },
    "dummy_weights": {"load_format": "dummy"},
}


@pytest.fixture(scope="module")
def readers(written, scenario_dir) -> dict:
    """Every reader's result by name, and the stale region's engine id."""
    root, _ = written
    # Prompt p's 4 files all get corruption p, so whichever the reader opens
    # first is rejected for that reason, and the whole prefix recomputes.
    corrupt, _ = copy_of(written, scenario_dir, "tier-corrupt")
    for corruption, chain in zip(
        CORRUPTIONS.values(), _chains(written, corrupt), strict=True
    ):
        for path in chain:
            corruption(path)
    forged, files = copy_of(written, scenario_dir, "tier-forged")
    _forge(files)
    engine_id = f"kvoff-test-{uuid.uuid4().hex[:8]}"
    scenarios = {
        "tier_reader": tier_scenario(root),
        # Another CPU block size: another identity directory, so no file of A's.
        "tier_incompatible": tier_scenario(root, offload={"block_size": 256}),
        "tier_corrupt": tier_scenario(corrupt),
        "tier_forged": tier_scenario(forged),
        # A region of a dead run with this engine_id (and our mark), and the
        # tier's directory deleted once the engine is up.
        "tier_stale_vanish": tier_scenario(
            copy_of(written, scenario_dir, "tier-vanish")[0],
            engine_id=engine_id,
            stale_region=engine_id,
            remove_root_after_start=True,
        ),
    }
    for change, kwargs in OTHER_KV.items():
        engine = {**ENGINE, **kwargs}
        scenarios[f"reference_{change}"] = {
            "engine": engine,
            "offload": None,
            "phases": [{"prompts": FIRST_PROMPTS}],
        }
        copy = copy_of(written, scenario_dir, f"tier-{change}")[0]
        scenarios[f"tier_{change}"] = tier_scenario(copy, engine=engine)
    try:
        scenarios = {name: in_process(s) for name, s in scenarios.items()}
        runs = run_sequence(scenario_dir, "tier_readers", scenarios)
    finally:
        for path in (region_path(engine_id), mark_path(engine_id)):
            if os.path.exists(path):
                os.unlink(path)
    return {
        **runs,
        "engine_id": engine_id,
        "corrupt": corrupt,
        "log": scenario_log(scenario_dir, "tier_readers"),
    }


def test_writer_serves_prompts_and_writes_every_block(written, first_answers):
    _, a = written
    assert token_ids(a) == first_answers
    assert cached(a) == [0, 0, 0]
    assert len(a["files"]) == BLOCKS
    assert "/ascend-kv-" in a["files"][0]
    assert a["counters"]["vllm:kv_offload_tiering_write_bytes"] > 0
    # The region's name left /dev/shm once every process of the engine had
    # mapped it (before LLM() returned): no stop can leave it.
    assert not a["region_while_running"] and not a["region_after_shutdown"]


def test_the_engine_shuts_down_in_process_without_a_traceback(written, scenario_dir):
    # run_scenario shuts the engine down and drops the LLM in its process,
    # giving the engine core time to tear down (the scheduler's tiers too).
    log = scenario_log(scenario_dir, "tier_writer")
    # The scheduler's tiers shut down (the engine core was not cut short),
    # then vLLM's region cleanup ran without a BufferError.
    assert "fs tier on" in log and "shut down" in log
    assert "force killing" not in log
    assert "Traceback" not in log


def test_second_engine_serves_the_prefixes_from_the_files(readers, first_answers):
    b = readers["tier_reader"]
    assert token_ids(b) == first_answers
    assert all(c >= FULL_DOC_TOKENS for c in cached(b)), cached(b)
    counters = b["counters"]
    assert counters["vllm:kv_offload_tiering_chunk_hits"] == BLOCKS
    read = counters["vllm:kv_offload_tiering_read_bytes"]
    assert read > 0
    # Bytes read from the files = bytes loaded into the device cache.
    assert read == counters["vllm:kv_offload_load_bytes"]
    assert not b["region_after_shutdown"]


def test_an_incompatible_engine_gets_misses_never_wrong_output(readers, first_answers):
    c = readers["tier_incompatible"]
    assert token_ids(c) == first_answers
    assert cached(c) == [0, 0, 0]
    assert c["counters"].get("vllm:kv_offload_tiering_chunk_hits", 0) == 0
    assert len({f.split("/ascend-kv-")[1][:16] for f in c["files"]}) == 2


@pytest.mark.parametrize("change", list(OTHER_KV))
def test_an_engine_computing_other_kv_never_reads_the_files(
    readers, first_answers, change
):
    own = token_ids(readers[f"reference_{change}"]["phases"][0])
    assert own != first_answers  # the change does change the model
    g = readers[f"tier_{change}"]
    assert token_ids(g) == own
    assert cached(g) == [0, 0, 0]
    assert g["counters"].get("vllm:kv_offload_tiering_chunk_hits", 0) == 0


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)


def _flip_payload(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def _foreign_identity(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(24)  # the identity digest in the header
        f.write(b"\x00" * 32)


CORRUPTIONS = {
    "size": _truncate,
    "checksum mismatch": _flip_payload,
    "written by another identity": _foreign_identity,
}


def test_corrupted_files_are_misses_logged_and_removed(readers, first_answers):
    d = readers["tier_corrupt"]
    assert token_ids(d) == first_answers
    assert cached(d) == [0, 0, 0]
    # (The readers share one log: each line names its file, in D's copy.)
    root = re.escape(readers["corrupt"])
    for reason in CORRUPTIONS:
        line = rf"fs tier file {root}/\S+ is not loaded \({reason}"
        assert re.search(line, readers["log"]), reason
    assert d["counters"].get("vllm:kv_offload_tiering_promotion_job_failures", 0) > 0


def _chains(written, root: str) -> list[list[str]]:
    """Each prompt's 4 files in ``root`` (a copy of A's directory): A wrote
    them with one thread, prompt after prompt, so in modification order."""
    src_root, a = written
    by_time = sorted(a["files"], key=os.path.getmtime)
    files = [f.replace(src_root, root, 1) for f in by_time]
    return [files[4 * p : 4 * p + 4] for p in range(len(FIRST_PROMPTS))]


def _forge(files: list[str]) -> None:
    """Garbage under each file's valid header, with its checksum."""
    for path in files:
        with open(path, "r+b") as f:
            size = os.path.getsize(path) - HEADER_BYTES
            garbage = bytes([0x5A]) * size
            f.seek(HEADER_BYTES)
            f.write(garbage)
            f.seek(20)  # crc32 after magic(8), version(4), length(8)
            f.write(zlib.crc32(garbage).to_bytes(4, "little"))


def test_control_forged_files_change_the_output(readers, first_answers):
    """Negative control: garbage under a valid header is loaded (it passes
    every check), and the outputs differ, so the comparisons above would
    catch corrupted KV that got through."""
    e = readers["tier_forged"]
    assert all(c >= FULL_DOC_TOKENS for c in cached(e))
    assert token_ids(e) != first_answers


def test_stale_region_and_vanishing_directory(readers, first_answers):
    """A region of a dead run with this engine_id (and our mark), and the
    tier's directory deleted once the engine is up: the engine starts,
    serves the prompts by recomputing, logs both; its own region's name is
    gone once the engine is up (every process mapped it)."""
    f = readers["tier_stale_vanish"]
    assert token_ids(f) == first_answers
    # The copy held every block; with its directory gone nothing hits.
    assert cached(f) == [0, 0, 0]
    # The planted 4 KiB region did not stand in the way: the engine made its
    # own (joining the stale file would have timed out after 30 s). Which
    # process swept it is not asserted here: any tiering engine opening a
    # region on this host sweeps dead ones (once, in a full run, one did
    # before this engine); that the sweep removes and logs a dead region is
    # tests/unit/test_region.py's
    # test_a_dead_region_of_another_engine_is_removed_at_the_next_opening.
    assert f"Created mmap file {region_path(readers['engine_id'])}" in readers["log"]
    assert not f["region_while_running"] and not f["region_after_shutdown"]
