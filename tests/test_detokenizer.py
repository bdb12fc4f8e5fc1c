"""Incremental detokenization and stop strings (`nanovllm._core`, `nanovllm.token_table`).

The oracle is `tokenizer.decode(all_tokens, skip_special_tokens=...)` of transformers' fast
tokenizers: `TokenTable.decode` equals it; for any token stream, split into steps in any way and
interleaved with other sequences, a sequence's deltas plus `flush()` concatenate to that text as
vLLM's decoder ends it (`sequence_text`: no cleanup replacements, cut at a stop string, else no
trailing U+FFFD; an open byte run at the end keeps its valid beginning).
Tokenizers are trained here in a second: a byte-level BPE (Qwen / Llama 3 style) and SentencePiece
style BPEs with `<0xNN>` byte fallback (Llama 2's decoder, and the `Metaspace` decoder).
"""

from __future__ import annotations

import json
import os
import random
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from nanovllm._core import Detokenizer, TokenTable  # noqa: E402
from nanovllm.builtin_model import build_tokenizer  # noqa: E402
from nanovllm.token_table import build_token_table, bytes_to_unicode  # noqa: E402

# Text with multi-byte characters (2, 3 and 4 bytes in UTF-8) that tokenizers split across tokens.
MULTIBYTE = ["é", "ü", "日本", "語", "中文", "😀", "🎉", "ñ", "∑", "𝔘"]
WORDS = ["hello", "world", "the", "cat", "stop", "end", "token", "a", "b", "it's", "don't", "ok."]


def _corpus(seed: int = 0, n: int = 1500) -> list[str]:
    rng = random.Random(seed)
    vocab = WORDS + MULTIBYTE[:6]  # the rest only ever appears as byte fallback / byte pieces
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(3, 12))) for _ in range(n)]


