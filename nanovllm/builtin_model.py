"""Tiny random-weight models with a trained byte-level BPE tokenizer, saved in Hugging Face format.

Used by the test-suite (several architectures, a few KB each) and by `nanovllm bench`, which
creates one small Qwen3 once in a cache directory so that the engine can run end to end with no
download. Everything is deterministic for a given set of arguments: the weights come from a fixed
torch seed and the tokenizer is trained on text generated from a fixed Python seed.

Requires `transformers` and `tokenizers` (imported lazily: the rest of the package does not).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

EOS_TOKEN = "<|endoftext|>"
# Written into every model directory made here: the TinyModelSpec it was built from.
SPEC_FILE = "nanovllm_spec.json"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")

# ChatML, like Qwen's templates, minus tools.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Bump when the built-in default changes so stale cache entries are not reused.
BUILTIN_VERSION = 1
BUILTIN_NAME = f"builtin-qwen3-tiny-v{BUILTIN_VERSION}"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model. `head_dim=None` omits the key from config.json (hidden // heads)."""

    arch: str = "Qwen3ForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = 16
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # more config kwargs


# The `nanovllm bench` demo model: small enough for CPU throughput runs, big enough to be a
# meaningful workload for the scheduler (~6M parameters).
BUILTIN_SPEC = TinyModelSpec(
    arch="Qwen3ForCausalLM",
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=8192,
    rope_theta=1000000.0,
    seed=1234,
)


def default_model_dir() -> Path:
    """Where the built-in demo model lives: `$NANOVLLM_CACHE/<name>` or `~/.cache/nanovllm/<name>`."""
    root = os.environ.get("NANOVLLM_CACHE") or Path.home() / ".cache" / "nanovllm"
    return Path(root) / BUILTIN_NAME


def ensure_default_model() -> Path:
    """Create the built-in model on first use (atomically) and return its directory."""
    path = default_model_dir()
    if not (path / "config.json").is_file():
        create_model_dir(path, spec=BUILTIN_SPEC, keep_existing=True)
    return path


def create_model_dir(
    path: str | Path,
    arch: str = "Qwen3ForCausalLM",
    *,
    spec: TinyModelSpec | None = None,
    keep_existing: bool = False,
    dtype: torch.dtype = torch.float32,
    tokenizer_vocab: int | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-weight model (`config.json`, `model.safetensors`) and tokenizer to `path`.

    `spec` gives the full shape; otherwise `TinyModelSpec(arch=arch, **overrides)`. Weights are
    stored in `dtype`; the tokenizer has `tokenizer_vocab` entries (default: the model's vocab).
    The directory is built under a temporary name and renamed into place, so a crash never leaves
    a half-written model that a later run would try to load; `SPEC_FILE` in it records the spec. An existing `path` is replaced, unless `keep_existing` (then a complete model another
    process finished first is kept as is).
    """
    spec = spec or TinyModelSpec(arch=arch, **overrides)
    path = Path(path)
    with staged_model_dir(path, keep_existing) as tmp:
        tokenizer = build_tokenizer(tokenizer_vocab or spec.vocab_size, spec.seed)
        tokenizer.save_pretrained(tmp)
        eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        model = build_hf_model(spec, eos_token_id=eos_id)
        if dtype != torch.float32:
            model = model.to(dtype)
            model.config.torch_dtype = dtype
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2, sort_keys=True))
    return path


@contextmanager
def staged_model_dir(path: Path, keep_existing: bool = False) -> Iterator[Path]:
    """A temporary directory beside `path` to write a model into: renamed to `path` when the block
    ends (replacing what is there, unless `keep_existing` and a complete model is there: then
    dropped), removed if the block fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if keep_existing and (path / "config.json").is_file():
            shutil.rmtree(tmp)
            return
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_hf_model(spec: TinyModelSpec, eos_token_id: int) -> Any:
    """The transformers model for `spec`, random weights from `spec.seed`, fp32."""
    import transformers

    archs = {
        "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
        "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM"),
        "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM"),
        "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM"),
        "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "MixtralForCausalLM": ("MixtralConfig", "MixtralForCausalLM"),
    }
    if spec.arch not in archs:
        raise ValueError(
            f"unsupported tiny model architecture {spec.arch!r}; supported: {sorted(archs)}"
        )
    config_cls = getattr(transformers, archs[spec.arch][0])
    model_cls = getattr(transformers, archs[spec.arch][1])
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=eos_token_id,
        **spec.extra,
    )
    if spec.head_dim is not None:
        kwargs["head_dim"] = spec.head_dim
    if spec.rope_scaling is not None:
        kwargs["rope_scaling"] = dict(spec.rope_scaling)
    if spec.arch not in ("Qwen2ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"):  # fixed biases or none
        kwargs["attention_bias"] = spec.attention_bias
    config = config_cls(**kwargs)
    config.architectures = [spec.arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = model_cls(config).to(torch.float32).eval()
        # HF initializes norms to 1 and biases to 0; randomize them so the tests can see
        # a norm weight or bias loaded into the wrong place.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(
                        1.0 + 0.1 * torch.randn_like(p)
                        if "norm" in name
                        else 0.1 * torch.randn_like(p)
                    )
    return model


