"""Build the `nanovllm._core.TokenTable` of a Hugging Face tokenizer.

The table holds what each token id contributes to `tokenizer.decode(ids)`; `_core.Detokenizer`
then decodes every sequence incrementally from it (see `nanovllm/_core.pyx`). Here we read the
tokenizer's decoder (its JSON form, as `tokenizers` 0.2x serializes it) and translate the forms
LLM tokenizers use:

* `ByteLevel` (GPT-2, Qwen, Llama 3): each token string maps back to bytes through the inverse of
  GPT-2's `bytes_to_unicode`; a token with any character outside that map contributes its own
  UTF-8 instead (this is per token, as in `tokenizers`, and applies to added tokens too). The text
  is the lossy UTF-8 decoding of all bytes.
* SentencePiece style (Llama 2, Mistral): a `Sequence` of per-token `Replace` (plain string
  patterns) and/or `Metaspace`, then optionally `ByteFallback`, `Fuse` and `Strip(c, n, 0)` after
  `Fuse`. `Metaspace` alone is the form `tokenizers` converts some SentencePiece models to.

Anything else (WordPiece, CTC, regex `Replace`, right `Strip`, no decoder) raises
NotImplementedError rather than decoding differently from the tokenizer.

Special tokens: `tokenizer.decode(..., skip_special_tokens=True)` drops the ids its backend marks
special (the added tokens with `special=True`), which can be more than `all_special_ids` lists, so
the table takes them from the backend.

`clean_up_tokenization_spaces`: transformers (4.x: always when enabled; 5.x: not for BPE models
unless `clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`) applies
`clean_up_tokenization` after decoding. When it applies, the table carries its replacements and
the detokenizer performs them incrementally with exactly `str.replace`'s result.
"""

from __future__ import annotations

import json
from typing import Any

from nanovllm._core import TokenTable

__all__ = ["build_token_table", "bytes_to_unicode", "CLEANUP_REPLACEMENTS"]

# transformers' PreTrainedTokenizerBase.clean_up_tokenization, in its order.
CLEANUP_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (used by the ByteLevel decoder)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def _backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend
    if hasattr(tokenizer, "id_to_token") and hasattr(tokenizer, "decoder"):
        return tokenizer  # a bare `tokenizers.Tokenizer`
    raise TypeError(
        f"build_token_table needs a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}"
    )