@lru_cache(maxsize=None)
def _sp_json(metaspace: str | None) -> str:
    """A Llama-2-like tokenizer: BPE with byte_fallback, `<0xNN>` ids 3..258, `▁` for spaces."""
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=40,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    d = json.loads(tok.to_str())
    vocab = {s: i for i, s in enumerate(["<unk>", "<s>", "</s>"])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in sorted(d["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    d["model"]["vocab"] = vocab
    d["added_tokens"] = [
        dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
        for i, s in enumerate(["<unk>", "<s>", "</s>"])
    ]
    tok = Tokenizer.from_str(json.dumps(d))
    if metaspace is None:
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=metaspace, split=False)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=metaspace, split=False)
    return tok.to_str()


def _sp_tokenizer(metaspace: str | None = None) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_sp_json(metaspace)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    # An added non-special token with the space marker, and an added special one.
    tok.add_tokens([AddedToken("▁foo▁", normalized=False), AddedToken("<tool>", normalized=False)])
    tok.add_special_tokens({"additional_special_tokens": ["<|sp|>"]})
    return tok


def _byte_level_tokenizer(cleanup: bool = False) -> PreTrainedTokenizerFast:
    tok = build_tokenizer(512, 0)
    # Added tokens go through the ByteLevel decoder too: "Ġab" decodes as " ab", while a token
    # with a character outside the byte alphabet (here a space) decodes as its own UTF-8.
    tok.add_tokens([AddedToken("Ġab", normalized=False), AddedToken("Ġx y", normalized=False)])
    tok.add_special_tokens({"additional_special_tokens": ["<|sp|>"]})
    if cleanup:
        # transformers 5 skips the cleanup for BPE models unless forced; force it to test ours.
        tok.clean_up_tokenization_spaces = True
        tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    return tok


def _unigram_tokenizer() -> PreTrainedTokenizerFast:
    """A T5-like Unigram model with the Metaspace decoder: not BPE, so transformers' cleanup
    (clean_up_tokenization_spaces=True) really runs in its decode."""
    pieces = ["<unk>", "<s>", "</s>", "▁", "."]
    pieces += [p for w in WORDS + ["n't", "'s", "'m", "'ve", "'re", "'", ",", "!", "?"] for p in (w, "▁" + w)]
    pieces += sorted(set("".join(WORDS) + "日本語é"))
    seen, vocab = set(), []
    for p in pieces:
        if p not in seen:
            seen.add(p)
            vocab.append((p, -float(len(vocab) % 7 + 1)))
    tok = Tokenizer(models.Unigram(vocab, unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=True
    )


class Kind:
    """One tokenizer under test, with id pools for the random streams."""

    def __init__(self, name: str, tok: PreTrainedTokenizerFast):
        self.name = name
        self.tok = tok
        self.table = build_token_table(tok)
        self.n = len(self.table)
        self.specials = sorted(tok.backend_tokenizer.get_added_tokens_decoder())
        vocab = tok.get_vocab()
        if self.table.byte_level:
            b2u = bytes_to_unicode()
            self.byte_ids = [vocab[b2u[b]] for b in range(256)]
        elif "<0x41>" in vocab:
            self.byte_ids = [vocab[f"<0x{b:02X}>"] for b in range(256)]
        else:  # no byte tokens: any ids
            self.byte_ids = [b % self.n for b in range(256)]
        # Encodings of text pieces: realistic multi-token characters.
        pieces = MULTIBYTE + WORDS + [" " + w for w in WORDS + MULTIBYTE] + ["  ", " .", " 's", "\n"]
        self.encoded = [tok.encode(p, add_special_tokens=False) for p in pieces]
        self.encoded = [e for e in self.encoded if e]

    def decode(self, ids: list[int], skip: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip)

    def stream_decode(self, ids: list[int], skip: bool) -> str:
        """What a sequence's text is made from: tokenizer.decode without transformers' cleanup,
        which vLLM's decoder (tokenizers' DecodeStream) never applies."""
        return self.tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    def __repr__(self) -> str:
        return self.name


@lru_cache(maxsize=None)
def kinds() -> dict[str, Kind]:
    return {
        "byte_level": Kind("byte_level", _byte_level_tokenizer()),
        "byte_level_cleanup": Kind("byte_level_cleanup", _byte_level_tokenizer(cleanup=True)),
        "sentencepiece": Kind("sentencepiece", _sp_tokenizer()),
        "metaspace_first": Kind("metaspace_first", _sp_tokenizer("first")),
        "metaspace_never": Kind("metaspace_never", _sp_tokenizer("never")),
        "metaspace_always": Kind("metaspace_always", _sp_tokenizer("always")),
        "unigram_cleanup": Kind("unigram_cleanup", _unigram_tokenizer()),
    }


# More examples for a soak run: NANOVLLM_HYPOTHESIS_EXAMPLES=2000 pytest tests/test_detokenizer.py
EXAMPLES = int(os.environ.get("NANOVLLM_HYPOTHESIS_EXAMPLES", "60"))

KIND_NAMES = [
    "byte_level",
    "byte_level_cleanup",
    "sentencepiece",
    "metaspace_first",
    "metaspace_never",
    "metaspace_always",
    "unigram_cleanup",
]


def lenient_ids(kind: Kind, ids: list[int], skip: bool) -> list[int]:
    """`ids` with a ByteFallback run still open at the end cut to its valid beginning, as a
    sequence's flush closes it (vLLM had emitted that beginning while the run was valid)."""
    if kind.table.byte_level or "<0x41>" not in kind.tok.get_vocab():
        return ids
    # Byte tokens where the decoder has ByteFallback (the table stores their byte).
    byte_of = {kind.byte_ids[b]: b for b in range(256) if kind.table.piece(kind.byte_ids[b]) == bytes([b])}
    run: list[int] = []  # positions of the run's byte tokens
    for i in range(len(ids) - 1, -1, -1):
        t = ids[i]
        if (skip and kind.table.is_special(t)) or kind.table.piece(t) is None:
            continue  # decode drops it before the decoder: the run goes on through it
        if t not in byte_of:
            break
        run.append(i)
    run.reverse()
    data = bytes(byte_of[ids[i]] for i in run)
    keep = len(data)
    while keep and not _valid_utf8(data[:keep]):
        keep -= 1
    drop = set(run[keep:])
    return [t for i, t in enumerate(ids) if i not in drop]


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def sequence_text(kind: Kind, ids: list[int], skip: bool, stops: list[str] = (), include: bool = False) -> str:
    """What a sequence's text ends as: tokenizer.decode (of `lenient_ids`), cut at the first stop
    string, else without trailing U+FFFDs (vLLM's text never ends in one)."""
    full = kind.stream_decode(lenient_ids(kind, ids, skip), skip)
    hit = _first_stop(full.rstrip("\ufffd"), list(stops))  # trailing U+FFFDs are no text to stops either
    if hit is not None:
        return full[: hit[1] if include else hit[0]]
    return full.rstrip("\ufffd")


def token_stream(kind: Kind) -> st.SearchStrategy[list[int]]:
    chunk = st.one_of(
        st.integers(0, kind.n - 1).map(lambda i: [i]),
        st.sampled_from(kind.specials).map(lambda i: [i]),
        st.lists(st.sampled_from(kind.byte_ids), min_size=1, max_size=4),
        st.sampled_from(kind.encoded),
        # A multi-byte character cut into its bytes, possibly truncated.
        st.tuples(st.sampled_from(MULTIBYTE), st.integers(0, 3)).map(
            lambda t: [kind.byte_ids[b] for b in t[0].encode()[: len(t[0].encode()) - t[1]]] or [kind.byte_ids[0x41]]
        ),
    )
    return st.lists(chunk, max_size=12).map(lambda cs: [i for c in cs for i in c])


def run_streams(
    table: TokenTable,
    streams: list[list[int]],
    rnd: random.Random,
    *,
    skip: bool,
    multi: bool = False,
    stop=(),
    include_stop: bool = False,
    on_step=None,
) -> tuple[list[str], list[str | None], Detokenizer]:
    """Feed several sequences interleaved, a random subset per call; returns the concatenated
    deltas plus flush, and the stop strings reported."""
    d = Detokenizer(table)
    for key in range(len(streams)):
        d.add(1000 + key, skip_special_tokens=skip, stop=stop, include_stop_str_in_output=include_stop)
    pos = [0] * len(streams)
    out = [""] * len(streams)
    stops: list[str | None] = [None] * len(streams)
    active = [k for k in range(len(streams)) if streams[k]]
    while active:
        batch = [k for k in active if rnd.random() < 0.7] or [active[0]]
        rnd.shuffle(batch)
        if multi:
            counts = [rnd.randint(0, 3) for _ in batch]
            toks, cu = [], [0]
            for k, c in zip(batch, counts):
                toks += streams[k][pos[k] : pos[k] + c]
                cu.append(len(toks))
            res = d.process(np.array([1000 + k for k in batch]), np.array(toks, np.int32), np.array(cu))
            for k, c in zip(batch, counts):
                pos[k] += c
        else:
            toks = [streams[k][pos[k]] for k in batch]
            res = d.process(np.array([1000 + k for k in batch], np.int64), np.array(toks, np.int32))
            for k in batch:
                pos[k] += 1
        assert [r[0] for r in res] == [1000 + k for k in batch]
        for k, (_, delta, s) in zip(batch, res):
            assert isinstance(delta, str)
            out[k] += delta
            if s is not None:
                stops[k] = s
                assert d.is_finished(1000 + k)
        if on_step:
            on_step(d, batch, pos, out)
        active = [k for k in active if pos[k] < len(streams[k]) and not d.is_finished(1000 + k)]
    for k in range(len(streams)):
        out[k] += d.flush(1000 + k)
        assert d.flush(1000 + k) == ""
    return out, stops, d


@pytest.mark.parametrize("name", KIND_NAMES)
@given(data=st.data())
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_output_continues_its_prompt_as_vllm_decodes_it(name, data):
    """With its prompt given, an output decodes as the rest of the prompt's text (vLLM's
    incremental decoder starts from the prompt's ids): decode(prompt + output) less decode(prompt).
    So SentencePiece's Strip and Metaspace leave the first output token's leading space, unless the
    prompt decodes to no text (only skipped special tokens), where the output starts the text. The
    prompts end on a whole word, so no byte run spans the two; no cleanup applies (vLLM's)."""
    kind = kinds()[name]
    skip = data.draw(st.booleans())
    has_bytes = kind.table.byte_level or "<0x41>" in kind.tok.get_vocab()
    words = [e for e in kind.encoded if not (has_bytes and any(t in kind.byte_ids for t in e))]
    texts = st.lists(st.sampled_from(words), min_size=1, max_size=3).map(lambda cs: [i for c in cs for i in c])
    specials = st.lists(st.sampled_from(kind.specials), min_size=1, max_size=2)
    prompt = data.draw(st.one_of(specials, texts) if kind.specials else texts)
    output = data.draw(st.lists(st.sampled_from(words), min_size=1, max_size=4).map(
        lambda cs: [i for c in cs for i in c]))
    d = Detokenizer(kind.table)
    d.add(7, skip_special_tokens=skip, prompt_token_ids=prompt)
    text = "".join(delta for tok in output for _, delta, _ in d.process(np.array([7]), np.array([tok], np.int32)))
    text += d.flush(7)
    head = kind.stream_decode(prompt, skip)
    whole = kind.stream_decode(prompt + output, skip)
    assert whole.startswith(head)
    assert text == whole[len(head):]
    alone = Detokenizer(kind.table)
    alone.add(8, skip_special_tokens=skip)
    alone.process(np.array([8]), np.array(output, np.int32), np.array([0, len(output)]))
    assert alone.text(8) == kind.stream_decode(output, skip)


def vllm_token_string(tok: PreTrainedTokenizerFast, token: int) -> str:
    """vLLM 0.32's logprob string of a token (tokenizers/detokenizer_utils.py
    convert_ids_list_to_tokens): tokenizer.decode([id]), with the leading spaces a Metaspace
    pre-tokenizer's markers stand for put back where decode dropped them."""
    text = tok.decode([token]) or ""
    pre = json.loads(tok.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    marker = next((p.get("replacement", "▁") for p in subs if p.get("type") == "Metaspace"), None)
    if marker is None:
        return text
    raw = tok.convert_ids_to_tokens(token)
    markers = len(raw) - len(raw.lstrip(marker))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def vllm_corrected(tok: PreTrainedTokenizerFast, token: int, context: list[int]) -> str:
    """vLLM 0.32's correction of a logprob string that ends in U+FFFD (v1/engine/logprobs.py
    _correct_decoded_token), from the sequence's tokens before it."""
    for n in range(1, min(len(context), 4) + 1):
        tail = context[-n:]
        full = tok.decode(tail + [token])
        if full.endswith("\ufffd"):
            continue
        clean = len(tail)
        for j in range(len(tail) - 1, -1, -1):
            if tok.decode([tail[j]]).endswith("\ufffd"):
                clean = j
            else:
                break
        prefix = tok.decode(tail[:clean]) if clean > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        return full[len(os.path.commonprefix([prefix, full])):]
    return ""


@pytest.mark.parametrize("name", KIND_NAMES)
def test_table_decode_matches_tokenizer(name):
    kind = kinds()[name]
    ids = list(range(kind.n))
    # decode_token is vLLM's logprob string for every id; a whole-vocab decode is tokenizer.decode both ways.
    expected = [vllm_token_string(kind.tok, i) for i in ids]
    assert kind.table.decode_tokens(ids) == expected
    assert [kind.table.decode_token(i) for i in ids[:50]] == expected[:50]
    if name.startswith("metaspace_") and name != "metaspace_never":
        assert expected != [kind.tok.decode([i]) for i in ids]  # the leading spaces put back
    for skip in (False, True):
        assert kind.table.decode(ids, skip) == kind.decode(ids, skip)


@pytest.mark.parametrize("name", KIND_NAMES)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_partial_character_strings_corrected_as_vllm(name, data):
    """A logprob string that is part of a character ("\ufffd") becomes what vLLM makes of it from
    the 4 tokens before it: "" while the character is unfinished, the character on its last token."""
    kind = kinds()[name]
    stream = data.draw(token_stream(kind))
    for j, token in enumerate(stream):
        if kind.table.decode_token(token).endswith("\ufffd"):
            context = stream[max(0, j - 4):j]
            assert kind.table.corrected_string(token, context) == vllm_corrected(kind.tok, token, context), (j, stream)


@pytest.mark.parametrize("name", KIND_NAMES)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_streams_equal_decode(name, data):
    kind = kinds()[name]
    streams = [data.draw(token_stream(kind)) for _ in range(data.draw(st.integers(1, 4)))]
    skip = data.draw(st.booleans())
    multi = data.draw(st.booleans())
    rnd = random.Random(data.draw(st.integers(0, 2**32)))

    def check(d, batch, pos, out):
        for k in batch:
            prefix = streams[k][: pos[k]]
            full = kind.stream_decode(prefix, skip)
            assert d.text(1000 + k) == sequence_text(kind, prefix, skip)
            # Deltas never take back anything, and hold back only trailing U+FFFDs (an unfinished
            # character, invalid bytes) or an open byte run.
            assert full.startswith(out[k])
            rest = full[len(out[k]) :]
            if kind.table.byte_level:
                assert rest.strip("\ufffd") == ""
            else:
                fed = [t for t in prefix if not (skip and t in kind.specials)]
                if not fed or fed[-1] not in kind.byte_ids:
                    assert rest.strip("\ufffd") == ""

    out, stops, _ = run_streams(kind.table, streams, rnd, skip=skip, multi=multi, on_step=check)
    for k, ids in enumerate(streams):
        assert out[k] == sequence_text(kind, ids, skip)
        assert stops[k] is None


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_multibyte_split_across_tokens(name):
    kind = kinds()[name]
    text = "日本語 😀 é∑𝔘"
    ids = [kind.byte_ids[b] for b in text.encode()]
    d = Detokenizer(kind.table)
    d.add(1)
    deltas = [d.process([1], [t])[0][1] for t in ids]
    # Nothing is released before its character is complete, and nothing comes out broken.
    assert "".join(deltas) + d.flush(1) == kind.decode(ids, True)
    assert all("\ufffd" not in x for x in deltas)
    if kind.table.byte_level:
        # Each character comes out exactly when its last byte arrives.
        assert [x for x in deltas if x] == list(text)
    # A truncated character at the end is dropped, as vLLM's text drops it (tokenizer.decode
    # would end in U+FFFD: for ByteFallback, one for every byte of the run).
    cut = ids[:-1]
    d.add(2)
    got = "".join(d.process([2], [t])[0][1] for t in cut) + d.flush(2)
    assert got == sequence_text(kind, cut, True) == text[:-1]
    assert kind.decode(cut, True).endswith("\ufffd")


def test_bytefallback_run_is_all_or_nothing():
    kind = kinds()["sentencepiece"]
    b = kind.byte_ids
    word = kind.tok.convert_tokens_to_ids("world")
    # "A" followed by an invalid byte: ByteFallback replaces *every* byte of the run.
    ids = [b[0x41], b[0xFF], word]
    d = Detokenizer(kind.table)
    d.add(1)
    assert d.process([1], [ids[0]])[0][1] == ""  # the run is still open
    assert d.process([1], [ids[1]])[0][1] == ""
    assert d.process([1], [ids[2]])[0][1] == kind.decode(ids, True) == "��world"
    # A skipped special token does not end a run (decode drops it before the decoder runs).
    sp = kind.tok.convert_tokens_to_ids("<s>")
    ids = [b[0xE6], sp, b[0x97], b[0xA5]]
    for skip in (True, False):
        d.add(2 + skip, skip_special_tokens=skip)
        got = "".join(d.process([2 + skip], [t])[0][1] for t in ids) + d.flush(2 + skip)
        assert got == sequence_text(kind, ids, skip)
    assert kind.decode(ids, True) == "日"
    # Unskipped, <s> ends the first run ("\ufffd", followed by text) and the last, [97 A5], is
    # no character's beginning: nothing of it is kept at the end.
    assert sequence_text(kind, ids, False) == "\ufffd<s>" and kind.decode(ids, False) == "\ufffd<s>\ufffd\ufffd"


def test_strip_and_metaspace_leading_space():
    sp = kinds()["sentencepiece"]
    c = sp.tok.convert_tokens_to_ids
    for toks, skip in [
        (["▁hello", "▁world"], True),
        (["<s>", "▁hello"], True),  # Strip applies after the skipped BOS
        (["<s>", "▁hello"], False),  # "<s> hello"
        (["<0x20>", "▁hello"], True),  # a byte-run space is stripped too
        (["▁", "▁hello"], True),
    ]:
        ids = c(toks)
        assert sp.table.decode(ids, skip) == sp.decode(ids, skip), toks
    ms = kinds()["metaspace_first"]
    c = ms.tok.convert_tokens_to_ids
    # Metaspace drops every marker of the first token only.
    multi = [t for t in ms.tok.get_vocab() if t.count("▁") >= 2][0]
    for toks in [[multi], ["▁hello", multi], ["<s>", multi], ["▁foo▁", "▁hello"]]:
        for skip in (True, False):
            ids = c(toks)
            assert ms.table.decode(ids, skip) == ms.decode(ids, skip), toks


def test_lossy_replacement_matches_tokenizers():
    """Invalid UTF-8 from byte-level tokens: one U+FFFD per maximal invalid subpart, as Rust's
    from_utf8_lossy (which CPython's 'replace' also follows)."""
    kind = kinds()["byte_level"]
    rng = random.Random(0)
    interesting = [0x41, 0x80, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0x9F, 0xA0]
    for _ in range(300):
        seq = bytes(rng.choice(interesting) for _ in range(rng.randint(1, 8)))
        ids = [kind.byte_ids[x] for x in seq]
        expect = kind.decode(ids, True)
        assert expect == seq.decode("utf-8", "replace")
        d = Detokenizer(kind.table)
        d.add(0)
        got = "".join(d.process([0], [t])[0][1] for t in ids) + d.flush(0)
        assert got == expect.rstrip("\ufffd"), seq  # trailing ones dropped, as vLLM's text


@pytest.mark.parametrize(
    "decoder",
    [
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 2, 0)]),
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()]),
        decoders.Sequence([decoders.Replace("▁", "_"), decoders.Replace("0", "#"), decoders.ByteFallback()]),
        decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse()]),
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ],
    ids=lambda d: str(d)[:60],
)
def test_other_decoder_forms(decoder):
    tok = _sp_tokenizer()
    tok.backend_tokenizer.decoder = decoder
    kind = Kind("custom", tok)
    rnd = random.Random(1)
    pool = [*range(kind.n)] + kind.byte_ids * 2 + [tok.convert_tokens_to_ids("▁")] * 50
    for _ in range(150):
        ids = [rnd.choice(pool) for _ in range(rnd.randint(0, 12))]
        skip = rnd.random() < 0.5
        out, _, _ = run_streams(kind.table, [ids], rnd, skip=skip)
        assert out[0] == sequence_text(kind, ids, skip), ids


