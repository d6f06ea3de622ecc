"""The torch-npu header fetch (tools/check_npu_compile.fetch_headers) the
simulation and the npu compile check are built against."""

from __future__ import annotations

from tests.unit.npu_sim.sim_acl import FETCHER


def test_the_headers_can_be_cached_outside_the_checkout(torch_npu_dir, tmp_path):
    """Any cache directory works, not only the checkout's ``.cache``; a second
    fetch finds the first one's headers (pip's cache keeps the download cheap;
    ``torch_npu_dir`` skips or fails here as it does without a registry)."""
    fetched = FETCHER.fetch_headers(tmp_path / "headers")
    assert (fetched / "include" / "acl" / "acl.h").read_bytes() == (
        torch_npu_dir / "include" / "acl" / "acl.h"
    ).read_bytes()
    stamp = (fetched.parent / ".complete").stat().st_mtime_ns
    assert FETCHER.fetch_headers(tmp_path / "headers") == fetched
    assert (fetched.parent / ".complete").stat().st_mtime_ns == stamp
