"""The installed vLLM release as (major, minor).

For the few tests whose expectation is vLLM's own behaviour, which changed
within the supported window (0.30-0.32).
"""

from __future__ import annotations

import vllm
from packaging.version import Version

VLLM_VERSION: tuple[int, int] = Version(vllm.__version__).release[:2]  # type: ignore[assignment]
