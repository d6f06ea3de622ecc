"""The private vLLM names this package relies on still mean what it assumes.

All of them are used in ``vllm_ascend/kv_offload/vllm_compat.py`` and
nowhere else. Each check fails with a message naming the vLLM name, what
changed and the function to update. They run on the installed vLLM and on
vLLM 0.33's offloading code (tests/vllm033/overlay.py), in a fresh process.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_public_seams import _private

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_ascend" / "kv_offload"

# The private vLLM names vllm_compat.py uses (attribute names); CHECKS
# below checks each on the installed vLLM and on 0.33's offloading code.
PRIVATE_VLLM_NAMES = set(
    "_registry _init_worker _uses_shared_region _all_workers_barrier "
    "_job_block_counts _use_o_direct _store_job_keys "
    "_load_job_keys _load_progress _pool _creator _num_allocated_chunks "
    "_free_list _custom_ops _C_cache_ops".split()
)
# Private names the package reads that are not vLLM's.
NOT_VLLM = {"_C_ascend": "torch.ops namespace of this package's native ops"}

CHECKS = r"""
import inspect, sys
problems = []

def check(ok, what):
    if not ok:
        problems.append(what)

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
registry = getattr(KVConnectorFactory, "_registry", None)
check(isinstance(registry, dict) and "OffloadingConnector" in registry
      and callable(registry["OffloadingConnector"])
      and isinstance(registry["OffloadingConnector"](), type),
      "KVConnectorFactory._registry is no longer a dict of name -> loader of "
      "the class (vllm_compat.replace_connector_loader)")

from vllm.v1.kv_offload.factory import OffloadingSpecFactory
check(callable(getattr(OffloadingSpecFactory, "get_spec_cls", None)),
      "OffloadingSpecFactory.get_spec_cls (public) is gone (connector.our_spec_class)")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
init = getattr(OffloadingConnectorWorker, "_init_worker", None)
check(init is not None
      and list(inspect.signature(init).parameters) == ["self", "kv_caches"]
      and "get_worker" in inspect.getsource(init)
      and "_init_worker(" in inspect.getsource(
          OffloadingConnectorWorker.register_kv_caches),
      "OffloadingConnectorWorker._init_worker(kv_caches) no longer builds the "
      "worker from the spec (vllm_compat.init_offloading_worker)")

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
check(hasattr(CPUOffloadingSpec, "_uses_shared_region")
      and "_uses_shared_region()" in inspect.getsource(CPUOffloadingSpec.__init__),
      "CPUOffloadingSpec.__init__ no longer asks _uses_shared_region() "
      "(vllm_compat.ReplicatedOncePerHostSpec)")
import vllm.v1.kv_offload.cpu.spec as cpu_spec
barrier = getattr(cpu_spec, "_all_workers_barrier", None)
check(callable(barrier) and not inspect.signature(barrier).parameters
      and ".barrier()" in inspect.getsource(barrier)
      and "barrier=_all_workers_barrier" in inspect.getsource(
          CPUOffloadingSpec.create_worker),
      "vllm.v1.kv_offload.cpu.spec._all_workers_barrier() is no longer the "
      "barrier of every worker its region waits for "
      "(vllm_compat.all_workers_barrier)")

from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
finished_src = inspect.getsource(FileSystemTierManager.get_finished_jobs)
check("_job_block_counts" not in finished_src
      or ("_job_block_counts" in inspect.getsource(FileSystemTierManager.__init__)
          and "_job_block_counts[" in inspect.getsource(
              FileSystemTierManager.submit_store)),
      "FileSystemTierManager.get_finished_jobs reads _job_block_counts, but "
      "__init__/submit_store no longer fill it that way "
      "(vllm_compat.count_fs_tier_job_blocks)")

from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
fs_init = inspect.getsource(FileSystemTierManager.__init__)
store_src = inspect.getsource(FileSystemTierManager.submit_store)
load_src = inspect.getsource(FileSystemTierManager.submit_load)
check("self._use_o_direct = probe_o_direct(" in fs_init,
      "FileSystemTierManager.__init__ no longer sets _use_o_direct from its "
      "O_DIRECT probe (vllm_compat.fs_tier_uses_o_direct)")
