"""Our models against Hugging Face transformers on tiny random-weight checkpoints.

Logits must agree to 1e-4 through chunked prefill (cached prefix + new chunk) and batched
decodes over shuffled, non-contiguous blocks, and greedy generation must equal HF `generate`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tiny_models import TINY_SPECS, make_tiny_model
from tiny_pager import TinyPager

from nanovllm.layers import attention_layers, bind_kv_cache
from nanovllm.model_config import ModelConfig
from nanovllm.models import DecoderForCausalLM, load_model
from nanovllm.sample import Sampler, make_sampling_batch

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@dataclass
class Pair:
    name: str
    path: Path
    ours: DecoderForCausalLM
    config: ModelConfig
    hf: Any  # transformers PreTrainedModel


@pytest.fixture(scope="module", params=sorted(TINY_SPECS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    name: str = request.param
    path = make_tiny_model(tmp_path_factory.mktemp("models"), name)
    ours, config = load_model(path, dtype="auto")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield Pair(name, path, ours, config, hf)


def new_cache(config: ModelConfig, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    return torch.zeros(
        2,
        config.num_hidden_layers,
        num_blocks,
        BLOCK_SIZE,
        config.num_key_value_heads,
        config.head_dim,
    )


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_config_parsed(pair: Pair) -> None:
    spec = TINY_SPECS[pair.name]
    assert pair.config.architecture == spec.arch
    assert pair.config.head_dim == (spec.head_dim or spec.hidden_size // spec.num_attention_heads)
    assert pair.config.tie_word_embeddings == spec.tie_word_embeddings
    if spec.tie_word_embeddings:
        assert pair.ours.lm_head.weight is pair.ours.model.embed_tokens.weight
    if spec.rope_scaling:
        assert pair.config.rope.rope_type == spec.rope_scaling["rope_type"]
    # YaRN scales cos and sin (transformers) by its attention factor: here the softmax scale, squared.
    plain = pair.config.head_dim**-0.5
    scale = pair.ours.model.layers[0].self_attn.attn.scale
    assert scale == (pytest.approx(plain * (0.1 * math.log(4.0) + 1) ** 2) if pair.name == "qwen3_yarn" else plain)


def test_chunked_prefill_and_decode_logits_match_hf(pair: Pair) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = pair.config.vocab_size
    # Full token sequences (prompt + continuation). Causal logits at position p depend only on
    # tokens <= p, so one HF forward over each whole sequence is the reference for every step.
    seqs = {
        sid: torch.randint(0, vocab, (n,), generator=gen).tolist()
        for sid, n in [(0, 16), (1, 11), (2, 25)]
    }
    # Chunk sizes per step: prefill in 1-3 chunks, then decodes (1 token each).
    plans = {0: [5, 8, 1, 1, 1], 1: [7, 1, 1, 1, 1], 2: [9, 6, 7, 1, 1, 1]}
    refs = {sid: hf_logits(pair.hf, toks) for sid, toks in seqs.items()}

    pager = TinyPager(NUM_BLOCKS, BLOCK_SIZE, seed=7)
    bind_kv_cache(pair.ours, new_cache(pair.config))
    done = {sid: 0 for sid in seqs}
    for step in range(max(len(p) for p in plans.values())):
        chunks = []
        for sid, plan in plans.items():
            if step < len(plan):
                chunks.append((sid, seqs[sid][done[sid] : done[sid] + plan[step]]))
        # Decodes first, as the scheduler emits them.
        chunks.sort(key=lambda c: not (len(c[1]) == 1 and done[c[0]] > 0))
        batch = pager.step(chunks)
        with torch.no_grad():
            hidden = pair.ours(batch.input_ids, batch.positions, batch.meta)
            logits = pair.ours.compute_logits(hidden)
        assert logits.dtype == torch.float32
        for i, (sid, toks) in enumerate(chunks):
            start, end = batch.meta.host_lens().cu_seqlens_q[i : i + 2]
            ref = refs[sid][done[sid] : done[sid] + len(toks)]
            torch.testing.assert_close(logits[start:end], ref, rtol=1e-4, atol=1e-5)
            done[sid] += len(toks)
    assert done == {sid: len(t) for sid, t in seqs.items()}


def generate_greedy(
    model: DecoderForCausalLM,
    config: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: int,
) -> list[list[int]]:
    """A minimal engine loop: one batched prefill, then batched decodes, greedy via the Sampler."""
    pager = TinyPager(NUM_BLOCKS, BLOCK_SIZE, seed=3)
    bind_kv_cache(model, new_cache(config))
    sampler = Sampler()
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    chunks = [(i, prompts[i]) for i in active]
    while active:
        batch = pager.step(chunks)
        with torch.no_grad():
            hidden = model(batch.input_ids, batch.positions, batch.meta)
            logits = model.compute_logits(hidden[batch.last_token_rows])
        tokens = sampler(logits, make_sampling_batch([0.0] * len(chunks))).tolist()
        for (i, _), tok in zip(chunks, tokens):
            outputs[i].append(tok)
        active = [
            i for i, _ in chunks if outputs[i][-1] != eos and len(outputs[i]) < max_new_tokens
        ]
        chunks = [(i, [outputs[i][-1]]) for i in active]
    return outputs


def test_greedy_generation_matches_hf_generate(pair: Pair) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(pair.path)
    texts = [
        "Hello there, kato",
        "def foo(x):\n    return",
        "The",
        "mu ri sha lo ber dan fel gor 12345!",
    ]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    eos = tokenizer.eos_token_id
    max_new = 12
    ours = generate_greedy(pair.ours, pair.config, prompts, max_new, eos)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = pair.hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        assert got == out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


def test_bfloat16_load_runs_close_to_fp32(qwen3_dir: Path) -> None:
    model, config = load_model(qwen3_dir, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    cache = new_cache(config).to(torch.bfloat16)
    bind_kv_cache(model, cache)
    tokens = list(range(1, 20))
    batch = TinyPager(NUM_BLOCKS, BLOCK_SIZE).step([(0, tokens)])
    with torch.no_grad():
        logits = model.compute_logits(model(batch.input_ids, batch.positions, batch.meta))
    fp32, _ = load_model(qwen3_dir)
    bind_kv_cache(fp32, new_cache(config))
    with torch.no_grad():
        ref = fp32.compute_logits(fp32(batch.input_ids, batch.positions, batch.meta))
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()


def test_model_to_dtype_keeps_fp32_rotary(qwen3_dir: Path) -> None:
    model, _ = load_model(qwen3_dir)
    rotary = model.model.layers[0].self_attn.rotary_emb
    before = rotary.inv_freq.clone()
    model.to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, before)


def test_attention_layers_and_cache_binding(pair: Pair) -> None:
    layers = attention_layers(pair.ours)
    assert [layer.layer_idx for layer in layers] == list(range(pair.config.num_hidden_layers))
    cache = new_cache(pair.config)
    bind_kv_cache(pair.ours, cache)
    for i, layer in enumerate(layers):
        assert layer.k_cache.data_ptr() == cache[0, i].data_ptr()
        assert layer.v_cache.data_ptr() == cache[1, i].data_ptr()
    with pytest.raises(ValueError, match="num_layers"):
        bind_kv_cache(pair.ours, cache[:, :1])
    # Caches are not parameters or buffers: they never reach the state dict.
    assert not any("cache" in k for k in pair.ours.state_dict())