def test_unsupported_decoder_forms():
    tok = _sp_tokenizer()
    for decoder in [
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Strip(" ", 1, 0)]),  # no Fuse
        decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 0, 1)]),  # right strip
        decoders.Sequence([decoders.ByteFallback(), decoders.Replace("▁", " ")]),
        decoders.Sequence([decoders.ByteLevel(), decoders.Fuse()]),
        decoders.CTC(),
    ]:
        tok.backend_tokenizer.decoder = decoder
        with pytest.raises(NotImplementedError):
            build_token_table(tok)


# ----------------------------------------------------------------------------------------- stops


def _first_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """The reference rule (vLLM's check_stop_strings): the occurrence that ends first; among
    those, the first in the list."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = i + len(s)
            if best is None or key < best[0]:
                best = (key, i, s)
    return None if best is None else (best[1], best[1] + len(best[2]), best[2])


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece", "byte_level_cleanup"])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_stop_strings(name, data):
    kind = kinds()[name]
    ids = data.draw(token_stream(kind))
    skip = data.draw(st.booleans())
    full = kind.stream_decode(ids, skip)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if full and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(full) - 1))
            j = data.draw(st.integers(i + 1, min(len(full), i + 6)))
            stops.append(full[i:j])
        else:
            stops.append(data.draw(st.text(alphabet="ab lo.日😀\ufffd", min_size=1, max_size=4)))
    include = data.draw(st.booleans())
    rnd = random.Random(data.draw(st.integers(0, 2**32)))
    hit = _first_stop(kind.stream_decode(lenient_ids(kind, ids, skip), skip).rstrip("\ufffd"), stops)
    expect = sequence_text(kind, ids, skip, stops, include)

    def check(d, batch, pos, out):
        assert expect.startswith(out[0])  # never emits text that a stop string later cuts

    out, got_stops, d = run_streams(
        kind.table, [ids], rnd, skip=skip, stop=stops, include_stop=include, multi=data.draw(st.booleans()), on_step=check
    )
    assert out[0] == expect
    assert d.text(1000) == expect
    assert d.stop_reason(1000) == (None if hit is None else hit[2])
    if hit is not None and got_stops[0] is None:
        # Only possible when the match completes with the text released at the end (flush).
        assert d.stop_reason(1000) == hit[2]


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_quiet_sequences_match_reported_ones(name, data):
    """A sequence added with deltas=False is left out of process()'s result except in the call in
    which a stop string ends it; its stop delta plus flush() equal all the deltas of the same
    stream reported every call, and token_ids() returns every token fed, from any start."""
    kind = kinds()[name]
    ids = data.draw(token_stream(kind))
    full = kind.decode(ids, True)
    stops = [full[len(full) // 2:][:3]] if full and data.draw(st.booleans()) else []
    d = Detokenizer(kind.table)
    d.add(1, stop=stops)
    d.add(2, stop=stops, deltas=False)
    loud = quiet = ""
    fed = 0
    for t in ids:
        if d.is_finished(1):
            break
        res = d.process(np.array([1, 2]), np.array([t, t], np.int32))
        fed += 1
        stopped = res[0][2] is not None
        assert [r[0] for r in res] == ([1, 2] if stopped else [1])
        loud += res[0][1]
        if stopped:
            assert res[1][2] == res[0][2]
            quiet += res[1][1]
    assert quiet + d.flush(2) == loud + d.flush(1) == d.text(2)
    assert d.token_ids(2) == d.token_ids(1) == ids[:fed]
    start = data.draw(st.integers(0, fed + 1))
    assert d.token_ids(2, start) == ids[start:fed]


def _tokens_for(kind: Kind, parts: list[str]) -> list[int]:
    return [i for p in parts for i in kind.tok.encode(p, add_special_tokens=False)]


def _feed_each(d: Detokenizer, key: int, ids: list[int]) -> list[tuple[str, str | None]]:
    out = []
    for t in ids:
        if d.is_finished(key):
            break
        _, delta, s = d.process(np.array([key]), np.array([t], np.int32))[0]
        out.append((delta, s))
    return out


def test_stop_spanning_tokens_and_hold_back():
    kind = kinds()["byte_level"]
    b = kind.byte_ids
    ids = [b[c] for c in b"say hello world now"]
    d = Detokenizer(kind.table)
    d.add(1, stop=["lo wo"])
    steps = _feed_each(d, 1, ids)
    text = "".join(x for x, _ in steps)
    assert text == "say hel"
    assert steps[-1][1] == "lo wo"
    assert d.stop_reason(1) == "lo wo" and d.text(1) == "say hel"
    # While "l", "lo", "lo ", "lo w" may still become the stop string, they are held back.
    assert [x for x, _ in steps] == ["s", "a", "y", " ", "h", "e", "", "l", "", "", "", ""]
    emitted = ""
    d.add(2, stop=["lo wo"])
    for c in b"say hello there":
        emitted += d.process([2], [b[c]])[0][1]
        held = d.text(2)[len(emitted) :]
        assert "lo wo".startswith(held) or held == ""
    assert emitted + d.flush(2) == "say hello there"
    with pytest.raises(ValueError, match="finished"):
        d.process([1], [b[0x41]])
    with pytest.raises(ValueError, match="finished"):
        d.process([2], [b[0x41]])


def test_multiple_stops_first_occurrence_wins():
    kind = kinds()["byte_level"]
    b = kind.byte_ids
    ids = [b[c] for c in b"xyz abc"]
    for stops, expect, reason in [
        (["yz", "x"], "", "x"),
        (["z a", "xyz"], "", "xyz"),  # ends first
        (["xyz", "y"], "x", "y"),  # "y" is complete before "xyz" is
        (["bc", "abc"], "xyz a", "bc"),  # same end: the first in the list, as vLLM's
        (["abc", "bc"], "xyz ", "abc"),
        (["nope"], "xyz abc", None),
    ]:
        for chunked in (False, True):
            d = Detokenizer(kind.table)
            d.add(5, stop=stops)
            if chunked:  # all tokens in one call: same answer as one by one
                res = d.process([5], ids, cu_tokens=[0, len(ids)])
                text = res[0][1]
            else:
                text = "".join(x for x, _ in _feed_each(d, 5, ids))
            text += d.flush(5)
            assert (text, d.stop_reason(5)) == (expect, reason), (stops, chunked)


def test_include_stop_str_in_output():
    kind = kinds()["sentencepiece"]
    ids = _tokens_for(kind, ["hello world the cat"])
    full = kind.decode(ids, True)
    assert full == "hello world the cat"
    for include, expect in [(False, "hello "), (True, "hello world")]:
        d = Detokenizer(kind.table)
        d.add(9, stop=("world",), include_stop_str_in_output=include)
        steps = _feed_each(d, 9, ids)
        assert "".join(x for x, _ in steps) == expect
        assert steps[-1][1] == "world"
        assert d.flush(9) == "" and d.text(9) == expect
    # A stop string across a multi-byte character split into bytes.
    b = kind.byte_ids
    # (the byte run only decodes once a non-byte token closes it)
    world = kind.tok.convert_tokens_to_ids("world")
    ids = [world] + [b[x] for x in "日本".encode()] + [world]
    d = Detokenizer(kind.table)
    d.add(1, stop=["d日"], include_stop_str_in_output=True)
    out = "".join(x for x, _ in _feed_each(d, 1, ids))
    assert out == "world日" and d.stop_reason(1) == "d日"


def test_stop_found_at_flush():
    # A ByteFallback run that only the end closes can complete a stop string there.
    sp = kinds()["sentencepiece"]
    d = Detokenizer(sp.table)
    d.add(1, stop=["AA"])
    assert [x for x, _ in _feed_each(d, 1, [sp.byte_ids[0x41]] * 2)] == ["", ""]
    assert d.flush(1) == "" and d.stop_reason(1) == "AA"
    # The lossy U+FFFD an unfinished character would end in is no text (vLLM's): no stop sees it.
    kind = kinds()["byte_level"]
    b = kind.byte_ids
    d = Detokenizer(kind.table)
    d.add(2, stop=["a\ufffd", "\ufffd"])
    assert [x for x, _ in _feed_each(d, 2, [b[0x61], b[0xE6]])] == ["", ""]  # "a" may start a stop
    assert d.text(2) == "a" and d.is_finished(2) is False
    assert d.flush(2) == "a" and d.stop_reason(2) is None
    # Followed by text, it is text: then a stop string holding it matches.
    d.add(3, stop=["\ufffdb"])
    assert "".join(x for x, _ in _feed_each(d, 3, [b[0x61], b[0xE6], b[0x62]])) + d.flush(3) == "a"
    assert d.stop_reason(3) == "\ufffdb"


# ---------------------------------------------------------------------------------------- errors


def test_bad_inputs_raise_without_changing_state():
    kind = kinds()["byte_level"]
    b = kind.byte_ids
    d = Detokenizer(kind.table)
    d.add(1)
    d.add(2)
    with pytest.raises(ValueError, match="already added"):
        d.add(1)
    with pytest.raises(ValueError, match="non-empty"):
        d.add(3, stop=[""])
    with pytest.raises(KeyError, match="unknown sequence key 7"):
        d.process([1, 7], [b[0x41], b[0x41]])
    with pytest.raises(ValueError, match="outside the token table"):
        d.process([1, 2], [b[0x41], kind.n])
    with pytest.raises(ValueError, match="outside the token table"):
        d.process([1], [-1])
    with pytest.raises(ValueError, match="more than once"):
        d.process([1, 2, 1], [b[0x41], b[0x42], b[0x43]])
    with pytest.raises(ValueError, match="keys but"):
        d.process([1, 2], [b[0x41]])
    with pytest.raises(ValueError, match="cu_tokens"):
        d.process([1], [b[0x41]], cu_tokens=[0, 2])
    with pytest.raises(ValueError, match="outside int32"):
        d.process([1], np.array([2**40]))
    with pytest.raises(ValueError, match="outside int32"):
        d.process([1], [2**70])
    with pytest.raises(TypeError):
        d.process([1], np.array([1.5]))
    # None of the failed calls appended anything.
    assert d.text(1) == "" and d.text(2) == ""
    assert d.process(np.array([2, 1]), np.array([b[0x42], b[0x41]], np.int32)) == [(2, "B", None), (1, "A", None)]
    assert d.process([], []) == []
    for bad in (kind.n, -1, 2**70):
        with pytest.raises(ValueError, match="outside the token table"):
            kind.table.decode_token(bad)
    with pytest.raises(ValueError, match="outside the token table"):
        kind.table.decode([0, kind.n])
    with pytest.raises(ValueError, match="outside the token table"):
        kind.table.decode_tokens([kind.n])
    with pytest.raises(KeyError):
        d.flush(99)
    with pytest.raises(KeyError):
        d.text(99)
    d.remove(1)
    with pytest.raises(KeyError):
        d.remove(1)
    assert 1 not in d and 2 in d and len(d) == 1
    d.add(1)  # a removed key can be reused; the slot starts fresh
    assert d.process([1], [b[0x43]]) == [(1, "C", None)]
    assert d.flush(2) == "" and d.is_finished(2)
    with pytest.raises(ValueError, match="finished"):
        d.process([2], [b[0x41]])


def test_padded_vocab_and_unsupported_decoder():
    kind = kinds()["byte_level"]
    table = build_token_table(kind.tok, vocab_size=kind.n + 64)
    assert len(table) == kind.n + 64
    # Ids past the tokenizer decode to nothing, like tokenizer.decode (which drops them).
    ids = [kind.byte_ids[0x41], kind.n + 3, kind.byte_ids[0x42]]
    assert table.decode(ids) == "AB" == kind.tok.decode(ids)
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(NotImplementedError):
        build_token_table(tok)


def test_cleanup_only_where_transformers_applies_it():
    # transformers 5 ignores clean_up_tokenization_spaces=True for BPE models (unless forced).
    sp = _sp_tokenizer()
    sp.clean_up_tokenization_spaces = True
    assert build_token_table(sp).cleanup == ()
    ids = sp.encode("hello . world 's", add_special_tokens=False)
    assert build_token_table(sp).decode(ids) == sp.decode(ids) == "hello . world 's"
    # ... but runs it for other models (Unigram here).
    uni = kinds()["unigram_cleanup"]
    assert uni.table.cleanup
    ids = uni.tok.encode("hello . world 's it n't", add_special_tokens=False)
    assert uni.table.decode(ids) == uni.decode(ids, False) == "hello. world's itn't"


def test_cleanup_is_incremental():
    kind = kinds()["byte_level_cleanup"]
    assert kind.table.cleanup and not kinds()["byte_level"].table.cleanup
    b = kind.byte_ids
    text = b"it 's ok . don 't ' x ' n't  ,,"
    ids = [b[c] for c in text]
    # TokenTable.decode applies the replacements as the tokens come, as tokenizer.decode does...
    assert kind.table.decode(ids, True) == kind.decode(ids, True) == kind.tok.clean_up_tokenization(text.decode())
    # ... and a sequence's text has none, as vLLM's decoder.
    d = Detokenizer(kind.table)
    d.add(1)
    got = "".join(d.process([1], [t])[0][1] for t in ids) + d.flush(1)
    assert got == kind.stream_decode(ids, True) == text.decode()


def test_stop_strings_wait_for_min_tokens():
    kind = kinds()["byte_level"]
    b = kind.byte_ids
    ids = [b[c] for c in b"ab ab ab"]
    d = Detokenizer(kind.table)
    # As vLLM: no stop string is looked for until more than min_tokens tokens have come.
    d.add(1, stop=["ab"], min_tokens=3)
    steps = _feed_each(d, 1, ids)
    assert d.stop_reason(1) == "ab" and d.text(1) == "ab "
    assert len(steps) == 5  # the second "ab" completes at the 5th token
    # A match that began within the first min_tokens tokens and completes after still counts.
    d.add(2, stop=["b a"], min_tokens=2)
    _feed_each(d, 2, ids)
    assert d.text(2) == "a"
    with pytest.raises(ValueError, match="min_tokens"):
        d.add(3, min_tokens=-1)
