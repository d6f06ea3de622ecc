"""The keys of ``kv_connector_extra_config``: which exist, and their types.

A config naming our spec may hold the Ascend guide's keys, vLLM's own
offloading keys (which vLLM reads with a bare ``int()`` or ``bool()``, so
``"abc"`` fails late and ``"false"`` reads as true) and nothing else: a key
that nothing reads is a typo (``eviction_polcy`` would silently run LRU).
Each spec declares the keys it accepts (``extra_config_keys``); ``check_keys``
refuses any other key and a value of the wrong type at start-up, naming the
key, the value and the fix. This module imports nothing of this package.
vLLM's keys are those vLLM 0.30-0.33 read for ``OffloadingConnector`` with
a ``CPUOffloadingSpec``-derived spec (``vllm/v1/kv_offload/`` and
``vllm/distributed/kv_transfer/kv_connector/v1/offloading*``).

What the values mean together is checked in three places, because each sees
different things: the connector (``validate_connector_config``) sees
``kv_role`` and the device block size before vLLM derives the chunk size; the
spec (``resolve_extra_config``) sees the size of a KV block; the spec's worker
side, right before it allocates the pool, sees the host memory left after
vLLM's own allocations and the other workers' pools on the host
(``host_guard``, ``host_ledger``).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.utils.math_utils import round_up
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from vllm_ascend.kv_offload.replication import stored_copies

PREFIX = "kv_connector_extra_config"


class OffloadConfigError(ValueError):
    """A KV offloading setting that offloading cannot use."""


@dataclass(frozen=True)
class Key:
    kind: type  # int, float, bool, str; list or dict (tiering's)
    example: Any  # a valid value, for the fix in the message
    minimum: int = 1  # ints and floats only
    choices: tuple[str, ...] = ()  # strs only; () = any
    read_by: str = ""  # the one spec (and its subclasses) that reads it


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
    # Ours: how the worker copies (self_check.py): "auto" tries the native op
    # first, then the torch path; "native" / "torch" allow that one only.
    "copy_path": Key(str, "auto", choices=("auto", "native", "torch")),
    # Ours: the most bytes of the CPU pool one host allocation or
    # registration takes (host_pieces.py); runtimes refuse larger ones.
    "host_piece_bytes": Key(int, 64 * 2**30, minimum=64 * 2**10),
    # Ours: a CPU hit whose copies would take longer than this many times
    # recomputing its tokens is recomputed (load_wait.py); 0: waits unbounded.
    "max_load_wait_ratio": Key(float, 1.0, minimum=0),
    # vLLM's tiering, read by NPUTieringOffloadingSpec only (tiering/spec.py
    # checks what is inside them).
    "secondary_tiers": Key(
        list,
        [{"type": "fs", "root_dir": "/mnt/shared/kv"}],
        read_by="NPUTieringOffloadingSpec",
    ),
    "backpressure": Key(
        dict,
        {"backpressure_cls": "EMABackpressureDetector"},
        read_by="NPUTieringOffloadingSpec",
    ),
}
TIERING_SPEC = "NPUTieringOffloadingSpec"
TIERING_MODULE = "vllm_ascend.kv_offload.tiering"
# Where a spec that reads a key lives, for the fix in the message.
_SPEC_MODULES = {TIERING_SPEC: TIERING_MODULE}
# The keys every spec of ours reads (NPUOffloadingSpec's), and tiering's own.
SPEC_KEYS = frozenset(k for k, key in KEYS.items() if not key.read_by)
TIERING_KEYS = frozenset(k for k, key in KEYS.items() if key.read_by == TIERING_SPEC)

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
        kind = "a non-negative" if spec.minimum == 0 else "a positive"
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


def float_setting(extra: Mapping[str, Any], key: str) -> float | None:
    """``extra[key]`` as a finite number >= the key's minimum, None if absent."""
    value = extra.get(key)
    if value is None:
        return None
    spec = KEYS[key]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and math.isfinite(value) and value >= spec.minimum:
        return float(value)
    raise OffloadConfigError(
        f"{PREFIX}['{key}']={shown(value)} must be a finite number >= "
        f"{spec.minimum} (a JSON number, not a string); set it to e.g. "
        f"{key}={spec.example}"
    )


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
    # A custom policy module may define eviction policies of its own.
    custom = key == "eviction_policy" and extra.get("cache_policy_module_path")
    if choices and not custom and value not in choices:
        raise OffloadConfigError(
            f"{PREFIX}['{key}']={shown(value)} is not supported; use one "
            f"of {', '.join(choices)}"
        )
    if not isinstance(value, str):  # a choice is a string
        raise OffloadConfigError(
            f"{PREFIX}['{key}']={shown(value)} must be a string; set it to e.g. "
            f"{key}={KEYS[key].example!r}"
        )


