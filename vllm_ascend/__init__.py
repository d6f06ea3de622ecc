"""vllm-ascend: KV-cache CPU offloading for vLLM on Ascend NPUs."""

__version__ = "0.1.0"
