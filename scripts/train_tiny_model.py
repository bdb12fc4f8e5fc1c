"""Train `builtin-code`, the small code model shipped with nanovllm, and its 1-layer draft.

    python scripts/train_tiny_model.py     # the shipped models: ~9 minutes on 2 unshared cores

Data: the `.py` files of this Python's standard library (nanovllm.builtin_code.stdlib_sources:
tests, installed packages, the IDE, demos and generated tables left out), sorted; one file in 16,
chosen by a fixed rule on its path (`is_heldout`), is kept out of training and only evaluated on.
The training files are tokenized, each followed by `<|endoftext|>`, into one stream; every step
reads `--batch-size` windows of `--seq-len` tokens at offsets drawn from a seeded generator.

Tokenizer: the project's recipe (nanovllm.builtin_model.train_bpe_json: byte-level BPE, 4096
tokens, the same special tokens, EOS `<|endoftext|>`, the ChatML template), trained here on the
training files instead of the built-in tokenizer's pseudo-text: that one reads Python source at
~1.45 characters per token, which would spend most of the model's context and of the training
budget on fragments of words; trained on the library it reads ~3.5 (both on the held-out files;
the script prints them). Target and draft share it.

Models (transformers' Qwen3ForCausalLM, built by nanovllm.builtin_model.build_hf_model): the
target has 4 layers, hidden 256, 8 query / 4 KV heads of 32, MLP 512, tied embeddings; the draft 1
layer, hidden 128, 4 / 2 heads of 32, MLP 384, trained to match the target's next-token
distribution (soft cross-entropy against the target's probabilities), which is what a draft is
for: proposing the tokens the target would pick. Both are plain AdamW runs (linear warmup,
cosine decay, gradient clipping) on small batches (the budget allows few steps, and early in
training a step counts more than its tokens: after the same 245k tokens, 120 steps of 4 windows
reached a held-out loss of 6.21, 60 steps of 8 windows 6.50; peak learning rates of 1e-2 and
1.5e-3 did no better than 3e-3) on fp32 weights, computing in bf16 (autocast) where the CPU has
bf16 instructions (1.25x faster here; elsewhere bf16 is emulated and slower than fp32, so fp32:
`--autocast`). Both are saved in bf16; their held-out losses are measured on the bf16 weights, as
shipped.

Deterministic: fixed seeds, fixed data order, `torch.set_num_threads(--threads)`: the same command
on the same machine and Python gives the same weights (another CPU's kernels or another Python's
library give other, equally good ones): torch's CPU kernels are deterministic for a fixed thread
count (a second run of the shipped command wrote byte-identical weights and tokenizer;
`torch.use_deterministic_algorithms` is not needed and cost 15-40% here).
Writes `<out>/code` and `<out>/code-draft` (Hugging Face directories: config.json,
model.safetensors, the tokenizer), the split (`stdlib_split.json`) and the run's record
(`training.json`) beside the target.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nanovllm.builtin_code import (
    HELDOUT_MODULUS,
    SPLIT_FILE,
    builtin_code_dir,
    builtin_code_draft_dir,
    stdlib_root,
    stdlib_sources,
)
from nanovllm.builtin_model import (
    EOS_TOKEN,
    TinyModelSpec,
    build_hf_model,
    build_tokenizer,
    staged_model_dir,
    tokenizer_from_json,
    train_bpe_json,
)
from nanovllm.cpu.features import native_bf16

VOCAB_SIZE = 4096
TARGET_SPEC = TinyModelSpec(
    arch="Qwen3ForCausalLM", vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096, rope_theta=10000.0,
    tie_word_embeddings=True, seed=20,
)
DRAFT_SPEC = TinyModelSpec(
    arch="Qwen3ForCausalLM", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=10000.0,
    tie_word_embeddings=True, seed=21,
)
EVAL_WINDOWS_DURING = 24  # held-out windows scored at each --eval-every (--eval-windows at the end)


@dataclass(frozen=True)
class RunResult:
    steps: int
    seconds: float
    train_loss: float  # mean over the last --log-every steps
    heldout_loss: float  # next-token cross-entropy on the held-out files, bf16 weights, nats per token
    heldout_agreement: float | None = None  # the draft: how often its top token is the target's


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--target-steps", type=int, default=800, help="target optimizer steps (default: %(default)s)")
    ap.add_argument("--draft-steps", type=int, default=500, help="draft optimizer steps (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=4, help="windows per step (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per window (default: %(default)s)")
    ap.add_argument("--target-lr", type=float, default=3e-3, help="target peak learning rate (default: %(default)s)")
    ap.add_argument("--draft-lr", type=float, default=4e-3, help="draft peak learning rate (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="data order seed (default: %(default)s)")
    ap.add_argument("--autocast", choices=["auto", "bf16", "off"], default="auto",
                    help="compute in bf16 while training: auto = where the CPU has bf16 instructions "
                         "(default: %(default)s)")
    ap.add_argument("--log-every", type=int, default=20, help="print the loss every N steps (default: %(default)s)")
    ap.add_argument("--eval-every", type=int, default=100,
                    help="score a few held-out windows every N steps (default: %(default)s)")
    ap.add_argument("--eval-windows", type=int, default=128,
                    help="held-out windows, spread evenly over the held-out files, scored at the end "
                         "(default: %(default)s)")
    ap.add_argument("--out", type=Path, default=builtin_code_dir().parent,
                    help="write code/ and code-draft/ here (default: the package's, %(default)s)")
    return ap.parse_args()


def read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def token_stream(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """The texts' tokens, each text followed by EOS, as one int64 tensor."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def heldout_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The held-out stream cut into non-overlapping windows of seq_len + 1 tokens (the tail dropped)."""
    n = (len(stream) - 1) // seq_len
    return torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def spread(windows: torch.Tensor, count: int) -> torch.Tensor:
    """At most `count` of the windows, evenly spaced (so every part of the held-out files counts)."""
    return windows[torch.linspace(0, len(windows) - 1, min(count, len(windows))).round().long().unique()]


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 5% of the steps, then cosine decay to a tenth of the peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW, with weight decay on the matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def logits_of(model: torch.nn.Module, windows: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(input_ids=windows[:, :-1]).logits.float()


def cross_entropy(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8) -> tuple[float, torch.Tensor]:
    """Mean next-token cross-entropy on `windows` (fp32), and the model's top token at each position."""
    was_training = model.training
    model.eval()
    loss_sum, top = 0.0, []
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        logits = logits_of(model, w)
        loss_sum += cross_entropy(logits, w).item() * w[:, 1:].numel()
        top.append(logits.argmax(-1))
    model.train(was_training)
    return loss_sum / windows[:, 1:].numel(), torch.cat(top)


def train(name: str, model: torch.nn.Module, stream: torch.Tensor, heldout: torch.Tensor, args: argparse.Namespace,
          steps: int, lr: float, teacher: torch.nn.Module | None = None) -> tuple[float, float]:
    """`steps` AdamW steps on windows of `stream` drawn from a generator seeded with --seed: on
    the next tokens, or with a teacher on its next-token distribution. Returns the seconds taken and
    the mean training loss of the last --log-every steps."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = optimizer(model, lr)
    span = torch.arange(args.seq_len + 1)
    probe = spread(heldout, EVAL_WINDOWS_DURING)
    model.train()
    start, recent = time.perf_counter(), []
    print(f"\n[{name}] {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {steps} steps of "
          f"{args.batch_size} x {args.seq_len} tokens, peak lr {lr}, {'bf16 autocast' if args.bf16 else 'fp32'}",
          flush=True)
    for step in range(steps):
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
        windows = stream[starts[:, None] + span]
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        logits = logits_of(model, windows, args.bf16)
        if teacher is None:
            loss = cross_entropy(logits, windows)
        else:
            with torch.no_grad():
                target = F.softmax(logits_of(teacher, windows, args.bf16), dim=-1)
            loss = -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-args.log_every:]
        done = step + 1
        if done % args.log_every == 0 or done == steps:
            elapsed = time.perf_counter() - start
            line = (f"[{name}] step {done:4d}/{steps}  train loss {sum(recent) / len(recent):.3f}  "
                    f"lr {learning_rate(step, steps, lr):.2e}  {elapsed:6.1f}s  "
                    f"{done * args.batch_size * args.seq_len / elapsed:,.0f} tok/s")
            if done % args.eval_every == 0 and done != steps:
                line += f"  held-out loss {evaluate(model, probe)[0]:.3f} ({len(probe)} windows)"
            print(line, flush=True)
    return time.perf_counter() - start, sum(recent) / len(recent)


def as_shipped(model: torch.nn.Module) -> torch.nn.Module:
    """The model with bf16-rounded weights, as saved (held in fp32 for evaluation)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def save(model: torch.nn.Module, spec: TinyModelSpec, tokenizer: Any, path: Path) -> None:
    """A Hugging Face directory with bf16 weights and the tokenizer, written beside `path` and
    renamed into place."""
    with staged_model_dir(path) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # transformers v4's key too (v5 writes `rope_parameters`): the package supports both.
        config = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
        config.setdefault("rope_theta", spec.rope_theta)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    args.bf16 = args.autocast == "bf16" or (args.autocast == "auto" and native_bf16())
    began = time.perf_counter()

    root = stdlib_root()
    train_files, heldout_files = stdlib_sources(root)
    train_texts = [read_source(root / p) for p in train_files]
    heldout_texts = [read_source(root / p) for p in heldout_files]
    print(f"standard library {root} (Python {platform.python_version()}): {len(train_files)} training files "
          f"({sum(map(len, train_texts)):,} characters), {len(heldout_files)} held out "
          f"({sum(map(len, heldout_texts)):,})", flush=True)

    tokenizer = tokenizer_from_json(train_bpe_json(train_texts, VOCAB_SIZE))
    heldout_chars = sum(map(len, heldout_texts))
    for label, tok in (("built-in (pseudo-text)", build_tokenizer(VOCAB_SIZE)), ("trained on the library", tokenizer)):
        tokens = sum(len(e.ids) for e in tok.backend_tokenizer.encode_batch(heldout_texts))
        print(f"tokenizer {label}: {heldout_chars / tokens:.2f} characters per token on the held-out files")
    stream = token_stream(tokenizer, train_texts)
    heldout_stream = token_stream(tokenizer, heldout_texts)
    heldout = heldout_windows(heldout_stream, args.seq_len)
    final = spread(heldout, args.eval_windows)
    print(f"{len(stream):,} training tokens, {len(heldout_stream):,} held-out ({len(heldout)} windows); "
          f"tokenized in {time.perf_counter() - began:.1f}s", flush=True)

    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    target = build_hf_model(TARGET_SPEC, eos_token_id=eos)
    seconds, train_loss = train("target", target, stream, heldout, args, args.target_steps, args.target_lr)
    target = as_shipped(target).eval()
    loss, target_top = evaluate(target, final)
    target_run = RunResult(args.target_steps, seconds, train_loss, loss)
    print(f"[target] held-out loss {loss:.3f} (bf16 weights, {len(final)} windows of {args.seq_len})")

    draft = build_hf_model(DRAFT_SPEC, eos_token_id=eos)
    seconds, train_loss = train("draft", draft, stream, heldout, args, args.draft_steps, args.draft_lr, teacher=target)
    loss, draft_top = evaluate(as_shipped(draft), final)
    agreement = (draft_top == target_top).float().mean().item()
    draft_run = RunResult(args.draft_steps, seconds, train_loss, loss, agreement)
    print(f"[draft] held-out loss {loss:.3f}, top-1 agreement with the target {agreement:.1%} (bf16 weights)")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    code_dir, draft_dir = out / builtin_code_dir().name, out / builtin_code_draft_dir().name
    save(target, TARGET_SPEC, tokenizer, code_dir)
    save(draft, DRAFT_SPEC, tokenizer, draft_dir)
    split = {"python": platform.python_version(), "rule": f"zlib.crc32(path) % {HELDOUT_MODULUS} == 0",
             "excluded": "see nanovllm.builtin_code.EXCLUDED_DIRS", "train_files": len(train_files),
             "heldout": heldout_files}
    (code_dir / SPLIT_FILE).write_text(json.dumps(split, indent=1) + "\n", encoding="utf-8")
    record = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
              "train_tokens": len(stream), "heldout_tokens_scored": final[:, 1:].numel(),
              "target": asdict(target_run), "draft": asdict(draft_run),
              "target_spec": asdict(TARGET_SPEC), "draft_spec": asdict(DRAFT_SPEC),
              "seconds": round(time.perf_counter() - began, 1)}
    (code_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    sizes = {d.name: sum(f.stat().st_size for f in d.iterdir()) for d in (code_dir, draft_dir)}
    print(f"\nwrote {code_dir} ({sizes['code'] / 1e6:.1f} MB) and {draft_dir} ({sizes['code-draft'] / 1e6:.1f} MB) "
          f"in {record['seconds']:.0f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