def check_keys(extra: Mapping[str, Any], accepted: Collection[str] = SPEC_KEYS) -> None:
    """Refuses a key outside ``accepted`` (the spec's ``extra_config_keys``)
    and a value of the wrong type.

    ``None`` counts as absent for every key (vLLM reads them with ``get``).
    """
    for key in extra:
        if key not in KEYS:
            raise _unknown_key_error(str(key))
        if key not in accepted:
            spec = KEYS[key].read_by
            raise OffloadConfigError(
                f"{PREFIX}['{key}'] is read by {spec} only (or a subclass of it); "
                f"set spec_name='{spec}' and spec_module_path="
                f"'{_SPEC_MODULES[spec]}', or remove the key"
            )
    for key, value in extra.items():
        if value is None:
            continue
        kind = KEYS[key].kind
        if kind is int:
            int_setting(extra, key)
        elif kind is float:
            float_setting(extra, key)
        elif kind is bool:
            _check_bool(key, value)
        elif kind in (list, dict):
            if not isinstance(value, kind):
                raise OffloadConfigError(
                    f"{PREFIX}['{key}']={shown(value)} must be a {kind.__name__}, "
                    f"e.g. {key}={KEYS[key].example!r}"
                )
        else:
            _check_str(key, value, extra)
    if extra.get("canonical_layout"):
        raise OffloadConfigError(
            f"{PREFIX}['canonical_layout']={extra['canonical_layout']!r} is not "
            "supported: this package's workers store each rank's KV in its own "
            "device layout (a CPU block or file is reusable only by an identical "
            "deployment); remove canonical_layout"
        )


KV_ROLE = "kv_both"
# Far beyond any host; catches typos (an extra digit group) even before the
# size of a block is known.
MAX_CPU_BLOCKS = 2**31 - 1


def validate_connector_config(
    kv_role: str | None,
    extra: dict[str, Any],
    device_block_sizes: Iterable[int],
    accepted: Collection[str] = SPEC_KEYS,
) -> None:
    """Checks the connector can run before vLLM derives its chunk size.

    ``device_block_sizes``: tokens per device block of the offloaded KV cache
    groups; ``accepted``: the spec's ``extra_config_keys``. vLLM itself would
    fail on some of these later, with an assertion or a bare ``int()`` error;
    here each fails with its key and its fix.
    """
    check_keys(extra, accepted)
    if kv_role != KV_ROLE:
        raise OffloadConfigError(
            f"kv_transfer_config.kv_role={kv_role!r} cannot be used with "
            f"OffloadingConnector, which both stores KV to the CPU and loads it "
            f"back; set kv_role='{KV_ROLE}' (in a MultiConnector: in the "
            "OffloadingConnector entry of its 'connectors', whatever the "
            "node's P/D role)"
        )
    block_size = int_setting(extra, "block_size")
    blocks_per_chunk = int_setting(extra, "blocks_per_chunk")
    if block_size is not None and blocks_per_chunk is not None:
        raise OffloadConfigError(
            f"{PREFIX} sets both block_size={block_size} and "
            f"blocks_per_chunk={blocks_per_chunk}, which say the same thing in "
            "tokens and in device blocks; set only one of them"
        )
    sizes = sorted(set(device_block_sizes))
    if block_size is None or not sizes:
        return
    if len(sizes) > 1:
        raise OffloadConfigError(
            f"{PREFIX}['block_size']={block_size} needs one device block size, "
            f"but the offloaded KV cache groups use {sizes} tokens per block; "
            "drop block_size and set blocks_per_chunk (device blocks per CPU "
            "block) instead"
        )
    device = sizes[0]
    if block_size % device:
        lower = block_size // device * device
        fix = f"set block_size to {round_up(block_size, device)}"
        if lower > 0:
            fix += f" or {lower}"
        raise OffloadConfigError(
            f"{PREFIX}['block_size']={block_size} must be a multiple of the "
            f"device KV cache block size ({device} tokens); {fix}"
        )