check("self._pool = DualQueueThreadPool(" in fs_init
      and "self._pool.enqueue_store(job_metadata.job_id, 1, [" in store_src
      and "self._pool.enqueue_load(job_id, 1, [" in load_src,
      "FileSystemTierManager no longer queues one-task jobs on _pool "
      "(vllm_compat.enqueue_fs_tier_store/enqueue_fs_tier_load)")
check("if self.events is not None:" in store_src
      and "self._store_job_keys[job_metadata.job_id] = keys" in store_src
      and "self._store_job_keys.pop(job_id" in finished_src,
      "FileSystemTierManager no longer keeps store keys for events in "
      "_store_job_keys (vllm_compat.enqueue_fs_tier_store)")
check("self._load_job_keys[job_id] = keys" in load_src
      and "self._load_job_keys.pop(job_id" in finished_src,
      "FileSystemTierManager no longer keeps load keys in _load_job_keys "
      "(vllm_compat.enqueue_fs_tier_load)")
check("self._load_progress[job_id] = " in load_src
      and "self._load_progress.pop(job_id" in finished_src,
      "FileSystemTierManager no longer reads a failed load's progress from "
      "_load_progress (vllm_compat.record_fs_tier_load_progress)")
check(list(inspect.signature(SecondaryTierManager.__init__).parameters)[:3]
      == ["self", "offloading_spec", "primary_kv_view"],
      "SecondaryTierManager.__init__(offloading_spec, primary_kv_view, ...) "
      "changed (tiering/fs.py keeps its own view of primary_kv_view)")

from vllm.v1.kv_offload.tiering.fs import thread_pool
pool_src = inspect.getsource(thread_pool.DualQueueThreadPool._worker)
check(thread_pool.logger.name == "vllm.v1.kv_offload.tiering.fs.thread_pool"
      and 'logger.error(\n                    "Job %s block I/O failed: %s",\n'
          '                    state.job_id,\n                    exc,' in pool_src,
      "DualQueueThreadPool no longer logs a task's exception as the second "
      "argument of its module logger's error line "
      "(vllm_compat.quiet_fs_tier_pool_errors)")

from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager, TieringOffloadingManager,
)
tiering_manager_src = inspect.getsource(TieringOffloadingManager)
check("self.primary_tier.prepare_write(" in tiering_manager_src
      and "self.prepare_write = self.prepare_store" in inspect.getsource(
          CPUPrimaryTierOffloadingManager.__init__),
      "the tiering manager's promotions no longer reserve CPU blocks through "
      "primary_tier.prepare_write (manager.FailureAwareManager counts their "
      "evictions there)")

from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
import dataclasses
tiering_src = inspect.getsource(TieringOffloadingSpec)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
region_src = inspect.getsource(SharedOffloadRegion)
check("self._creator = True" in region_src
      and "if self._creator and getattr(self, \"mmap_path\", None):"
      in inspect.getsource(SharedOffloadRegion.cleanup),
      "SharedOffloadRegion.cleanup no longer unlinks the file only where "
      "_creator is set (vllm_compat.disown_region)")
check("engine_id" in {f.name for f in dataclasses.fields(OffloadingConfig)}
      and "engine_id=self._engine_id" in tiering_src
      and "self._engine_id = config.engine_id" in tiering_src,
      "TieringOffloadingSpec no longer names its region after "
      "OffloadingConfig.engine_id (tiering/spec.py get_worker)")

from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
fresh = CPUOffloadingManager(num_chunks=4)
check(fresh._num_allocated_chunks == 0 and fresh._free_list == []
      and "self._free_list.append(" in inspect.getsource(CPUOffloadingManager)
      and "self._num_allocated_chunks += 1" in inspect.getsource(
          CPUOffloadingManager),
      "CPUOffloadingManager no longer counts allocated chunks in "
      "_num_allocated_chunks and freed ones in _free_list "
      "(vllm_compat.cpu_blocks_in_use)")

from vllm import _custom_ops
swap = getattr(_custom_ops, "swap_blocks_batch", None)
check(swap is not None
      and list(inspect.signature(swap).parameters)
      == ["src_ptrs", "dst_ptrs", "sizes", "is_src_access_order_any"]
      and "torch.ops._C_cache_ops.swap_blocks_batch(" in inspect.getsource(swap),
      "vllm._custom_ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes, "
      "is_src_access_order_any) changed (vllm_compat.vllm_swap_blocks_batch)")

