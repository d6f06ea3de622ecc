"""Generate a tiny, deterministic Qwen3 model and word-level tokenizer.

No machine in our CI can reach a model hub, so tests, the example and the
benchmarks run on a model written locally from a fixed seed. The weights are
random (``initializer_range`` is large so greedy decoding does not collapse
onto one token), which is all the offloading path needs: it moves KV bytes,
and any wrong byte changes the greedy output.

Usage::

    python -m vllm_ascend.kv_offload.testing.tiny_model [--out DIR] [--layers N] ...
    python -m vllm_ascend.kv_offload.testing.tiny_model --preset demo
    python -m vllm_ascend.kv_offload.testing.tiny_model --preset mla
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path

from filelock import FileLock


def _default_dir() -> Path:
    """``.models/`` of the checkout (editable installs); an installed package
    writes to the user's cache instead, never into site-packages."""
    env = os.environ.get("VLLM_ASCEND_TINY_MODEL_DIR")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "pyproject.toml").exists() and (checkout / "csrc").is_dir():
        return checkout / ".models" / "tiny-qwen3"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "vllm-ascend-kv-offload" / "tiny-qwen3"


DEFAULT_DIR = _default_dir()

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    # vLLM's CPU attention backend needs head_dim >= 32.
    head_dim: int = 32
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 8192
    initializer_range: float = 0.5
    seed: int = 0
    # The dtype the weights are written in, and the config's ``torch_dtype``:
    # vLLM serves a float32 checkpoint in bfloat16 by default (and warns for
    # every weight it narrows), so a model meant for the default dtype is
    # written in bfloat16. Engines that ask for float32 widen bfloat16
    # exactly, without a warning.
    dtype: str = "float32"

    def stamp(self) -> str:
        """What identifies the generated files (the dtype only when it is not
        the original float32, so older models are not regenerated)."""
        fields = asdict(self)
        if fields["dtype"] == "float32":
            del fields["dtype"]
        return json.dumps(fields, sort_keys=True)


# The model of the offline example: large enough that recomputing a 1k-2k
# token prompt on 2 CPU cores takes clearly longer than loading its KV back
# from the CPU pool (about 38 M parameters, 6 KiB of KV per token; written
# in about 10 s), written in the dtype vLLM serves it in.
DEMO_SPEC = TinyModelSpec(
    hidden_size=768,
    num_layers=6,
    num_heads=12,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=2048,
    # HF's default: activations stay O(1) through the layers.
    initializer_range=0.02,
    dtype="bfloat16",
)
DEMO_DIR = DEFAULT_DIR.parent / "demo-qwen3"


@dataclass(frozen=True)
class TinyMLASpec:
    """A tiny DeepSeek-V2-style model: multi-head latent attention (MLA),
    whose KV cache holds one latent per token, the same on every
    tensor-parallel rank (vLLM's replicated layout), and dense MLPs only.

    The latent sizes are the ones vLLM's CPU MLA backends accept (head size
    ``kv_lora_rank + qk_rope_head_dim`` = 576); its AMX backend, the one
    that keeps prefix caching on (offloading needs it), runs bfloat16 only.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4  # divisible by the tensor-parallel sizes tested (2)
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 8192
    initializer_range: float = 0.5
    seed: int = 0
    dtype: str = "bfloat16"

    def stamp(self) -> str:
        return json.dumps({"mla": asdict(self)}, sort_keys=True)


MLA_DIR = DEFAULT_DIR.parent / "tiny-deepseek-v2"


def vocabulary(vocab_size: int) -> list[str]:
    """Special tokens followed by pronounceable two-syllable pseudo-words."""
    words = ["".join(w) for w in product(_CONSONANTS, _VOWELS, _CONSONANTS, _VOWELS)]
    needed = vocab_size - len(_SPECIAL_TOKENS)
    if needed > len(words):
        raise ValueError(f"vocab_size {vocab_size} exceeds {len(words)} words")
    # A fixed stride spreads the chosen words over the alphabet.
    stride = len(words) // needed
    return list(_SPECIAL_TOKENS) + words[::stride][:needed]


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(vocabulary(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 1 << 20,
                "add_bos_token": False,
            },
            indent=2,
        )
    )


def _hf_model(spec: TinyModelSpec | TinyMLASpec):
    """The transformers model of ``spec``, with its init's weights."""
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype=spec.dtype,
    )
    if isinstance(spec, TinyMLASpec):
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        return DeepseekV2ForCausalLM(
            DeepseekV2Config(
                **common,
                num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_heads,
                kv_lora_rank=spec.kv_lora_rank,
                q_lora_rank=None,  # q_proj straight from the hidden state
                qk_nope_head_dim=spec.qk_nope_head_dim,
                qk_rope_head_dim=spec.qk_rope_head_dim,
                v_head_dim=spec.v_head_dim,
                # Every layer dense (an MLP, no experts): the smallest model.
                first_k_dense_replace=spec.num_layers,
            )
        )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(
            **common,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
        )
    )