def cpu_block_bytes(config: OffloadingConfig) -> int:
    """Bytes of one CPU block, as vLLM's spec sizes it: every worker's KV,
    or one copy where the layout is replicated (``replication``), padded."""
    copies = stored_copies(config.parallel.world_size, config.replicated_layout)
    kv_bytes = config.worker_kv_bytes_per_block * copies * config.cache.blocks_per_chunk
    return round_up(kv_bytes, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)


def resolve_extra_config(
    config: OffloadingConfig, accepted: Collection[str] = SPEC_KEYS
) -> tuple[dict[str, Any], int | None]:
    """Validate the offloading keys (``accepted``: the spec's
    ``extra_config_keys``) and express the pool size in bytes.

    Returns vLLM-native extra config (``cpu_bytes_to_use`` always set) and the
    guide's ``num_cpu_blocks`` if it was given.
    """
    given = config.extra_config
    check_keys(given, accepted)
    extra = dict(given)
    num_cpu_blocks = int_setting(extra, "num_cpu_blocks")
    cpu_bytes = int_setting(extra, "cpu_bytes_to_use")
    block_bytes = cpu_block_bytes(config)

    if num_cpu_blocks is None and cpu_bytes is None:
        raise OffloadConfigError(
            f"{PREFIX} needs the CPU pool size: set 'num_cpu_blocks' (CPU "
            "blocks of 'block_size' tokens, e.g. 1000) or 'cpu_bytes_to_use' "
            "(bytes)"
        )
    if num_cpu_blocks is not None and num_cpu_blocks > MAX_CPU_BLOCKS:
        raise OffloadConfigError(
            f"{PREFIX}['num_cpu_blocks']={shown(given['num_cpu_blocks'])} is not "
            f"a plausible pool size (at most {MAX_CPU_BLOCKS}); lower "
            "num_cpu_blocks to what host memory holds, e.g. 1000"
        )
    if block_bytes > 0 and num_cpu_blocks is not None and cpu_bytes is not None:
        if cpu_bytes // block_bytes != num_cpu_blocks:
            raise OffloadConfigError(
                f"{PREFIX} sets num_cpu_blocks={num_cpu_blocks} and "
                f"cpu_bytes_to_use={shown(given['cpu_bytes_to_use'])}, which "
                f"hold {shown(cpu_bytes // block_bytes)} blocks of {block_bytes} "
                "bytes; set only one of them"
            )
    elif block_bytes > 0 and cpu_bytes is not None:  # cpu_bytes_to_use alone
        if cpu_bytes < block_bytes:
            raise OffloadConfigError(
                f"{PREFIX}['cpu_bytes_to_use']={shown(given['cpu_bytes_to_use'])} "
                f"holds no CPU block ({block_bytes} bytes each); set "
                f"cpu_bytes_to_use to at least {block_bytes}, or num_cpu_blocks "
                "instead"
            )
        if cpu_bytes // block_bytes > MAX_CPU_BLOCKS:
            raise OffloadConfigError(
                f"{PREFIX}['cpu_bytes_to_use']={shown(given['cpu_bytes_to_use'])} "
                f"is not a plausible pool size (more than {MAX_CPU_BLOCKS} blocks "
                f"of {block_bytes} bytes); lower cpu_bytes_to_use to what host "
                "memory holds"
            )
    if num_cpu_blocks is not None and cpu_bytes is None:
        # vLLM's spec insists on a non-zero byte count even before the KV
        # cache exists (block_bytes == 0); the block count below wins anyway.
        extra["cpu_bytes_to_use"] = num_cpu_blocks * max(block_bytes, 1)
    return extra, num_cpu_blocks
