"""What the benchmarks share: the generated model's arguments, the CLI flags
for them, the load average they report beside figures, and the
one busy core ("hog") some of them run beside what they measure.

``ModelArgs`` is the command-line face of the tiny model's
``TinyModelSpec`` (``vllm_ascend.kv_offload.testing.tiny_model``): one flag
per spec field that shapes the model (``--layers`` for ``num_layers``, ...),
with benchmark-sized defaults instead of the test-sized ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ModelArgs field -> TinyModelSpec field.
SPEC_FIELDS = {
    "layers": "num_layers",
    "hidden": "hidden_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
}


@dataclass(frozen=True)
class ModelArgs:
    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    intermediate: int = 3072
    vocab: int = 512

    def spec(self, max_positions: int):
        from vllm_ascend.kv_offload.testing.tiny_model import TinyModelSpec

        return TinyModelSpec(
            **{SPEC_FIELDS[k]: v for k, v in asdict(self).items()},
            max_position_embeddings=max_positions,
            # HF's default: activations stay O(1) through the layers.
            initializer_range=0.02,
        )

    def dirname(self) -> str:
        return (
            f"bench-qwen3-{self.layers}l-{self.hidden}h-{self.heads}q"
            f"{self.kv_heads}kv-{self.head_dim}d-{self.intermediate}i"
        )

    def num_params(self) -> int:
        h, q, kv, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        attn = h * q * d * 2 + h * kv * d * 2 + 2 * d  # q, o, k, v; q/k norms
        mlp = 3 * h * self.intermediate
        return self.layers * (attn + mlp + 2 * h) + 2 * self.vocab * h + h

    def ensure(self, max_positions: int) -> str:
        """Writes the model (once) under ``REPO/.models``; returns its path."""
        from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

        return ensure_tiny_model(
            REPO / ".models" / self.dirname(), self.spec(max_positions)
        )


# bench_ttft's and bench_serving's model: recomputing 8k tokens takes
# seconds, not a minute, on 2 cores; 8 KiB of KV per token in fp32 (1 MiB per
# 128-token block), 13 M parameters.
SMALL_MODEL = ModelArgs(
    layers=4, hidden=512, heads=8, kv_heads=4, head_dim=64, intermediate=1536
)


def add_model_args(p: argparse.ArgumentParser, defaults: ModelArgs) -> None:
    """``--layers``, ``--hidden``, ... with ``defaults``' values."""
    g = p.add_argument_group("model (generated, tiny_model.TinyModelSpec)")
    for f in fields(ModelArgs):
        g.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=int,
            default=getattr(defaults, f.name),
            help=f"TinyModelSpec.{SPEC_FIELDS[f.name]}",
        )


def model_args(args: argparse.Namespace) -> ModelArgs:
    return ModelArgs(**{f.name: getattr(args, f.name) for f in fields(ModelArgs)})


def add_int_args(p: argparse.ArgumentParser, flags: dict) -> None:
    """Integer flags from ``{"name": default}`` or ``{"name": (default, help)}``."""
    for name, value in flags.items():
        default, text = value if isinstance(value, tuple) else (value, None)
        p.add_argument(f"--{name}", type=int, default=default, help=text)


def add_output_args(p: argparse.ArgumentParser, logs: str = "engine logs") -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", type=Path, default=None, help="write all raw numbers")
    p.add_argument("--log-dir", type=Path, default=None, help=logs)


def write_json(path: Path, result) -> None:
    """``result`` as indented JSON (numpy scalars as plain numbers)."""

    def plain(value):
        if hasattr(value, "item"):
            return value.item()
        raise TypeError(f"not JSON serializable: {type(value).__name__}")

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=plain))


@contextlib.contextmanager
def load_samples(period_s: float = 5.0) -> Iterator[list[tuple[float, ...]]]:
    """The load average, sampled every ``period_s`` while the ``with`` block
    runs (``with load_samples() as samples: ...``)."""
    samples: list[tuple[float, ...]] = []
    stop = threading.Event()

    def sample() -> None:
        while True:
            samples.append(os.getloadavg())
            if stop.wait(period_s):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


HOG = "import time\nend = time.time() + {}\nwhile time.time() < end: pass"


@contextlib.contextmanager
def cpu_hog(seconds: float) -> Iterator[None]:
    """One busy process (one core's worth) beside what is measured, ended on
    leaving the ``with`` block or after ``seconds`` at most."""
    proc = subprocess.Popen([sys.executable, "-c", HOG.format(seconds)])
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)