import os
print("offloading code:", os.environ.get("VLLM_KV_OFFLOAD_OVERLAY", "installed"))
if problems:
    sys.exit("vLLM changed what vllm_compat.py relies on:\n- " + "\n- ".join(problems))
"""


def _run_checks(pythonpath: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", CHECKS], capture_output=True, text=True, timeout=300,
        env=env,
    )  # fmt: skip


@pytest.mark.parametrize("code", ["installed", "0.33"])
def test_private_vllm_names_still_mean_what_vllm_compat_assumes(code: str) -> None:
    path = []
    if code == "0.33":
        from tests.vllm033.overlay import overlay_dir, skip_unless_core_supported

        skip_unless_core_supported()
        path = [str(overlay_dir())]
    proc = _run_checks(path)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-1000:]
    want = "0.33.0" if code == "0.33" else "installed"
    assert f"offloading code: {want}" in proc.stdout


def private_vllm_uses(sources: dict[str, str]) -> dict[str, set[str]]:
    """Private names that ``sources`` (module name -> source of this package)
    read from objects or modules that are not the package's own: name ->
    modules reading it.

    The rule is by name: a single-underscore attribute that is read (or a
    ``from vllm... import _x``) and that no module of the package defines
    (assigns as an attribute, ``def``s, or declares in a class body). A
    vLLM name that one of our classes also defines is therefore not seen;
    this is the price of not resolving types."""
    trees = {name: ast.parse(src) for name, src in sources.items()}
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
                own.add(node.attr)
            elif isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            ):
                own.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif isinstance(node, ast.Assign):
                own.update(t.id for t in node.targets if isinstance(t, ast.Name))
    uses: dict[str, set[str]] = {}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                if _private(node.attr) and node.attr not in own:
                    uses.setdefault(node.attr, set()).add(name)
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] == "vllm":
                    for alias in node.names:
                        if _private(alias.name):
                            uses.setdefault(alias.name, set()).add(name)
    return uses


def package_sources() -> dict[str, str]:
    return {
        str(path.relative_to(PACKAGE)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_private_vllm_names_are_used_in_vllm_compat_only() -> None:
    uses = private_vllm_uses(package_sources())
    outside = {
        name: sorted(modules - {"vllm_compat.py"})
        for name, modules in uses.items()
        if name not in NOT_VLLM and modules - {"vllm_compat.py"}
    }
    assert outside == {}, (
        "private vLLM names outside vllm_compat.py (move them into a function "
        f"there, checked in CHECKS above): {outside}"
    )
    unlisted = set(uses) - PRIVATE_VLLM_NAMES - set(NOT_VLLM)
    assert unlisted == set(), (
        f"vllm_compat.py uses private vLLM names {sorted(unlisted)} that "
        "PRIVATE_VLLM_NAMES (and CHECKS) do not cover"
    )


@pytest.mark.parametrize(
    "planted, name",
    [
        ("def o_direct(tier):\n    return tier._use_o_direct\n", "_use_o_direct"),
        ("from vllm.v1.kv_offload.tiering.fs import _helper\n", "_helper"),
        ("def pool(spec):\n    return spec._scheduler_mmap.fd\n", "_scheduler_mmap"),
    ],
)
def test_the_scan_finds_a_planted_private_vllm_name(planted: str, name: str) -> None:
    sources = {**package_sources(), "planted.py": planted}
    assert "planted.py" in private_vllm_uses(sources).get(name, set())


def test_the_scan_ignores_the_packages_own_private_names() -> None:
    planted = (
        "class T:\n    def f(self):\n        self._mine = 1\n"
        "        return self._mine\n"
    )
    sources = {**package_sources(), "planted.py": planted}
    assert "_mine" not in private_vllm_uses(sources)


def _private_names(path: Path) -> set[str]:
    """Single-underscore attribute names a module reads, writes on another
    object or defines (methods), less the attributes it assigns itself (its
    own state, ``self._x =``)."""
    tree = ast.parse(path.read_text())
    used, own = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
            if (
                isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                own.add(node.attr)
        elif isinstance(node, ast.FunctionDef):
            used.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)  # class-level attribute declarations
    return {n for n in used - own if _private(n)}


def test_vllm_compat_uses_exactly_the_listed_private_names() -> None:
    assert _private_names(PACKAGE / "vllm_compat.py") == PRIVATE_VLLM_NAMES
