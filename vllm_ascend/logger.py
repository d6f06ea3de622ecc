"""Loggers for vllm_ascend that print through vLLM's own handlers.

vLLM configures only the ``vllm`` logger; a logger named ``vllm_ascend.*``
would drop INFO records. ``init_logger`` attaches vLLM's handlers and level
to the ``vllm_ascend`` root once, so our messages look like vLLM's.
"""

from __future__ import annotations

import logging

from vllm.logger import init_logger as _vllm_init_logger

_ROOT = "vllm_ascend"


def _adopt_vllm_handlers() -> None:
    root = logging.getLogger(_ROOT)
    if root.handlers:
        return
    vllm_root = logging.getLogger("vllm")
    for handler in vllm_root.handlers:
        root.addHandler(handler)
    root.setLevel(vllm_root.level)
    root.propagate = False


def init_logger(name: str):
    """Like ``vllm.logger.init_logger`` (``info_once`` etc.), for our modules."""
    _adopt_vllm_handlers()
    return _vllm_init_logger(name)
