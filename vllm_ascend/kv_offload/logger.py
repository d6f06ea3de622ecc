"""Loggers of this package, as children of vLLM's ``vllm`` logger.

A record of ``vllm.vllm_ascend.kv_offload.<module>`` goes through whatever
handlers vLLM has on ``vllm`` when it is emitted, so it looks like vLLM's own
lines and follows vLLM's level, in engine processes and in-process engines
alike, even after vLLM reconfigures logging. (Copying vLLM's handlers at
import lost records once vLLM replaced them.) Not ``vllm_ascend.*``: upstream
vllm-ascend puts a handler of its own there.
"""

from __future__ import annotations

from vllm.logger import init_logger as _vllm_init_logger


def init_logger(name: str):
    """``vllm.logger.init_logger`` (``info_once`` etc.) under ``vllm.``."""
    return _vllm_init_logger(f"vllm.{name}")