def _cleanup_applies(tokenizer: Any, backend: Any) -> bool:
    """Whether `tokenizer.decode` (with its default) runs `clean_up_tokenization`."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    override = getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None
    )
    if override is None:  # transformers 4.x: no BPE exception
        return True
    return type(backend.model).__name__ != "BPE" or bool(override)


def _byte_level_piece(token: str, table: dict[int, int | None]) -> bytes:
    # str.translate maps every character of the byte alphabet to the byte it stands for (a
    # latin-1 character) and every other character below 256 to U+FFFF, so the latin-1 encoding
    # succeeds exactly when all characters are in the alphabet.
    try:
        return token.translate(table).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def _byte_fallback_value(token: str) -> int | None:
    # tokenizers' ByteFallback: a 6-byte token "<0x" + two characters + ">" whose middle parses
    # with Rust's u8::from_str_radix(_, 16) (which accepts a leading '+', e.g. "<0x+A>").
    if len(token.encode("utf-8")) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return None
    mid = token[3:5]
    digits = mid[1:] if mid.startswith("+") else mid
    if not digits or any(c not in "0123456789abcdefABCDEF" for c in digits):
        return None
    return int(digits, 16)


def _steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if decoder is None:
        raise NotImplementedError("tokenizer without a decoder (tokens joined by spaces)")
    if decoder.get("type") == "Sequence":
        out: list[dict[str, Any]] = []
        for d in decoder["decoders"]:
            out.extend(_steps(d))
        return out
    return [decoder]


def build_token_table(tokenizer: Any, *, vocab_size: int | None = None) -> TokenTable:
    """The TokenTable of `tokenizer` (a transformers fast tokenizer or a `tokenizers.Tokenizer`).

    `vocab_size`: make the table at least this large (a model's padded vocabulary); ids without a
    token decode to nothing, as in `tokenizer.decode`.
    """
    backend = _backend(tokenizer)
    added = backend.get_added_tokens_decoder()
    n = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if vocab_size is not None:
        n = max(n, int(vocab_size))
    tokens: list[str | None] = [backend.id_to_token(i) for i in range(n)]
    specials = [i for i, tok in added.items() if tok.special]
    steps = _steps(json.loads(backend.decoder.__getstate__()) if backend.decoder else None)
    cleanup = CLEANUP_REPLACEMENTS if _cleanup_applies(tokenizer, backend) else ()
    kinds = [s["type"] for s in steps]
    leading = _leading_markers(backend, tokens)

    if kinds == ["ByteLevel"]:
        alphabet = {ord(c): chr(b) for b, c in bytes_to_unicode().items()}
        table: dict[int, int | None] = {c: 0xFFFF for c in range(256) if c not in alphabet}
        table.update({c: ord(b) for c, b in alphabet.items()})
        pieces = [None if t is None else _byte_level_piece(t, table) for t in tokens]
        return TokenTable(pieces, byte_level=True, special_ids=specials, cleanup=cleanup, leading_spaces=leading)

    # SentencePiece style: per-token string steps, then ByteFallback / Fuse / Strip.
    normal: list[str | None] = list(tokens)
    first: list[str | None] | None = None
    i = 0
    while i < len(steps) and steps[i]["type"] in ("Replace", "Metaspace"):
        s = steps[i]
        if s["type"] == "Replace":
            pattern = s["pattern"]
            if "String" not in pattern:
                raise NotImplementedError(f"Replace decoder with a regex pattern: {s}")
            old, new = pattern["String"], s["content"]
            normal = [None if t is None else t.replace(old, new) for t in normal]
            if first is not None:
                first = [None if t is None else t.replace(old, new) for t in first]
        else:
            # tokenizers' Metaspace decoder: the marker becomes a space, except in the first token
            # of the text, where it is dropped (all of them) unless prepend_scheme is "never".
            mark = s["replacement"]
            scheme = s.get("prepend_scheme")
            if scheme is None:  # older serialization
                scheme = "always" if s.get("add_prefix_space", True) else "never"
            if scheme != "never":
                base = first if first is not None else normal
                first = [None if t is None else t.replace(mark, "") for t in base]
            elif first is not None:
                first = [None if t is None else t.replace(mark, " ") for t in first]
            normal = [None if t is None else t.replace(mark, " ") for t in normal]
        i += 1
    byte_ids: dict[int, int] = {}
    if i < len(steps) and steps[i]["type"] == "ByteFallback":
        for tid, t in enumerate(normal):
            if t is not None:
                b = _byte_fallback_value(t)
                if b is not None:
                    byte_ids[tid] = b
        i += 1
    fused = False
    strip_char, strip_left = " ", 0
    while i < len(steps):
        s = steps[i]
        if s["type"] == "Fuse":
            fused = True
        elif s["type"] == "Strip" and fused and s.get("stop", 0) == 0 and strip_left == 0:
            strip_char, strip_left = s["content"], int(s["start"])
        else:
            raise NotImplementedError(f"unsupported decoder step for incremental decoding: {s}")
        i += 1

    def enc(ts: list[str | None]) -> list[bytes | None]:
        return [None if t is None else t.encode("utf-8") for t in ts]

    return TokenTable(
        enc(normal),
        byte_level=False,
        special_ids=specials,
        byte_ids=byte_ids,
        first_pieces=None if first is None else enc(first),
        strip_char=strip_char,
        strip_left=strip_left,
        cleanup=cleanup,
        leading_spaces=leading,
    )


def _leading_markers(backend: Any, tokens: list[str | None]) -> list[int] | None:
    """vLLM's logprob strings of a Metaspace pre-tokenizer's tokens start with a space per leading
    marker (decode drops them from a text's first token; vLLM's convert_ids_list_to_tokens puts
    them back): per id the markers its token starts with, None for other pre-tokenizers."""
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
    subs = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    marker = next((p.get("replacement", "▁") for p in subs if p.get("type") == "Metaspace"), None)
    if marker is None:
        return None
    return [0 if t is None else min(255, len(t) - len(t.lstrip(marker))) for t in tokens]
