"""``vllm.general_plugins`` hook: which class serves ``OffloadingConnector``.

The guide's config names ``kv_connector="OffloadingConnector"`` and our spec
(``spec_module_path: vllm_ascend.kv_offload.npu``). That config must get our
connector variant (``connector.AscendOffloadingConnector``), and every other
offloading config must keep the connector it had without us: vLLM's own, or
upstream vllm-ascend's when its general plugin replaced vLLM's.

Two things make that independent of the order in which vLLM runs general
plugins (entry-point discovery order, i.e. file-system order):

* ``register`` files our class under the name and keeps the class it
  replaces as the *fallback*. Our class, when the config's spec is not ours,
  constructs the fallback instead (``AscendOffloadingConnector.__new__``).
* upstream's plugin replaces the name unconditionally. If it runs after us it
  would drop ours, so ``register`` wraps upstream's ``register_connector``
  once: upstream registers first, then we take the name again with upstream's
  class as the fallback.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from vllm_ascend.kv_offload import __version__, cpu_threads, upstream_guard, vllm_compat

CONNECTOR_NAME = "OffloadingConnector"
_CONNECTOR_MODULE = "vllm_ascend.kv_offload.connector"
_CONNECTOR_CLASS = "AscendOffloadingConnector"
# Upstream vllm-ascend (>= 0.30) registers its connectors here.
UPSTREAM_REGISTRATION_MODULE = "vllm_ascend.distributed.kv_transfer"
_FOLLOWS_MARK = "_kv_offload_registers_after"

# Loader of the class that served CONNECTOR_NAME before us (None: vLLM's).
_fallback_loader: Callable[[], type] | None = None


def _our_loader() -> type:
    module = importlib.import_module(_CONNECTOR_MODULE)
    return getattr(module, _CONNECTOR_CLASS)


setattr(_our_loader, _FOLLOWS_MARK, True)


def _claim_connector_name() -> None:
    """Files our class under CONNECTOR_NAME; remembers what it replaces.

    And under its own name: vLLM's ``MultiConnector`` sends each child's
    stats to the front end under the child's class name and rebuilds them
    there by looking that name up in the registry; without this entry the
    first stats of an engine whose MultiConnector holds our connector end it
    ("Connector 'AscendOffloadingConnector' is not registered")."""
    global _fallback_loader
    previous = vllm_compat.replace_connector_loader(CONNECTOR_NAME, _our_loader)
    if previous is not None and not getattr(previous, _FOLLOWS_MARK, False):
        _fallback_loader = previous
    vllm_compat.replace_connector_loader(_CONNECTOR_CLASS, _our_loader)


def _follow_upstream_registration() -> None:
    """Makes upstream's ``register_connector`` re-claim the name after it."""
    try:
        upstream = importlib.import_module(UPSTREAM_REGISTRATION_MODULE)
    except ImportError:  # no upstream vllm-ascend (ModuleNotFoundError)
        return
    # Every vllm-ascend this runs next to (>= 0.30; older ones are refused)
    # has it: checked on 0.30.0rc2.
    original = upstream.register_connector
    if getattr(original, _FOLLOWS_MARK, False):  # wrapped already
        return

    @functools.wraps(original)
    def register_connector_then_kv_offload(*args, **kwargs):
        result = original(*args, **kwargs)
        _claim_connector_name()
        return result

    setattr(register_connector_then_kv_offload, _FOLLOWS_MARK, True)
    upstream.register_connector = register_connector_then_kv_offload


def register() -> None:
    """Entry point ``ascend_kv_offload``; idempotent (vLLM may call it again).

    First refuses an upstream vllm-ascend that owns this subtree
    (``upstream_guard``). Also makes vLLM's CPU-backend core
    reservation leave a core to compute on (``cpu_threads.apply``): this entry
    point runs before vLLM starts the engine-core process that reads it.
    """
    upstream_guard.refuse_conflicting_upstream(__version__)
    _claim_connector_name()
    _follow_upstream_registration()
    cpu_threads.apply()


def fallback_connector_class() -> type | None:
    """The class that served CONNECTOR_NAME before us (None: vLLM's own)."""
    return _fallback_loader() if _fallback_loader is not None else None
