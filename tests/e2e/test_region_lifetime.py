"""No shared region outlives its engine: a tiering ``vllm serve`` whose
``/dev/shm`` is a small tmpfs (a private mount namespace) that holds vLLM's
own segments and two of its regions, not three.

The server is started three times: stopped with SIGTERM at vLLM's default
``--shutdown-timeout`` (0: the API server force-kills the engine core and
the worker), then SIGKILLed as a whole process group while requests are in
flight, then started and stopped with SIGTERM once more (had the first two
stops leaked their regions, this third start would find no room). Every
start must succeed and answer as offloading off does (a prefix loaded back
from the region after the device cache was emptied); after every stop no
file of the offload (region or its mark) may be left in that ``/dev/shm``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    PROMPTS_BY_DOC,
    tiering,
)
from tests.e2e.serving import Server, cpu_block_bytes, offloading
from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.e2e

CPU_BLOCKS = 384  # 48 MiB with the tiny model (128 KiB a block)
REGION_MIB = 48
# vLLM 0.32's worker checks for 240 MiB free before it creates its response
# queue (sparse: it uses little of it), then the region is created: one
# leaked region leaves room for a start, two do not.
VLLM_FREE_MIB = 240
SHM_MIB = VLLM_FREE_MIB + REGION_MIB + REGION_MIB // 2
DOC_BLOCKS = 4  # each document's prefix is 512 tokens
STOPS = [signal.SIGTERM, signal.SIGKILL, signal.SIGTERM]


@pytest.fixture(scope="module")
def small_shm() -> Iterator[Path]:
    """``/dev/shm`` of a private mount namespace: a SHM_MIB tmpfs, held by a
    sleeping process that servers join (``nsenter``); yields that
    directory as this process sees it (through the holder's root)."""
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("needs util-linux's unshare and nsenter")
    holder = subprocess.Popen(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs -o size={SHM_MIB}m tmpfs /dev/shm "
            "&& echo mounted && exec sleep 3600",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stderr is not None
    if holder.stdout.readline().strip() != "mounted":
        holder.wait()
        pytest.skip(
            "cannot mount a tmpfs on /dev/shm in a private mount namespace "
            f"(needs CAP_SYS_ADMIN): {holder.stderr.read().strip()}"
        )
    try:
        yield Path(f"/proc/{holder.pid}/root/dev/shm")
    finally:
        holder.kill()
        holder.wait()


def offload_files(shm: Path) -> list[str]:
    """Regions (``vllm_offload_*.mmap``) and our marks beside them."""
    return sorted(n for n in os.listdir(shm) if "offload" in n)


def shm_used_bytes(shm: Path) -> int:
    """Memory the tmpfs holds (as ``df``: unlinked files still mapped too)."""
    st = os.statvfs(shm)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def traffic(server: Server, prompts: list[str]) -> threading.Thread:
    """Requests in flight (their failures expected: the server is killed)."""

    def send() -> None:
        create = server.client.completions.create
        for prompt in prompts:
            try:
                create(model=server.model, prompt=prompt, max_tokens=256)
            except Exception:
                return

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def serve_once(
    shm: Path, model: str, tmp: Path, run: int, stop: int, config: dict
) -> dict:
    """One start, a prefix stored and loaded back from the region, one stop."""
    launcher = ["nsenter", "-t", shm.parts[2], "-m", "--"]
    server = Server(model, tmp / f"server{run}.log", config, launcher)
    record: dict = {"run": run, "stop_signal": signal.Signals(stop).name}
    try:
        record["start_s"] = server.wait_ready()
    except AssertionError as e:
        record["start_error"] = str(e)[-1500:]
        record["stop"] = server.stop()
        record["left"] = offload_files(shm)
        return record
    doc = run % len(PROMPTS_BY_DOC)
    stored = DOC_BLOCKS * cpu_block_bytes(model)
    try:
        record["served"] = [(doc, 0, server.ask(PROMPTS_BY_DOC[doc][0]))]
        record["shm_used"] = shm_used_bytes(shm)
        record["named_while_serving"] = offload_files(shm)
        server.wait_for_metric("vllm:kv_offload_store_bytes_total", stored)
        server.reset_caches(external=False)
        record["served"].append((doc, 1, server.ask(PROMPTS_BY_DOC[doc][1])))
        if stop == signal.SIGKILL:
            traffic(server, [p for d in PROMPTS_BY_DOC for p in d])
            time.sleep(1.0)
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        record["stop"] = server.stop(stop)
        # The engine's processes are gone (stop waited for them).
        record["left"] = offload_files(shm)
    return record


def transfer_config(tmp: Path, run: int) -> dict:
    # An fs tier of its own per run: each run stores its prefix to the CPU
    # tier (none found in the fs tier) and loads it back from the region.
    return offloading(tiering(str(tmp / f"tier{run}"), num_cpu_blocks=CPU_BLOCKS))


@pytest.fixture(scope="module")
def runs(small_shm, tmp_path_factory) -> list[dict]:
    model = ensure_tiny_model()
    tmp = tmp_path_factory.mktemp("region_lifetime")
    start = time.monotonic()
    records = [
        serve_once(small_shm, model, tmp, run, stop, transfer_config(tmp, run))
        for run, stop in enumerate(STOPS)
    ]
    print(
        f"\n[test_region_lifetime] {time.monotonic() - start:.1f} s for "
        f"{len(records)} starts in a {SHM_MIB} MiB /dev/shm: "
        + "; ".join(
            f"{r['stop_signal']}: start "
            + (f"{r['start_s']:.1f} s" if "start_s" in r else "FAILED")
            + f", stop {r['stop']['stop_s']:.1f} s, shm used "
            f"{r.get('shm_used', 0) / 2**20:.1f} MiB, named while serving "
            f"{r.get('named_while_serving')}, left {r['left']}"
            for r in records
        )
    )
    return records


def test_every_start_succeeds(runs):
    failed = {r["run"]: r["start_error"] for r in runs if "start_error" in r}
    assert not failed, failed


def test_no_region_is_left_after_any_stop(runs):
    assert {r["run"]: r["left"] for r in runs} == {r["run"]: [] for r in runs}


def test_the_server_answers_as_without_offloading(runs, reference):
    served = [s for r in runs for s in r.get("served", [])]
    assert served, "no server answered"
    for doc, question, answer in served:
        assert answer["token_ids"] == reference[3 * doc + question]
    # The second question's prefix came back from the offload tiers.
    assert all(a["cached_tokens"] >= DOC_BLOCKS * 128 for _, q, a in served if q)