def train_bpe_json(texts: Iterable[str], vocab_size: int) -> str:
    """The project's tokenizer recipe, trained on `texts`: byte-level BPE with `vocab_size` tokens,
    the special tokens first (`<|endoftext|>` is id 0), as a tokenizers JSON string."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} for a byte-level BPE"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # A small corpus can run out of merges; fill up with reserved tokens (as real models do) so
    # the tokenizer's size equals the model's vocab_size and every id decodes.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return tok.to_str()


@lru_cache(maxsize=8)
def _train_tokenizer_json(vocab_size: int, seed: int) -> str:
    return train_bpe_json(_corpus(seed), vocab_size)


def tokenizer_from_json(tokenizer_json: str) -> Any:
    """A `PreTrainedTokenizerFast` over a tokenizers JSON string, with EOS `<|endoftext|>` and the
    chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(tokenizer_json)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tokenizer(vocab_size: int, seed: int = 0) -> Any:
    """A `PreTrainedTokenizerFast` with `vocab_size` tokens, EOS `<|endoftext|>` and a chat template,
    trained on pseudo-text from `seed`."""
    return tokenizer_from_json(_train_tokenizer_json(vocab_size, seed))


_SYLLABLES = [
    "a",
    "e",
    "i",
    "o",
    "u",
    "ka",
    "to",
    "ri",
    "mu",
    "ne",
    "sha",
    "lo",
    "qui",
    "ber",
    "dan",
    "fel",
    "gor",
    "hin",
    "jas",
    "vor",
    "zel",
    "pa",
    "te",
    "lu",
    "ox",
    "th",
    "ing",
    "er",
    "an",
    "st",
    "re",
    "co",
    "de",
    "pro",
    "tion",
    "ment",
    "al",
    "ly",
    "the",
    "and",
    "of",
    "in",
    "is",
    "it",
    "for",
    "on",
    "with",
    "as",
    "be",
    "at",
    "by",
    "this",
    "that",
]


def _corpus(seed: int, num_lines: int = 4000) -> list[str]:
    """Deterministic pseudo-text: made-up words, digits, punctuation and some code-like lines."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(4000)]
    lines = []
    for i in range(num_lines):
        n = rng.randint(4, 24)
        text = " ".join(rng.choice(words) for _ in range(n))
        if i % 7 == 0:
            text = text.capitalize() + f" {rng.randint(0, 99999)}"
        if i % 11 == 0:
            text = f"def {rng.choice(words)}(x):\n    return x + {rng.randint(0, 9)}"
        lines.append(text + rng.choice([".", "!", "?", ",", ";", ":"]))
    return lines
