"""`builtin-code`, the trained code model shipped with the package (nanovllm/builtin_code.py,
scripts/train_tiny_model.py): the installed package carries it and its draft, the names resolve
everywhere a model directory is taken, our engine's greedy output equals transformers' on it, it
has learned Python (its held-out loss is far below a random model's of the same shape), and the
held-out files it lists were never trained on."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from engine_helpers import assert_greedy_matches, hf_model

from nanovllm import LLM
from nanovllm.builtin_code import (
    BUILTIN_CODE,
    BUILTIN_CODE_DRAFT,
    SPLIT_FILE,
    builtin_code_dir,
    builtin_code_draft_dir,
    heldout_files,
    is_heldout,
    resolve_builtin,
    stdlib_root,
    stdlib_sources,
)
from nanovllm.config import EngineConfig

VOCAB_SIZE = 4096
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def heldout_snippets(count: int, chars: int) -> list[str]:
    """The first `chars` characters of `count` held-out files spread over the list."""
    files = heldout_files()
    step = max(1, len(files) // count)
    return [f.read_text(encoding="utf-8")[:chars] for f in files[::step][:count]]


@pytest.mark.parametrize("directory", [builtin_code_dir(), builtin_code_draft_dir()], ids=["code", "draft"])
def test_the_installed_package_ships_the_model(directory: Path) -> None:
    for name in MODEL_FILES:
        assert (directory / name).is_file(), f"{directory / name} is missing from the package"
    size = sum(f.stat().st_size for f in directory.iterdir())
    assert size < 8_000_000, f"{directory} is {size / 1e6:.1f} MB"  # a few MB, as the issue asks


def test_names_resolve_to_the_shipped_directories() -> None:
    assert resolve_builtin(BUILTIN_CODE) == str(builtin_code_dir())
    assert resolve_builtin(BUILTIN_CODE_DRAFT) == str(builtin_code_draft_dir())
    for other in ("./builtin-code", "/models/qwen3", "builtin-code-large"):
        assert resolve_builtin(other) == other
    config = EngineConfig(model=BUILTIN_CODE, tokenizer=BUILTIN_CODE)
    assert config.model == config.tokenizer == str(builtin_code_dir())


def test_target_and_draft_share_the_tokenizer() -> None:
    target, draft = builtin_code_dir(), builtin_code_draft_dir()
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    vocab = {json.loads((d / "config.json").read_text())["vocab_size"] for d in (target, draft)}
    assert len(vocab) == 1


@pytest.mark.parametrize("name", [BUILTIN_CODE, BUILTIN_CODE_DRAFT])
def test_greedy_output_equals_transformers(name: str) -> None:
    llm = LLM(name, dtype="float32", device="cpu", num_kvcache_blocks=64, max_model_len=512)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok(text)["input_ids"] for text in ["def fib(n):", *heldout_snippets(2, 300)]]
        assert_greedy_matches(llm, Path(resolve_builtin(name)), prompts, max_new=24)
    finally:
        llm.engine.shutdown()


@torch.no_grad()
def next_token_loss(model: transformers.PreTrainedModel, ids: list[list[int]]) -> float:
    losses = [model(input_ids=torch.tensor([seq]), labels=torch.tensor([seq])).loss.item() for seq in ids]
    return sum(losses) / len(losses)


def heldout_ids() -> list[list[int]]:
    """256 tokens from the middle of each of 8 held-out files."""
    tok = transformers.AutoTokenizer.from_pretrained(builtin_code_dir())
    ids = []
    for f in heldout_files()[::4][:8]:
        tokens = tok(f.read_text(encoding="utf-8"))["input_ids"]
        ids.append(tokens[len(tokens) // 2:][:256])
    return ids


def test_the_models_have_learned_python() -> None:
    """On held-out standard-library code (transformers' loss) the trained weights score far below
    random weights of the same shape (~ln 4096 = 8.3 nats: uniform guessing) and below what token
    frequencies alone give (6.6 nats on the training files); the target below its draft."""
    ids = heldout_ids()
    target = next_token_loss(hf_model(str(builtin_code_dir())), ids)
    draft = next_token_loss(hf_model(str(builtin_code_draft_dir())), ids)
    torch.manual_seed(0)
    random = transformers.AutoModelForCausalLM.from_config(hf_model(str(builtin_code_dir())).config).float().eval()
    random_loss = next_token_loss(random, ids)
    assert random_loss > 0.95 * math.log(VOCAB_SIZE)
    assert target < draft < random_loss - 3.0, (target, draft, random_loss)


def test_generate_prints_code() -> None:
    res = subprocess.run([sys.executable, "-m", "nanovllm.entrypoints.cli", "generate", "--model", BUILTIN_CODE,
                          "--prompt", "def fib(n):", "--max-tokens", "48", "--num-kvcache-blocks", "64",
                          "--max-model-len", "512", "--device", "cpu"],
                         check=False, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert "\n    " in text, text  # an indented body
    assert any(word in text.split() for word in ("return", "if", "for", "=", "is", "not", "in")), text


def test_heldout_files_were_not_trained_on() -> None:
    files = heldout_files()
    assert len(files) >= 10  # enough prompts for the speculative-decoding benchmark
    root = stdlib_root()
    relpaths = [f.relative_to(root).as_posix() for f in files]
    train, heldout = stdlib_sources()
    assert all(is_heldout(p) for p in relpaths)
    assert not set(relpaths) & set(train)
    assert set(relpaths) <= set(heldout)
    split = json.loads((builtin_code_dir() / SPLIT_FILE).read_text())
    if split["python"] == platform.python_version():  # the library the model was trained on
        assert split["heldout"] == heldout and split["train_files"] == len(train)


def test_the_split_rule_holds_out_a_sixteenth() -> None:
    train, heldout = stdlib_sources()
    assert 0.03 < len(heldout) / (len(train) + len(heldout)) < 0.1
    assert not any(part in p.split("/") for p in train + heldout for part in ("test", "tests", "site-packages"))
