"""The private vLLM names this package relies on still mean what it assumes.

All of them are used in ``vllm_ascend/kv_offload/vllm_compat.py`` and
nowhere else. Each check fails with a message naming the vLLM name, what
changed and the function to update. They run on the installed vLLM and on
vLLM 0.33's offloading code (tests/vllm033/overlay.py), in a fresh process.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_ascend" / "kv_offload"

# The private vLLM names vllm_compat.py uses (attribute names).
PRIVATE_VLLM_NAMES = {
    "_registry",
    "_init_worker",
    "_uses_shared_region",
    "_get_connector_metadata",
    "_job_block_counts",
    "_num_allocated_chunks",
    "_free_list",
}
# Private names of vLLM objects this package once reached into; none may
# come back outside vllm_compat.py.
FORMERLY_USED = {
    "_jobs",
    "_req_status",
    "_load_jobs",
    "_unsubmitted_store_jobs",
    "_connector_worker_meta",
    "_is_store_writer",
    "_connector_metadata",
    "_worker",  # CPUOffloadingSpec's cached worker
}

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
      "OffloadingSpecFactory.get_spec_cls (public) is gone (plugin.names_our_spec)")

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
      "(vllm_compat.PrivatePoolSpec)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
check(callable(getattr(KVConnectorBase_V1, "_get_connector_metadata", None)),
      "KVConnectorBase_V1._get_connector_metadata is gone "
      "(vllm_compat.bound_metadata)")

from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
finished_src = inspect.getsource(FileSystemTierManager.get_finished_jobs)
check("_job_block_counts" not in finished_src
      or ("_job_block_counts" in inspect.getsource(FileSystemTierManager.__init__)
          and "_job_block_counts[" in inspect.getsource(
              FileSystemTierManager.submit_store)),
      "FileSystemTierManager.get_finished_jobs reads _job_block_counts, but "
      "__init__/submit_store no longer fill it that way "
      "(vllm_compat.count_fs_tier_job_blocks)")

from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
fresh = CPUOffloadingManager(num_chunks=4)
check(fresh._num_allocated_chunks == 0 and fresh._free_list == []
      and "self._free_list.append(" in inspect.getsource(CPUOffloadingManager)
      and "self._num_allocated_chunks += 1" in inspect.getsource(
          CPUOffloadingManager),
      "CPUOffloadingManager no longer counts allocated chunks in "
      "_num_allocated_chunks and freed ones in _free_list "
      "(vllm_compat.cpu_blocks_in_use)")

import os
print("offloading code:", os.environ.get("VLLM_KV_OFFLOAD_OVERLAY", "installed"))
if problems:
    sys.exit("vLLM changed what vllm_compat.py relies on:\n- " + "\n- ".join(problems))
"""


def _run_checks(pythonpath: list[str]) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(ROOT)])
    return subprocess.run(
        [sys.executable, "-c", CHECKS],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


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


def _private_names(path: Path) -> set[str]:
    """Single-underscore attribute names a module reads or defines (methods),
    less the attributes it assigns itself (its own state, e.g. ``self._x =``)."""
    tree = ast.parse(path.read_text())
    used, own = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
            if isinstance(node.ctx, ast.Store):
                own.add(node.attr)
        elif isinstance(node, ast.FunctionDef):
            used.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)  # class-level attribute declarations
    return {n for n in used - own if n.startswith("_") and not n.startswith("__")}


def test_no_module_but_vllm_compat_uses_private_vllm_names() -> None:
    offenders = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "vllm_compat.py":
            continue
        used = _private_names(path) & (PRIVATE_VLLM_NAMES | FORMERLY_USED)
        if used:
            offenders[path.name] = sorted(used)
    assert offenders == {}, (
        "private vLLM names outside vllm_compat.py (move them there, with the "
        f"vLLM versions checked): {offenders}"
    )


def test_vllm_compat_uses_exactly_the_listed_private_names() -> None:
    assert _private_names(PACKAGE / "vllm_compat.py") == PRIVATE_VLLM_NAMES
