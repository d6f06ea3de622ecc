"""Which class serves ``kv_connector="OffloadingConnector"``.

The guide's config (our spec) gets ``AscendOffloadingConnector``; any other
spec gets the class that had the name before us: vLLM's own, or upstream
vllm-ascend's, whichever order vLLM runs the general plugins in. Upstream is
played by a stand-in package that registers its connector the way upstream
0.30 does (pop the name, then ``register_connector``). Each scenario runs in
a fresh interpreter: the registry is process state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.unit.kv_helpers import GUIDE_EXTRA

# What upstream vllm-ascend 0.30's vllm_ascend/distributed/kv_transfer does
# to OffloadingConnector, reduced to that.
STAND_IN_UPSTREAM = """
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

def register_connector():
    if "OffloadingConnector" in KVConnectorFactory._registry:
        KVConnectorFactory._registry.pop("OffloadingConnector")
    KVConnectorFactory.register_connector(
        "OffloadingConnector",
        "vllm_ascend.distributed.kv_transfer.upstream_connector",
        "UpstreamOffloadingConnector",
    )
"""
STAND_IN_CONNECTOR = """
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

class UpstreamOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self.built_with = (vllm_config, role, kv_cache_config)
"""

SCENARIO = """
import json, sys
from types import SimpleNamespace
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm_ascend.kv_offload import plugin
from vllm_ascend.kv_offload.connector import AscendOffloadingConnector, our_spec_class

order = sys.argv[1].split(",")
upstream = None
if "upstream" in order:
    import vllm_ascend.distributed.kv_transfer as upstream
for who in order:
    if who == "upstream":
        upstream.register_connector()
    else:
        plugin.register()
cls = KVConnectorFactory.get_connector_class_by_name("OffloadingConnector")
fallback = plugin.fallback_connector_class()
other = SimpleNamespace(kv_transfer_config=SimpleNamespace(
    kv_connector_extra_config={"spec_name": "CPUOffloadingSpec",
                               "cpu_bytes_to_use": 1 << 20}))
built = None
if upstream is not None:  # the stand-in's class is cheap to construct
    built = type(AscendOffloadingConnector(other, "role", "kv_cache_config"))
print(json.dumps({
    "served_by": cls.__name__,
    "fallback": fallback.__name__ if fallback else None,
    "other_spec_gets": built.__name__ if built else None,
    "guide_is_ours": our_spec_class(json.loads(sys.argv[2])) is not None,
}))
"""


def _run(order: str, tmp_path: Path, with_upstream: bool) -> dict:
    path = [str(Path(__file__).resolve().parents[2])]
    if with_upstream:
        pkg = tmp_path / "vllm_ascend" / "distributed" / "kv_transfer"
        pkg.mkdir(parents=True, exist_ok=True)
        (tmp_path / "vllm_ascend" / "distributed" / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text(STAND_IN_UPSTREAM)
        (pkg / "upstream_connector.py").write_text(STAND_IN_CONNECTOR)
        path.insert(0, str(tmp_path))
    code = f"import sys; sys.path[:0] = {path!r}\n" + textwrap.dedent(SCENARIO)
    proc = subprocess.run(
        [sys.executable, "-c", code, order, json.dumps(GUIDE_EXTRA)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", ["upstream,ours", "ours,upstream"])
def test_guide_config_gets_ours_and_other_specs_get_upstreams_in_either_order(
    order: str, tmp_path: Path
) -> None:
    result = _run(order, tmp_path, with_upstream=True)
    assert result == {
        "served_by": "AscendOffloadingConnector",
        "fallback": "UpstreamOffloadingConnector",
        "other_spec_gets": "UpstreamOffloadingConnector",
        "guide_is_ours": True,
    }


def test_without_upstream_other_specs_get_vllms_connector(tmp_path: Path) -> None:
    result = _run("ours,ours", tmp_path, with_upstream=False)
    assert result["served_by"] == "AscendOffloadingConnector"
    # vLLM's own class; a second register() must not make ours its fallback.
    assert result["fallback"] == "OffloadingConnector"
    assert result["guide_is_ours"] is True


def test_the_entry_point_is_installed_and_registers_ours() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    from vllm_ascend.kv_offload.connector import AscendOffloadingConnector

    ours = [e for e in entry_points(group="vllm.general_plugins")]
    assert "vllm_ascend.kv_offload.plugin:register" in {e.value for e in ours}
    load_general_plugins()
    cls = KVConnectorFactory.get_connector_class_by_name("OffloadingConnector")
    assert cls is AscendOffloadingConnector


def test_multi_connector_rebuilds_our_stats_from_their_class_name() -> None:
    """Inside vLLM's MultiConnector, each child's stats travel to the front
    end filed under the child's class name, and are rebuilt there by looking
    that name up in the connector registry (``build_kv_connector_stats``).
    Our class serves the name ``OffloadingConnector`` but is called
    ``AscendOffloadingConnector``: without that name registered too, the
    first stats an engine logged ended it (tests/e2e/test_pd_multi_connector.py
    is the engine that showed it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    from vllm_ascend.kv_offload import plugin
    from vllm_ascend.kv_offload.connector import AscendOffloadingConnector

    plugin.register()
    name = AscendOffloadingConnector.__name__  # MultiConnector's key for it
    # What crosses the process boundary: the stats' data, not the object.
    serialized = {name: OffloadingConnectorStats().data}
    rebuilt = MultiConnector.build_kv_connector_stats(data=serialized)
    assert isinstance(rebuilt[name], OffloadingConnectorStats)
