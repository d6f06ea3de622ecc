"""The keys of ``kv_connector_extra_config``: which exist, and their types.

A config naming our spec may hold the Ascend guide's keys, vLLM's own
offloading keys (which vLLM reads with a bare ``int()`` or ``bool()``, so
``"abc"`` fails late and ``"false"`` reads as true) and nothing else: a key
that nothing reads is a typo (``eviction_polcy`` would silently run LRU).
``check_keys`` refuses both at start-up, naming the key, the value and the
fix. vLLM's keys are those vLLM 0.30-0.33 read for ``OffloadingConnector``
with a ``CPUOffloadingSpec``-derived spec (``vllm/v1/kv_offload/`` and
``vllm/distributed/kv_transfer/kv_connector/v1/offloading*``).

Values only: what a value means for the pool (sizes, block sizes, memory) is
checked by ``npu.py``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "kv_connector_extra_config"


class OffloadConfigError(ValueError):
    """A KV offloading setting that offloading cannot use."""


@dataclass(frozen=True)
class Key:
    kind: type  # int, bool or str
    example: Any  # a valid value, for the fix in the message
    minimum: int = 1  # ints only
    choices: tuple[str, ...] = ()  # strs only; () = any


KEYS: dict[str, Key] = {
    # The Ascend guide's.
    "num_cpu_blocks": Key(int, 1000),
    "block_size": Key(int, 128),
    "spec_name": Key(str, "NPUOffloadingSpec"),
    "spec_module_path": Key(str, "vllm_ascend.kv_offload.npu"),
    # vLLM's, passed on to its spec, manager and connector.
    "cpu_bytes_to_use": Key(int, 4 * 2**30),
    "blocks_per_chunk": Key(int, 1),
    # Any name a custom policy (cache_policy_module_path) knows, else these.
    "eviction_policy": Key(str, "lru", choices=("lru", "arc")),
    "cache_policy_module_path": Key(str, "my_package.my_policy"),
    "store_threshold": Key(int, 2, minimum=0),
    "max_tracker_size": Key(int, 64_000),
    "offload_prompt_only": Key(bool, True),
    "self_describing_kv_events": Key(bool, False),
    "canonical_layout": Key(bool, False),
    # vLLM 0.33's: bytes of synchronous loads per step (0: none).
    "sync_load_budget_bytes": Key(int, 0, minimum=0),
}

_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False}
# Beyond this many digits a number is shown in scientific notation: a
# 300-digit echo of the user's 1e300 helps nobody.
_MAX_DIGITS = 18


def shown(value: Any) -> str:
    """``repr`` of a user's value, huge numbers as ``1.00e+300``."""
    if isinstance(value, int) and not isinstance(value, bool):
        digits = str(abs(value))
        if len(digits) > _MAX_DIGITS:
            sign = "-" if value < 0 else ""
            return f"{sign}{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unknown_key_error(key: str) -> OffloadConfigError:
    close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6)
    fix = (
        f"did you mean '{close[0]}'?"
        if close
        else f"the keys are {', '.join(sorted(KEYS))}"
    )
    return OffloadConfigError(
        f"{PREFIX} has the key {key!r}, which KV offloading does not read; "
        f"{fix} (remove keys that are not meant for it)"
    )


def int_setting(extra: Mapping[str, Any], key: str) -> int | None:
    """``extra[key]`` as an int >= the key's minimum, None if absent."""
    value = extra.get(key)
    if value is None:
        return None
    spec = KEYS[key]
    example = f"{key}={spec.example}"
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        kind = "a positive" if spec.minimum == 1 else "a non-negative"
        raise OffloadConfigError(
            f"{PREFIX}['{key}']={shown(value)} must be {kind} integer (a JSON "
            f"number, not a string); set it to e.g. {example}"
        )
    if value < spec.minimum:
        bound = "> 0" if spec.minimum == 1 else f">= {spec.minimum}"
        raise OffloadConfigError(
            f"{PREFIX}['{key}']={shown(value)} must be {bound}; set it to e.g. "
            f"{example}"
        )
    return int(value)


def _check_bool(key: str, value: Any) -> None:
    if isinstance(value, bool):
        return
    meant = _BOOL_WORDS.get(str(value).strip().lower())
    fix = f"set {key} to {meant}" if meant is not None else f"set e.g. {key}=True"
    raise OffloadConfigError(
        f"{PREFIX}['{key}']={shown(value)} must be a boolean (true/false in "
        f"JSON, True/False in Python), not {type(value).__name__}; {fix}"
    )


def _check_str(key: str, value: Any, extra: Mapping[str, Any]) -> None:
    choices = KEYS[key].choices
    if choices and extra.get("cache_policy_module_path") is None:
        if value not in choices:
            raise OffloadConfigError(
                f"{PREFIX}['{key}']={shown(value)} is not supported; use one "
                f"of {', '.join(choices)}"
            )
        return
    if isinstance(value, str):
        return
    raise OffloadConfigError(
        f"{PREFIX}['{key}']={shown(value)} must be a string; set it to e.g. "
        f"{key}={KEYS[key].example!r}"
    )


def check_keys(extra: Mapping[str, Any]) -> None:
    """Refuses a key nothing reads and a value of the wrong type.

    ``None`` counts as absent for every key (vLLM reads them with ``get``).
    """
    for key in extra:
        if key not in KEYS:
            raise _unknown_key_error(str(key))
    for key, value in extra.items():
        if value is None:
            continue
        kind = KEYS[key].kind
        if kind is int:
            int_setting(extra, key)
        elif kind is bool:
            _check_bool(key, value)
        else:
            _check_str(key, value, extra)