def _write_weights(out: Path, spec: TinyModelSpec | TinyMLASpec) -> None:
    import torch

    model = _hf_model(spec)
    # Fill every parameter from our own generator so the weights depend only
    # on the seed, not on the transformers version's init scheme.
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(
                    torch.randn(param.shape, generator=gen) * spec.initializer_range
                )
    model.to(getattr(torch, spec.dtype)).save_pretrained(out, safe_serialization=True)


def ensure_demo_model(out: str | os.PathLike[str] | None = None) -> str:
    """Return the path of the example's model (``DEMO_SPEC``), generating it
    if missing or stale."""
    return ensure_tiny_model(out if out is not None else DEMO_DIR, DEMO_SPEC)


def ensure_mla_model(out: str | os.PathLike[str] | None = None) -> str:
    """Return the path of the tiny MLA model (``TinyMLASpec``), generating it
    if missing or stale."""
    return ensure_tiny_model(out if out is not None else MLA_DIR, TinyMLASpec())


def ensure_tiny_model(
    out: str | os.PathLike[str] | None = None,
    spec: TinyModelSpec | TinyMLASpec | None = None,
) -> str:
    """Return the path of the tiny model, generating it if missing or stale."""
    spec = spec or TinyModelSpec()
    out_path = Path(out) if out is not None else DEFAULT_DIR
    stamp = out_path / "tiny_model_spec.json"
    wanted = spec.stamp()
    if stamp.exists() and stamp.read_text() == wanted:
        return str(out_path)
    out_path.mkdir(parents=True, exist_ok=True)
    # One writer at a time (parallel test workers, a user's scripts): a
    # caller that waited finds the model written and leaves it alone, so no
    # model handed back is rewritten under its reader.
    with FileLock(out_path.with_name(f".{out_path.name}.lock")):
        if stamp.exists() and stamp.read_text() == wanted:
            return str(out_path)
        _write_weights(out_path, spec)
        _write_tokenizer(out_path, spec.vocab_size)
        # Written last: a half-written model is regenerated on the next call.
        stamp.write_text(wanted)
    return str(out_path)


def make_prompt(num_words: int, seed: int, vocab_size: int = 512) -> str:
    """A deterministic prompt of ``num_words`` tokens from the tiny vocabulary."""
    import random

    words = vocabulary(vocab_size)[len(_SPECIAL_TOKENS) :]
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(num_words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        choices=("tiny", "demo", "mla"),
        default="tiny",
        help="tiny: the tests' 2-layer model (default); demo: the offline "
        "example's model (DEMO_SPEC, bfloat16); mla: a 2-layer DeepSeek-V2-style "
        "MLA model (TinyMLASpec, bfloat16); the other options are ignored",
    )
    parser.add_argument("--out", default=None, help=f"default: {DEFAULT_DIR}")
    defaults = TinyModelSpec()
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden_size)
    parser.add_argument("--heads", type=int, default=defaults.num_heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.num_kv_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args()
    if args.preset == "demo":
        print(ensure_demo_model(args.out))
        return
    if args.preset == "mla":
        print(ensure_mla_model(args.out))
        return
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=2 * args.hidden,
        seed=args.seed,
    )
    print(ensure_tiny_model(args.out, spec))


if __name__ == "__main__":
    main()
