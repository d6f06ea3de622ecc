"""Our op and upstream vllm-ascend's library live in one process.

Upstream's library registers ``TORCH_LIBRARY(_C_ascend)`` with its own
``swap_blocks_batch(Tensor x, Tensor y, Tensor z, int direction) -> ()``. A
second ``TORCH_LIBRARY`` for that namespace, or a second default overload of
that op, aborts the process when the later library is loaded. Ours adds a
fragment with names of its own (``kv_offload_*``). A stand-in built here
(``upstream_stand_in/upstream_ops.cpp``) plays upstream; both load orders are
tried, each in a fresh interpreter, and both ops are called.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ascend.kv_offload import ops

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not ops.HAS_NATIVE_OP, reason="needs the native extension (_C_kv_offload)"
)

SCENARIO = """
import sys
import torch

for step in sys.argv[2].split(","):
    if step == "upstream":
        torch.ops.load_library(sys.argv[1])
    else:
        from vllm_ascend.kv_offload import ops
        assert ops.HAS_NATIVE_OP

# Upstream's op reaches upstream's kernel.
z = torch.zeros(4, dtype=torch.int64)
torch.ops._C_ascend.swap_blocks_batch(z, z, z, 1)
assert z.tolist() == [8, 8, 8, 8], z

# Ours reaches ours: it copies bytes.
src = torch.arange(64, dtype=torch.uint8)
dst = torch.zeros(64, dtype=torch.uint8)
addr = lambda t, off: t.data_ptr() + off
desc = lambda *v: torch.tensor(v, dtype=torch.int64)
n, workspace = torch.ops._C_ascend.kv_offload_swap_blocks.default(
    desc(addr(src, 0), addr(src, 32)), desc(addr(dst, 32), addr(dst, 0)),
    desc(32, 32), "cpu")
assert n == 2 and workspace.numel() == 0, (n, workspace)
assert torch.equal(dst[32:], src[:32]) and torch.equal(dst[:32], src[32:])
print("both ops reached their own kernels")
"""


@pytest.fixture(scope="module")
def stand_in_library() -> str:
    """Path of the built stand-in. Built in a child process: building with
    torch's extension loader also loads the library, and this test process
    must stay free of both libraries (if ours aborted, pytest would too)."""
    build = ROOT / ".cache" / "upstream_stand_in"
    build.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).parent / "upstream_stand_in" / "upstream_ops.cpp"
    builder = (
        "import sys; from torch.utils.cpp_extension import load; "
        "load(name='stand_in_upstream_ops', sources=[sys.argv[1]], "
        "build_directory=sys.argv[2], is_python_module=False)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", builder, str(source), str(build)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return str(build / "stand_in_upstream_ops.so")


@pytest.mark.parametrize("order", ["upstream,ours", "ours,upstream"])
def test_both_libraries_load_and_each_op_reaches_its_own_kernel(
    stand_in_library: str, order: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCENARIO, stand_in_library, order],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode} (-6/134: abort at library load)\n{proc.stderr[-4000:]}"
    )
    assert "both ops reached their own kernels" in proc.stdout
