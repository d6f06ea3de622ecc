"""Keys of kv_connector_extra_config: a key that nothing reads fails at
start-up naming the known key it resembles, and every key we pass on to vLLM
is type-checked like ours (vLLM itself reads them with a bare ``int()`` or
``bool()``: ``"abc"`` fails late, ``"false"`` reads as true).

Both places that check a config at start-up refuse them: the connector
(``validate_connector_config``, before vLLM derives anything) and the spec.
"""

from __future__ import annotations

import pytest

from tests.unit.kv_helpers import BLOCK, GUIDE_EXTRA, make_config
from vllm_ascend.kv_offload import connector as connector_module
from vllm_ascend.kv_offload.config import KEYS
from vllm_ascend.kv_offload.connector import AscendOffloadingConnector
from vllm_ascend.kv_offload.npu import (
    NPUOffloadingSpec,
    OffloadConfigError,
    validate_connector_config,
)

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


@pytest.mark.parametrize(
    "extra, typo, meant",
    [
        ({**GUIDE, "eviction_polcy": "arc"}, "eviction_polcy", "eviction_policy"),
        ({**GUIDE, "store_treshold": 2}, "store_treshold", "store_threshold"),
        ({"num_cpu_blocks": 8, "blocksize": 128}, "blocksize", "block_size"),
        (
            {"cpu_bytes_to_use": 8 * BLOCK, "num_cpu_block": 8},
            "num_cpu_block",
            "num_cpu_blocks",
        ),
    ],
)
def test_a_misspelt_key_fails_naming_the_key_it_resembles(extra, typo, meant):
    for message in refusals(extra):
        assert f"'{typo}'" in message and f"did you mean '{meant}'?" in message


def test_an_unknown_key_unlike_any_other_lists_the_known_keys():
    for message in refusals({**GUIDE, "colour": "blue"}):
        assert "'colour'" in message
        assert "num_cpu_blocks" in message and "offload_prompt_only" in message


@pytest.mark.parametrize(
    "key, value, fragments",
    [
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
    ],
)
def test_vllms_keys_are_type_checked_naming_key_value_and_fix(key, value, fragments):
    for message in refusals({**GUIDE, key: value}):
        assert f"['{key}']" in message
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in {message!r}"


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
    }
    validate_connector_config("kv_both", extra, [128])
    spec = NPUOffloadingSpec(make_config(extra))
    assert spec.num_chunks == 8 and spec.eviction_policy == "arc"
    assert spec.offload_prompt_only is False
    assert spec.kv_events_config.self_describing_kv_events is True
    manager = spec.get_manager().inner
    assert (manager.store_threshold, manager.max_tracker_size) == (2, 100)


def test_canonical_layout_is_refused_by_the_guides_spec_as_by_tiering():
    """vLLM's canonical layout is a tiering worker's; ours store each rank's
    KV in its device layout, so the key would be accepted and ignored."""
    for message in refusals({**GUIDE, "canonical_layout": True}):
        assert "['canonical_layout']=True is not supported" in message
        assert "remove canonical_layout" in message


def test_a_custom_policy_module_may_name_its_own_policy():
    extra = {
        **GUIDE,
        "cache_policy_module_path": "my_package.my_policy",
        "eviction_policy": "mine",
    }
    validate_connector_config("kv_both", extra, [128])


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
