"""NPUOffloadingSpec's configuration: good values size the CPU pool as the
guide and vLLM mean them; bad ones fail at start-up with one error naming
the setting, the bad value and the fix (before any pool is allocated).

Keys of kv_connector_extra_config: a key that nothing reads fails naming the
known key it resembles, and every key we pass on to vLLM is type-checked like
ours (vLLM itself reads them with a bare ``int()`` or ``bool()``: ``"abc"``
fails late, ``"false"`` reads as true). Both places that check a config at
start-up refuse them: the connector (``validate_connector_config``, before
vLLM derives anything) and the spec.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from tests.unit.kv_helpers import (
    BLOCK,
    GUIDE_EXTRA,
    OUR_SPEC,
    make_config,
    make_kv_caches,
    running,
)
from vllm_ascend.kv_offload import connector as connector_module
from vllm_ascend.kv_offload.config import KEYS, cpu_block_bytes
from vllm_ascend.kv_offload.connector import AscendOffloadingConnector
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.npu import (
    NPUOffloadingSpec,
    OffloadConfigError,
    validate_connector_config,
)


@pytest.mark.parametrize(
    "extra, bpc, num_chunks",
    [
        # The guide's num_cpu_blocks counts blocks of block_size tokens.
        (GUIDE_EXTRA, 1, 1000),
        (GUIDE_EXTRA, 2, 1000),
        (GUIDE_EXTRA, 4, 1000),
        # cpu_bytes_to_use as in vLLM: whole CPU blocks of 65536 bytes.
        ({"cpu_bytes_to_use": 10 * BLOCK + 5}, 1, 10),
        # Both sizes, agreeing (disagreeing: SPEC_CASES, "set only one").
        ({"num_cpu_blocks": 4, "cpu_bytes_to_use": 4 * BLOCK}, 1, 4),
    ],
)
def test_the_pool_size_settings_give_the_chunks_vllm_means(extra, bpc, num_chunks):
    spec = NPUOffloadingSpec(make_config(extra, blocks_per_chunk=bpc))
    assert (spec.num_chunks, spec.blocks_per_chunk) == (num_chunks, bpc)


def test_cpu_block_bytes_covers_all_workers_and_sub_blocks():
    assert cpu_block_bytes(make_config({})) == BLOCK == 65536
    config = make_config({}, worker_kv_bytes_per_block=1000, blocks_per_chunk=3)
    # 3000 bytes rounded up to vLLM's 4096-byte alignment.
    assert cpu_block_bytes(config) == 4096
    config = make_config({}, worker_kv_bytes_per_block=65536, world_size=2)
    assert cpu_block_bytes(config) == 131072


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_vllm_eviction_policies_are_reused(policy):
    spec = NPUOffloadingSpec(
        make_config({"num_cpu_blocks": 8, "eviction_policy": policy})
    )
    assert spec.eviction_policy == policy
    manager = spec.get_manager()
    # vLLM's manager, wrapped to hear about failed transfers.
    assert isinstance(manager, FailureAwareManager)
    assert isinstance(manager.inner, CPUOffloadingManager)


def test_worker_pool_is_exactly_num_cpu_blocks_times_one_cpu_block():
    page_bytes = [32768, 32768]
    for bpc in (1, 2):
        config = make_config(
            {"num_cpu_blocks": 7},
            worker_kv_bytes_per_block=sum(page_bytes),
            blocks_per_chunk=bpc,
        )
        spec = NPUOffloadingSpec(config)
        with running(spec.get_worker(make_kv_caches(4, page_bytes))) as worker:
            # One CPU block = bpc device blocks of every cached tensor.
            assert worker.pool.nbytes == 7 * bpc * sum(page_bytes)
            assert worker.pool.tensor.shape == (7, bpc * sum(page_bytes))


# (extra_config, fragments the one error must contain: the key, the bad value
# and the fix). Checked by NPUOffloadingSpec, which sees the block size; host
# memory is checked when the pool is allocated (test_host_memory_guard.py).
SPEC_CASES = [
    ({"num_cpu_blocks": 0},
     ["'num_cpu_blocks'", "=0", "must be > 0", "num_cpu_blocks=1000"]),
    ({"num_cpu_blocks": -3},
     ["'num_cpu_blocks'", "=-3", "must be > 0", "num_cpu_blocks="]),
    ({"num_cpu_blocks": 2.5},
     ["'num_cpu_blocks'", "=2.5", "must be a positive integer"]),
    ({"num_cpu_blocks": "1000"}, ["'num_cpu_blocks'", "='1000'", "not a string"]),
    ({"num_cpu_blocks": "many"}, ["'num_cpu_blocks'", "must be a positive integer"]),
    ({"num_cpu_blocks": True}, ["'num_cpu_blocks'", "=True", "positive integer"]),
    ({"num_cpu_blocks": None}, ["num_cpu_blocks", "cpu_bytes_to_use", "set"]),
    ({}, ["needs the CPU pool size", "cpu_bytes_to_use", "set 'num_cpu_blocks'"]),
    ({"num_cpu_blocks": 10**12},
     ["'num_cpu_blocks'", "=1000000000000", "lower num_cpu_blocks"]),
    ({"cpu_bytes_to_use": 0}, ["'cpu_bytes_to_use'", "=0", "must be > 0"]),
    ({"cpu_bytes_to_use": -1}, ["'cpu_bytes_to_use'", "=-1", "> 0"]),
    ({"cpu_bytes_to_use": "4GB"}, ["'cpu_bytes_to_use'", "='4GB'", "integer"]),
    ({"cpu_bytes_to_use": 100}, ["'cpu_bytes_to_use'", "=100", f"at least {BLOCK}"]),
    ({"cpu_bytes_to_use": 2**31 * BLOCK},
     ["'cpu_bytes_to_use'", f"={2**31 * BLOCK}", "not a plausible pool size"]),
    ({"num_cpu_blocks": 4, "cpu_bytes_to_use": 100 * BLOCK},
     ["num_cpu_blocks=4", f"cpu_bytes_to_use={100 * BLOCK}", "set only one"]),
    ({"num_cpu_blocks": 8, "eviction_policy": 5},
     ["'eviction_policy'", "=5", "use one of lru, arc"]),
    ({"num_cpu_blocks": 8, "blocks_per_chunk": 0}, ["'blocks_per_chunk'", "=0", "> 0"]),
    ({"num_cpu_blocks": 8, "store_threshold": -1},
     ["'store_threshold'", "=-1", ">= 0", "store_threshold=2"]),
    ({"num_cpu_blocks": 8, "store_threshold": "2"},
     ["'store_threshold'", "='2'", "non-negative integer"]),
    # Huge numbers are shown in scientific notation (in a short message).
    ({"num_cpu_blocks": 1e300}, ["1e+300"]),
    ({"num_cpu_blocks": 10**400}, ["1.00e+400"]),
    ({"cpu_bytes_to_use": 1e300}, ["1e+300"]),
    ({"cpu_bytes_to_use": -(10**30)}, ["-1.00e+30"]),
]  # fmt: skip

# (kv_role, extra_config, device block sizes, fragments). Checked by the
# connector before vLLM derives the chunk size from block_size.
CONNECTOR_CASES = [
    ("kv_producer", {}, [16], ["kv_role='kv_producer'", "set kv_role='kv_both'"]),
    # A P/D node's MultiConnector has the node's role at the top level and
    # in the P/D entry; ours needs its own (docs/ascend_layouts.md).
    ("kv_producer", {}, [16],
     ["in a MultiConnector", "the OffloadingConnector entry of its 'connectors'"]),
    ("kv_consumer", {}, [16], ["kv_role='kv_consumer'", "set kv_role='kv_both'"]),
    (None, {}, [16], ["kv_role=None", "set kv_role='kv_both'"]),
    ("kv_both", {"block_size": 100}, [128],
     ["'block_size'", "=100", "(128 tokens)", "set block_size to 128"]),
    ("kv_both", {"block_size": 200}, [16],
     ["'block_size'", "=200", "(16 tokens)", "set block_size to 208 or 192"]),
    ("kv_both", {"block_size": 0}, [16], ["'block_size'", "=0", "> 0"]),
    # vLLM alone would take -128 as a multiple of 128 (and a chunk of -1).
    ("kv_both", {"block_size": -128}, [128], ["'block_size'", "=-128", "> 0"]),
    ("kv_both", {"block_size": "128"}, [128], ["'block_size'", "='128'", "integer"]),
    ("kv_both", {"block_size": 128, "blocks_per_chunk": 2}, [16],
     ["block_size=128", "blocks_per_chunk=2", "set only one"]),
    ("kv_both", {"blocks_per_chunk": 0}, [16], ["'blocks_per_chunk'", "=0", "> 0"]),
    ("kv_both", {"blocks_per_chunk": 1.5}, [16], ["'blocks_per_chunk'", "=1.5"]),
    ("kv_both", {"block_size": 64}, [16, 32],
     ["'block_size'", "=64", "[16, 32]", "set blocks_per_chunk"]),
]  # fmt: skip


def _assert_names(error: OffloadConfigError | str, fragments: list[str]) -> None:
    """One short message that contains every fragment."""
    message = str(error)
    assert len(message) < 400, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("extra, fragments", SPEC_CASES)
def test_spec_rejects_bad_values_naming_key_value_and_fix(extra, fragments):
    with pytest.raises(OffloadConfigError) as error:
        NPUOffloadingSpec(make_config(extra))
    _assert_names(error.value, fragments)


@pytest.mark.parametrize("kv_role, extra, sizes, fragments", CONNECTOR_CASES)
def test_connector_rejects_bad_values_naming_key_value_and_fix(
    kv_role, extra, sizes, fragments
):
    with pytest.raises(OffloadConfigError) as error:
        validate_connector_config(kv_role, extra, sizes)
    _assert_names(error.value, fragments)


@pytest.mark.parametrize(
    "extra, sizes",
    [
        ({"block_size": 128}, [16]),
        ({"block_size": 128}, [128]),
        ({"blocks_per_chunk": 2}, [16, 32]),
        ({}, [16, 32]),
        ({"num_cpu_blocks": 1000}, []),
        # A custom policy module may name its own policy.
        ({**GUIDE_EXTRA, "cache_policy_module_path": "my.policy",
          "eviction_policy": "mine"}, [128]),
    ],
)  # fmt: skip
def test_connector_accepts_good_values(extra, sizes):
    validate_connector_config("kv_both", extra, sizes)


def test_connector_validates_before_building_anything():
    """The connector refuses kv_role before vLLM's connector init runs."""
    group = SimpleNamespace(
        kv_cache_spec=SimpleNamespace(block_size=16, dcp_sharded=False)
    )
    kv_cache_config = SimpleNamespace(
        hisparse_host_num_blocks=None,
        prefix_cacheable_group_ids=(0,),
        kv_cache_groups=[group],
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_producer",
            kv_connector_extra_config={"num_cpu_blocks": 8, **OUR_SPEC},
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    # Only configs naming our spec get our connector (and its checks).
    with pytest.raises(OffloadConfigError, match="kv_role='kv_producer'"):
        AscendOffloadingConnector(vllm_config, None, kv_cache_config)
    vllm_config.kv_transfer_config.kv_role = "kv_both"
    vllm_config.kv_transfer_config.kv_connector_extra_config = {
        "block_size": 24,
        **OUR_SPEC,
    }
    with pytest.raises(OffloadConfigError, match="set block_size to 32 or 16"):
        AscendOffloadingConnector(vllm_config, None, kv_cache_config)


GUIDE = {**GUIDE_EXTRA, "num_cpu_blocks": 8}


def refusals(extra: dict) -> list[str]:
    """The error of each start-up check (connector, spec) for ``extra``."""
    messages = []
    for check in (
        lambda: validate_connector_config("kv_both", extra, [128]),
        lambda: NPUOffloadingSpec(make_config(extra)),
    ):
        with pytest.raises(OffloadConfigError) as error:
            check()
        messages.append(str(error.value))
    return messages


# (extra_config, fragments), refused by both start-up checks.
REFUSED_BY_BOTH = [
    # A misspelt key: named, with the known key it resembles.
    ({**GUIDE, "eviction_polcy": "arc"},
     ["'eviction_polcy'", "did you mean 'eviction_policy'?"]),
    ({**GUIDE, "store_treshold": 2},
     ["'store_treshold'", "did you mean 'store_threshold'?"]),
    ({"num_cpu_blocks": 8, "blocksize": 128},
     ["'blocksize'", "did you mean 'block_size'?"]),
    ({"cpu_bytes_to_use": 8 * BLOCK, "num_cpu_block": 8},
     ["'num_cpu_block'", "did you mean 'num_cpu_blocks'?"]),
    # vLLM's canonical layout is a tiering worker's; ours store each rank's
    # KV in its device layout, so the key would be accepted and ignored
    # (refused by the guide's spec as by tiering).
    ({**GUIDE, "canonical_layout": True},
     ["['canonical_layout']=True is not supported", "remove canonical_layout"]),
    # The self-check's copy path setting, checked like every key.
    ({**GUIDE, "copy_path": "fast"},
     ["kv_connector_extra_config['copy_path']='fast' is not supported",
      "auto, native, torch"]),
] + [
    # vLLM's keys, type-checked naming key, value and fix: (key, value, fragments).
    ({**GUIDE, key: value}, [f"['{key}']", *fragments])
    for key, value, fragments in [
        ("offload_prompt_only", "false", ["='false'", "boolean", "to False"]),
        ("offload_prompt_only", 0, ["=0", "boolean", "to False"]),
        ("self_describing_kv_events", "yes", ["='yes'", "boolean", "to True"]),
        ("canonical_layout", "maybe", ["='maybe'", "boolean", "canonical_layout="]),
        ("max_tracker_size", "abc", ["='abc'", "positive integer"]),
        ("max_tracker_size", 0, ["=0", "> 0", "max_tracker_size=64000"]),
        ("store_threshold", 1.5, ["=1.5", "non-negative integer"]),
        ("sync_load_budget_bytes", -1, ["=-1", ">= 0"]),
        ("host_piece_bytes", 4096, ["=4096", ">= 65536", "=68719476736"]),
        ("host_piece_bytes", "64GiB", ["='64GiB'", "positive integer"]),
        ("eviction_policy", "fifo", ["='fifo'", "use one of lru, arc"]),
        ("cache_policy_module_path", 3, ["=3", "must be a string"]),
        ("spec_module_path", ["x"], ["=['x']", "must be a string"]),
        ("max_load_wait_ratio", "1", ["='1'", "a finite number", "=1.0"]),
        ("max_load_wait_ratio", -0.5, ["=-0.5", ">= 0", "max_load_wait_ratio=1.0"]),
        ("max_load_wait_ratio", float("inf"), ["=inf", "a finite number"]),
    ]
]  # fmt: skip


@pytest.mark.parametrize("extra, fragments", REFUSED_BY_BOTH)
def test_both_checks_refuse_bad_keys_naming_key_value_and_fix(extra, fragments):
    for message in refusals(extra):
        _assert_names(message, fragments)


def test_an_unknown_key_unlike_any_other_lists_the_known_keys():
    for message in refusals({**GUIDE, "colour": "blue"}):
        assert "'colour'" in message
        assert "num_cpu_blocks" in message and "offload_prompt_only" in message


@pytest.mark.parametrize("key", sorted(KEYS))
def test_every_known_key_refuses_a_value_of_the_wrong_type(key):
    for message in refusals({**GUIDE, key: {"a": 1}}):
        assert f"['{key}']" in message


def test_the_guides_keys_and_vllms_keys_keep_working():
    extra = {
        **GUIDE,
        "eviction_policy": "arc",
        "store_threshold": 2,
        "max_tracker_size": 100,
        "offload_prompt_only": False,
        "self_describing_kv_events": True,
        "canonical_layout": False,
        "sync_load_budget_bytes": 0,
        "copy_path": "torch",
    }
    validate_connector_config("kv_both", extra, [128])
    spec = NPUOffloadingSpec(make_config(extra))
    assert spec.num_chunks == 8 and spec.eviction_policy == "arc"
    assert spec.offload_prompt_only is False
    assert spec.kv_events_config.self_describing_kv_events is True
    manager = spec.get_manager().inner
    assert (manager.store_threshold, manager.max_tracker_size) == (2, 100)


def test_configs_of_other_specs_are_not_checked(monkeypatch):
    """Their keys are their spec's business: our connector hands them on."""

    class OtherConnector:
        def __init__(self, vllm_config, role, kv_cache_config):
            self.vllm_config = vllm_config

    monkeypatch.setattr(
        connector_module, "fallback_connector_class", lambda: OtherConnector
    )
    transfer = type("T", (), {})()
    transfer.kv_role = "kv_both"
    transfer.kv_connector_extra_config = {
        "spec_name": "CPUOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "its_own_key": "anything",
    }
    vllm_config = type("V", (), {"kv_transfer_config": transfer})()
    built = AscendOffloadingConnector(vllm_config, "worker", None)
    assert isinstance(built, OtherConnector)
