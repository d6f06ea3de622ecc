"""Next to an upstream vllm-ascend that owns ``vllm_ascend/kv_offload``
itself, our general plugin (which vLLM runs in every process before the
engine starts) fails at once, naming both versions and the fix: ``register``
raises before it changes anything. Upstream's installed metadata is faked
with a dist-info directory put first on ``sys.path``."""

from __future__ import annotations

from importlib import metadata

import pytest

from vllm_ascend.kv_offload import plugin, upstream_guard


@pytest.fixture
def fake_upstream(tmp_path, monkeypatch):
    """Makes ``vllm-ascend VERSION`` with RECORD ``files`` look installed."""

    def install(version: str, files: list[str]) -> None:
        info = tmp_path / f"vllm_ascend-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {version}\n"
        )
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
        monkeypatch.syspath_prepend(str(tmp_path))
        assert metadata.version("vllm-ascend") == version

    return install


@pytest.mark.parametrize("version", ["0.23.0.post1", "0.11.0"])
def test_upstream_before_0_30_is_refused_with_both_versions_and_the_fix(
    fake_upstream, version
):
    fake_upstream(version, ["vllm_ascend/kv_offload/npu.py"])
    with pytest.raises(ImportError) as refused:
        plugin.register()
    assert f"vllm-ascend {version}" in str(refused.value)
    assert "vllm-ascend-kv-offload 0." in str(refused.value)
    assert "Upgrade to vllm-ascend >= 0.30" in str(refused.value)


def test_upstream_0_30_without_kv_offload_lives_next_to_us(fake_upstream):
    fake_upstream("0.30.0rc2", ["vllm_ascend/__init__.py"])
    upstream_guard.refuse_conflicting_upstream("0.2.0")  # what register() runs first


def test_upstream_with_this_subtree_built_in_is_refused_while_we_are_installed(
    fake_upstream,
):
    # A future upstream that merged the graft, plus this distribution (the
    # editable install of this checkout) over the same files.
    fake_upstream("0.40.0", ["vllm_ascend/kv_offload/npu.py"])
    with pytest.raises(ImportError) as refused:
        plugin.register()
    assert "ships vllm_ascend/kv_offload itself" in str(refused.value)
    assert "Uninstall vllm-ascend-kv-offload" in str(refused.value)
