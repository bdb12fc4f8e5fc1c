# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
# cython: embedsignature=True
# distutils: language = c++
"""The text side of each engine step: incremental detokenization, stop strings, output deltas.

Tokens live in the C++ core (`nanovllm._C`); text lives here. Per step the engine calls
`Detokenizer.process(keys, tokens)` once for the whole batch; everything per sequence happens in
typed code over C++ strings, and Python objects are created only for the results.

How a token becomes text. A `TokenTable` is built once per tokenizer (see
`nanovllm.token_table.build_token_table`, which reads the tokenizer's decoder) and stores, per id,
what that token contributes to `tokenizer.decode(ids)`:

* byte-level tokenizers (GPT-2 / Qwen / Llama 3, decoder `ByteLevel`): the token's raw bytes. The
  text of a sequence is the lossy UTF-8 decoding of the concatenation of all its tokens' bytes, so
  each step appends bytes and releases the longest prefix whose decoding can no longer change (all
  but an unfinished multi-byte character at the end).
* SentencePiece-style tokenizers (Llama 2 / Mistral: `Replace('▁', ' ')`, `ByteFallback`, `Fuse`,
  `Strip(' ', 1, 0)`; or `Metaspace`): the token's text after the per-token replacements, or, for
  `<0xNN>` tokens, one byte. `ByteFallback` decodes each maximal run of byte tokens as a whole (valid
  UTF-8 -> its text, otherwise one U+FFFD per byte), so a run is held back until a non-byte token (or
  the end) closes it. `Strip` removes leading characters of the whole text once; `Metaspace` drops
  its marker in the first token only.

Then, in this order, the optional `clean_up_tokenization_spaces` replacements of transformers (as a
cascade of streaming `str.replace`s, so the result equals the replacements applied to the whole
text: `TokenTable.decode` only; a sequence's text has none, as vLLM's decoder, tokenizers'
DecodeStream, applies none), then stop strings. A delta never contains text that a later token
could still change or cut off, so the concatenated deltas plus `flush()` are
`tokenizer.decode(all_tokens)` (without cleanup; cut at a stop string), or, for a sequence added
with its prompt's ids, the text that decoding adds after the prompt's (as vLLM's decoder, which
starts from the prompt: Strip and Metaspace's first-token rule then belong to the prompt) --
except at the end, where a sequence's text, as vLLM's, never ends in
U+FFFD: trailing U+FFFDs (an unfinished character, invalid bytes) are held back until text follows
them, and dropped by `flush()`; a ByteFallback run still open at the end that is not valid UTF-8
keeps its valid beginning (vLLM had emitted it while the run was valid). `TokenTable.decode` is
`tokenizer.decode` exactly.

All text inside is UTF-8 in `std::string`s; working on bytes is exact because every stage only
ever splits text at character boundaries (stop strings and replacement patterns are valid UTF-8, so
a byte match is a character match).
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, INT32_MAX
from libc.string cimport memcmp
from libcpp.string cimport string, npos
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector
from cpython.unicode cimport PyUnicode_DecodeUTF8
from cython.operator cimport dereference as deref

# Per-token flags in TokenTable.flags.
cdef enum:
    F_SPECIAL = 1  # dropped when the sequence decodes with skip_special_tokens
    F_BYTE = 2     # a ByteFallback `<0xNN>` token; its piece is the single byte NN
    F_HOLE = 4     # an id with no token: tokenizer.decode drops it (before decoding), so do we

# U+FFFD REPLACEMENT CHARACTER, what both Rust's from_utf8_lossy and ByteFallback insert.
cdef const char* REPL = b"\xef\xbf\xbd"


cdef inline str _utf8(const string& s, size_t start, size_t stop):
    """s[start:stop] as a Python str (the bytes are valid UTF-8 by construction)."""
    if stop <= start:
        return ""
    return PyUnicode_DecodeUTF8(s.data() + start, <Py_ssize_t>(stop - start), NULL)


cdef inline int _utf8_seq(const unsigned char* b, size_t i, size_t n, size_t* stop) noexcept:
    """Classify the UTF-8 sequence starting at b[i] (a byte >= 0x80).

    Returns 1 when b[i:stop] is a valid character, 0 when it is invalid (b[i:stop] is the maximal
    invalid prefix that gets one U+FFFD, as in the Unicode "maximal subpart" practice that both
    Rust's `String::from_utf8_lossy` and CPython's 'replace' handler follow), and 2 when the bytes
    run out before the character is complete but everything seen so far is valid (then *stop == n).
    """
    cdef unsigned char c = b[i]
    cdef unsigned char lo = 0x80, hi = 0xBF
    cdef int need
    if 0xC2 <= c <= 0xDF:
        need = 1
    elif c == 0xE0:
        need = 2; lo = 0xA0
    elif c == 0xED:
        need = 2; hi = 0x9F  # no UTF-16 surrogates
    elif 0xE1 <= c <= 0xEF:
        need = 2
    elif c == 0xF0:
        need = 3; lo = 0x90
    elif c == 0xF4:
        need = 3; hi = 0x8F  # nothing above U+10FFFF
    elif 0xF1 <= c <= 0xF3:
        need = 3
    else:  # a continuation byte, an overlong lead (C0, C1) or F5..FF: invalid on its own
        stop[0] = i + 1
        return 0
    cdef size_t j = i + 1
    cdef int k = 0
    while k < need and j < n and lo <= b[j] <= hi:
        j += 1
        k += 1
        lo = 0x80
        hi = 0xBF
    stop[0] = j
    if k == need:
        return 1
    if j == n:
        return 2
    return 0


cdef size_t _valid_prefix(const string& s) noexcept:
    """How many of `s`'s first bytes make whole, valid UTF-8 characters."""
    cdef const unsigned char* b = <const unsigned char*>s.data()
    cdef size_t n = s.size(), i = 0, j = 0
    while i < n:
        if b[i] < 0x80:
            i += 1
        elif _utf8_seq(b, i, n, &j) == 1:
            i = j
        else:
            break
    return i


cdef inline bint _utf8_valid(const string& s) noexcept:
    return _valid_prefix(s) == s.size()


# One sequence's text state. A plain struct of C++ members, stored by value in a vector (no Python
# object per sequence), so that a step touches only contiguous C++ memory.
cdef struct Seq:
    int64_t key
    int64_t epoch           # the process() call that last took a token for it: duplicate-key check
    bint skip_special
    bint include_stop
    bint finished           # stopped, or flushed: takes no more tokens
    bint started            # a (not skipped) token was decoded: Metaspace's "first token" is over
    int strip_left          # leading strip chars still to drop; 0 once any other text came
    int stop_index          # index into stops of the stop string that ended it, or -1
    int num_tokens          # tokens fed so far (skipped specials included)
    int min_tokens          # stop strings are not looked for until more tokens than this came
    size_t emitted          # bytes of `text` already returned in deltas
    size_t scanned          # bytes of `text` already searched for stop strings (not held U+FFFDs)
    string pending          # byte_level: an unfinished UTF-8 character; else: the open byte run
    string text             # final text so far (decoded, stripped; cleaned up where `cleanup`)
    bint deltas             # process() reports its new text every call, not only its stop
    vector[int32_t] tokens  # every token fed, in order (the completion's token ids)
    vector[string] stops    # UTF-8
    bint cleanup            # the table's cleanup replacements apply (TokenTable.decode; no sequence)
    vector[string] clean_buf  # per cleanup rule: input it holds back (a possible pattern start)


cdef class TokenTable:
    """What each token id contributes to the decoded text; built once per tokenizer.

    Use `nanovllm.token_table.build_token_table(tokenizer)`; the constructor takes the already
    interpreted decoder:

    pieces: one entry per id: the token's raw bytes (`byte_level=True`), or the UTF-8 of its text
        after the decoder's per-token replacements (`byte_level=False`); None for an id that has no
        token (decoded as nothing).
    special_ids: ids dropped by skip_special_tokens.
    byte_ids: {id: byte} of ByteFallback `<0xNN>` tokens (byte_level=False only).
    first_pieces: for Metaspace, the pieces as the first token of a text decodes (marker dropped);
        same length as pieces, or None when the position does not matter.
    strip_char, strip_left: a `Strip(content, start, 0)` after `Fuse`: drop up to strip_left leading
        strip_char characters of the whole text.
    cleanup: (old, new) pairs applied in order as `text.replace(old, new)` to the whole text
        (transformers' clean_up_tokenization); empty when the tokenizer does not clean up.
    """

    cdef string blob                  # all pieces back to back
    cdef vector[uint32_t] offs        # piece i is blob[offs[i]:offs[i+1]]
    cdef string first_blob
    cdef vector[uint32_t] first_offs
    cdef vector[uint8_t] flags
    cdef string strip_u8
    cdef vector[string] clean_old
    cdef vector[string] clean_new
    cdef readonly bint byte_level
    cdef readonly bint metaspace_first
    cdef readonly int strip_left
    cdef readonly str strip_char
    cdef readonly tuple cleanup
    cdef readonly frozenset special_ids
    cdef list _token_strings          # each id's decode_token string, made at first use
    cdef bytearray _token_partial     # 1 where that string ends in U+FFFD (a character's part)
    cdef bytes _leading_spaces         # per id, the spaces its logprob string starts with at least

    def __init__(
        self,
        pieces,
        *,
        bint byte_level,
        special_ids=(),
        byte_ids=None,
        first_pieces=None,
        str strip_char=" ",
        int strip_left=0,
        cleanup=(),
        leading_spaces=None,
    ):
        cdef Py_ssize_t n = len(pieces), i
        cdef bytes p
        if n == 0 or n > INT32_MAX:
            raise ValueError(f"a token table needs 1 to {INT32_MAX} ids, got {n}")
        if strip_left < 0 or len(strip_char) != 1:
            raise ValueError("strip_char must be one character and strip_left >= 0")
        cdef dict bytes_of = dict(byte_ids or {})
        if bytes_of and byte_level:
            raise ValueError("byte_ids (ByteFallback) only apply to byte_level=False tables")
        for x, b in bytes_of.items():
            if not 0 <= x < n or not 0 <= b < 256 or pieces[x] is None:
                raise ValueError(f"bad byte token {x} -> {b}")
        self.byte_level = byte_level
        self.flags.assign(n, 0)
        self.offs.reserve(n + 1)
        self.offs.push_back(0)
        for i in range(n):
            p = pieces[i]  # TypeError unless bytes or None
            if p is None:
                self.flags[i] = F_HOLE
            elif i in bytes_of:
                # A byte token's piece is its byte (ids keep one layout whatever their kind).
                self.flags[i] = F_BYTE
                self.blob.push_back(<char><uint8_t>bytes_of[i])
            else:
                if not byte_level and not _utf8_valid(p):
                    raise ValueError(f"piece of token {i} is not valid UTF-8: {p!r}")
                self.blob.append(<const char*>p, len(p))
            if self.blob.size() > 0xFFFFFFFF:
                raise ValueError("token table too large")
            self.offs.push_back(<uint32_t>self.blob.size())
        specials = frozenset(int(x) for x in special_ids)
        for x in specials:
            if not 0 <= x < n:
                raise ValueError(f"special id {x} outside the table (size {n})")
            self.flags[x] |= F_SPECIAL
        self.special_ids = specials
        self.metaspace_first = first_pieces is not None
        if self.metaspace_first:
            if byte_level or len(first_pieces) != n:
                raise ValueError("first_pieces must have one entry per id (byte_level=False)")
            self.first_offs.reserve(n + 1)
            self.first_offs.push_back(0)
            for i in range(n):
                p = first_pieces[i]
                if p is not None:
                    if not _utf8_valid(p):
                        raise ValueError(f"first piece of token {i} is not valid UTF-8: {p!r}")
                    self.first_blob.append(<const char*>p, len(p))
                self.first_offs.push_back(<uint32_t>self.first_blob.size())
        self.strip_char = strip_char
        self.strip_u8 = strip_char.encode()
        self.strip_left = strip_left
        rules = tuple((str(a), str(b)) for a, b in cleanup)
        for a, b in rules:
            if not a:
                raise ValueError("cleanup patterns must be non-empty")
            self.clean_old.push_back(a.encode())
            self.clean_new.push_back(b.encode())
        self.cleanup = rules
        if leading_spaces is not None and len(leading_spaces) != n:
            raise ValueError("leading_spaces must have one entry per id")
        self._leading_spaces = None if leading_spaces is None else bytes(leading_spaces)

    def __len__(self) -> int:
        return <Py_ssize_t>self.flags.size()

    @property
    def kind(self) -> str:
        return "byte_level" if self.byte_level else "pieces"

    def piece(self, token_id: int) -> bytes | None:
        """The stored piece of a token: its bytes or text (UTF-8), the byte of a ByteFallback
        token, None for an id without a token."""
        cdef int32_t i = self._id(token_id)
        if self.flags[i] & F_HOLE:
            return None
        return self.blob.substr(self.offs[i], self.offs[i + 1] - self.offs[i])

    def is_special(self, token_id: int) -> bool:
        return bool(self.flags[self._id(token_id)] & F_SPECIAL)

    cdef int32_t _id(self, object token_id) except -1:
        # Any Python int (also a huge one) outside the table is a ValueError, not an OverflowError.
        if not 0 <= token_id < <Py_ssize_t>self.flags.size():
            raise ValueError(f"token id {token_id} outside the token table (size {self.flags.size()})")
        return <int32_t>token_id

    cdef int _check_id(self, int64_t token_id) except -1:
        if token_id < 0 or token_id >= <int64_t>self.flags.size():
            raise ValueError(f"token id {token_id} outside the token table (size {self.flags.size()})")
        return 0

    def decode(self, ids, bint skip_special_tokens=False) -> str:
        """Like `tokenizer.decode(ids, skip_special_tokens=...)`, from the table."""
        cdef const int32_t[::1] toks = _as_int32(ids, "ids")
        cdef Py_ssize_t i
        for i in range(toks.shape[0]):
            self._check_id(toks[i])
        cdef Seq s
        _init_seq(self, &s, 0, skip_special_tokens, False)
        for i in range(toks.shape[0]):
            _feed(self, &s, toks[i])
        _finish(self, &s)
        return _utf8(s.text, 0, s.text.size())

    def decode_token(self, token_id: int) -> str:
        """A logprob's `decoded_token` as vLLM makes it (remembered): `tokenizer.decode([token_id])`,
        with at least `leading_spaces[token_id]` leading spaces (a Metaspace tokenizer's markers,
        which decode drops from a text's first token; vLLM puts them back). A string ending in
        U+FFFD (part of a character) is what vLLM then corrects from the tokens before it
        (sample.logprobs)."""
        return self._token_string(self._id(token_id))

    def decode_tokens(self, ids) -> list[str]:
        """`[decode_token(i) for i in ids]` in one call (logprobs of a whole step). A token's
        string does not depend on its neighbours here, so each id is decoded once per table and
        remembered: the logprobs of a step ask for ~6 per sequence, mostly the same few."""
        cdef const int32_t[::1] toks = _as_int32(ids, "ids")
        cdef Py_ssize_t i
        for i in range(toks.shape[0]):
            self._check_id(toks[i])
        return [self._token_string(toks[i]) for i in range(toks.shape[0])]

    cdef object _token_string(self, int32_t tok):
        """decode_token(tok), remembered (`tok` already checked)."""
        if self._token_strings is None:
            self._token_strings = [None] * <Py_ssize_t>self.flags.size()
            self._token_partial = bytearray(<Py_ssize_t>self.flags.size())
        text = self._token_strings[tok]
        if text is None:
            text = self._decode_one(tok)
            if self._leading_spaces is not None:
                text = u" " * max(0, self._leading_spaces[tok] - (len(text) - len(text.lstrip(u" ")))) + text
            self._token_strings[tok] = text
            self._token_partial[tok] = text.endswith(u"\ufffd")
        return text

    def corrected_string(self, token_id: int, context) -> str:
        """vLLM's logprob string of `token_id` where its decode_token ends in U+FFFD (part of a
        character), from `context`, the sequence's tokens before it (the last 4 count, oldest
        first): of the shortest tail of the context whose decode with the token ends no character
        short, that decode less what the tail's whole-text tokens decode to; "" where none
        (v1/engine/logprobs.py _correct_decoded_token)."""
        cdef int32_t tok = self._id(token_id)
        cdef list ctx = [self._id(c) for c in context]
        if len(ctx) > 4:
            ctx = ctx[len(ctx) - 4:]
        cdef Py_ssize_t m = len(ctx), n, clean, common
        cdef list tail
        for n in range(1, m + 1):
            tail = ctx[m - n:]
            full = self._decode_ids(tail + [tok])
            if full.endswith(u"\ufffd"):
                continue
            clean = n  # the tail's tokens before its trailing parts of characters
            while clean > 0 and self._partial_of(tail[clean - 1]):
                clean -= 1
            prefix = self._decode_ids(tail[:clean]) if clean else u""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
                common += 1
            return full[common:]
        return u""

    cdef bint _partial_of(self, int32_t tok):
        """Whether decode_token(tok) ends in U+FFFD (`tok` already checked)."""
        self._token_string(tok)  # makes both, once
        return self._token_partial[tok]

    cdef object _decode_ids(self, list ids):
        """tokenizer.decode(ids) of checked ids."""
        cdef Seq s
        _init_seq(self, &s, 0, False, False)
        for t in ids:
            _feed(self, &s, <int32_t>t)
        _finish(self, &s)
        return _utf8(s.text, 0, s.text.size())

    cdef object _decode_one(self, int32_t tok):
        cdef Seq s
        _init_seq(self, &s, 0, False, False)
        _feed(self, &s, tok)
        _finish(self, &s)
        return _utf8(s.text, 0, s.text.size())

    def logprob_entries(self, top_ids, top_logprobs, chosen_ids, chosen_logprob, chosen_rank, wanted,
                        logprob) -> tuple[list[dict], frozenset]:
        """A step's logprob rows as vLLM hands them out: per row `{token id: logprob(value, rank,
        string)}` of its chosen token (first, as vLLM orders it) and its `wanted[r]` most likely
        tokens (most likely first; the chosen one's object serves its top-k place too). `logprob` is
        the class to build (outputs.Logprob). Also the rows holding a string that ends in U+FFFD
        (part of a character), which vLLM corrects from the tokens before them.
        One C loop for the whole step: in Python the same dicts cost ~4 us a row."""
        cdef const int64_t[:, ::1] ti = top_ids
        cdef const double[:, ::1] tl = top_logprobs
        cdef const int64_t[::1] ci = _as_int64(chosen_ids, "chosen_ids")
        cdef const double[::1] cl = chosen_logprob
        cdef const int64_t[::1] cr = _as_int64(chosen_rank, "chosen_rank")
        cdef const int64_t[::1] w = _as_int64(wanted, "wanted")
        cdef Py_ssize_t rows = ti.shape[0], k = ti.shape[1], r, j, n
        if not (cl.shape[0] == ci.shape[0] == cr.shape[0] == w.shape[0] == rows) or tl.shape[0] != rows \
                or tl.shape[1] != k:
            raise ValueError("logprob_entries: the arrays disagree in shape")
        for r in range(rows):
            self._check_id(ci[r])
            for j in range(min(max(w[r], 0), k)):
                self._check_id(ti[r, j])
        cdef list out = []
        cdef list partial = []
        cdef dict entry
        cdef int64_t tid, cid
        cdef bint part
        for r in range(rows):
            cid = ci[r]
            mine = _new_logprob(logprob, cl[r], cr[r], self._token_string(<int32_t>cid))
            part = self._token_partial[cid]
            entry = {cid: mine}
            n = min(max(w[r], 0), k)
            for j in range(n):
                tid = ti[r, j]
                if tid != cid:
                    entry[tid] = _new_logprob(logprob, tl[r, j], j + 1, self._token_string(<int32_t>tid))
                    part = part or self._token_partial[tid]
            out.append(entry)
            if part:
                partial.append(r)
        return out, frozenset(partial)


cdef inline object _new_logprob(object cls, double value, int64_t rank, object text):
    # The fields set straight into the instance's slots: calling the dataclass would run its
    # __init__ as Python code, the larger part of an entry's cost (1,536 objects a step at 256
    # sequences with logprobs=5).
    obj = cls.__new__(cls)
    obj.logprob = value
    obj.rank = rank
    obj.decoded_token = text
    return obj


cdef int _init_seq(TokenTable t, Seq* s, int64_t key, bint skip_special, bint include_stop) except -1:
    s.key = key
    s.epoch = -1
    s.skip_special = skip_special
    s.include_stop = include_stop
    s.finished = False
    s.started = False
    s.strip_left = t.strip_left
    s.stop_index = -1
    s.num_tokens = 0
    s.min_tokens = 0
    s.emitted = 0
    s.scanned = 0
    s.pending.clear()
    s.text.clear()
    s.deltas = True
    s.tokens.clear()
    s.stops.clear()
    s.cleanup = not t.clean_old.empty()
    s.clean_buf.clear()
    s.clean_buf.resize(t.clean_old.size())
    return 0


cdef bint _has_text(TokenTable t, object toks, bint skip_special) except -1:
    """Whether any of `toks` reaches the decoder (in the table, not a hole, not a skipped special
    token). Walked as given, to the first that does (the prompt's first or second token, as a
    rule): a whole prompt's conversion for each of a request's n samples would cost far more."""
    cdef int64_t tok
    cdef uint8_t f
    for tok in toks:
        if tok < 0 or <size_t>tok >= t.flags.size():
            continue
        f = t.flags[tok]
        if not (f & F_HOLE or (f & F_SPECIAL and skip_special)):
            return True
    return False


cdef int _feed(TokenTable t, Seq* s, int32_t tok) except -1:
    """Decode one token (the caller checked its range) into s.text, holding back what may change."""
    s.num_tokens += 1
    cdef uint8_t f = t.flags[tok]
    if f & F_HOLE or (f & F_SPECIAL and s.skip_special):
        # tokenizer.decode filters these out before its decoder runs, so they do not even end a
        # ByteFallback run or count as Metaspace's first token.
        return 0
    cdef const char* p = t.blob.data() + t.offs[tok]
    cdef size_t n = t.offs[tok + 1] - t.offs[tok]
    if t.byte_level:
        s.pending.append(p, n)
        return _drain_bytes(t, s, False)
    if f & F_BYTE:
        s.pending.push_back(p[0])
        s.started = True
        return 0
    if not s.pending.empty():
        _close_run(t, s)
    if t.metaspace_first and not s.started:
        p = t.first_blob.data() + t.first_offs[tok]
        n = t.first_offs[tok + 1] - t.first_offs[tok]
    s.started = True
    return _emit(t, s, p, n)


cdef int _drain_bytes(TokenTable t, Seq* s, bint final) except -1:
    """Byte-level: decode s.pending lossily, keeping an unfinished last character unless final.

    Equal to decoding the whole byte string at once: a prefix's lossy decoding only differs from
    the full one where a character is cut off at its end.
    """
    cdef const unsigned char* b = <const unsigned char*>s.pending.data()
    cdef size_t n = s.pending.size(), i = 0, j = 0, start = 0
    cdef int kind
    cdef bint held = False
    cdef string out
    while i < n:
        if b[i] < 0x80:
            i += 1
            continue
        kind = _utf8_seq(b, i, n, &j)
        if kind == 1:
            i = j
            continue
        if kind == 2 and not final:
            held = True
            break
        # Invalid (or cut off at the very end of the text): one U+FFFD for b[i:j].
        out.append(s.pending, start, i - start)
        out.append(REPL, 3)
        i = j
        start = j
    if out.empty():  # the common case: no replacement, pass the valid prefix straight through
        if i > 0:
            _emit(t, s, s.pending.data(), i)
    else:
        out.append(s.pending, start, i - start)
        _emit(t, s, out.data(), out.size())
    if held:
        s.pending.erase(0, i)
    else:
        s.pending.clear()
    return 0


cdef int _close_run(TokenTable t, Seq* s, bint at_end=False) except -1:
    """ByteFallback: a run of byte tokens ended; it decodes as a whole or as one U+FFFD per byte.
    `at_end` (a sequence's flush): an invalid run keeps only its longest valid beginning."""
    cdef string run
    cdef size_t k
    run.swap(s.pending)
    if _utf8_valid(run):
        _emit(t, s, run.data(), run.size())
    elif at_end:
        _emit(t, s, run.data(), _valid_prefix(run))
    else:
        for k in range(run.size()):
            _emit(t, s, REPL, 3)
    return 0


cdef size_t _before_replacements(Seq* s, size_t end, size_t floor) noexcept:
    """`end` moved back over the U+FFFDs that end s.text[floor:end] (vLLM's text never ends in
    one: its decoder holds a step whose text does, so neither its output nor its stop strings
    see them until text follows)."""
    while end >= floor + 3 and memcmp(s.text.data() + end - 3, REPL, 3) == 0:
        end -= 3
    return end


cdef int _emit(TokenTable t, Seq* s, const char* p, size_t n) except -1:
    """Final decoded text -> Strip -> cleanup -> s.text."""
    cdef size_t m = t.strip_u8.size()
    while s.strip_left > 0 and n > 0:
        # Strip runs on the fused text: only its first characters count, however they arrive.
        if n >= m and memcmp(p, t.strip_u8.data(), m) == 0:
            p += m
            n -= m
            s.strip_left -= 1
        else:
            s.strip_left = 0
    if not s.cleanup:
        if n:
            s.text.append(p, n)
        return 0
    return _cleanup(t, s, p, n, False)


cdef int _cleanup(TokenTable t, Seq* s, const char* p, size_t n, bint final) except -1:
    """The cleanup replacements as a cascade of streaming `str.replace`s.

    Each stage replaces, left to right and without overlaps, every complete occurrence in its
    buffer, and holds back the longest suffix that could still become an occurrence; its output
    feeds the next stage. That is exactly `text.replace(o1, n1).replace(o2, n2)...` on the whole
    text once `final` releases everything.
    """
    cdef string cur, nxt
    cdef string* buf
    cdef const string* old
    cdef size_t r, pos, i, hold, k, rest
    if n:
        cur.assign(p, n)
    for r in range(t.clean_old.size()):
        old = &t.clean_old[r]
        buf = &s.clean_buf[r]
        buf.append(cur)
        nxt.clear()
        pos = 0
        while True:
            i = buf.find(old[0], pos)
            if i == npos:
                break
            nxt.append(buf[0], pos, i - pos)
            nxt.append(t.clean_new[r])
            pos = i + old.size()
        hold = 0
        if not final:
            rest = buf.size() - pos
            k = old.size() - 1
            if k > rest:
                k = rest
            while k > 0:
                if memcmp(buf.data() + buf.size() - k, old.data(), k) == 0:
                    hold = k
                    break
                k -= 1
        nxt.append(buf[0], pos, buf.size() - pos - hold)
        buf.erase(0, buf.size() - hold)
        cur.swap(nxt)
    s.text.append(cur)
    return 0


cdef int _check_stop(Seq* s) except -1:
    """Search the text added since the last check for stop strings; on a match, cut and finish.

    The match that wins is the one that ends first in the text (ties: the first in the stop list,
    as vLLM's check_stop_strings), i.e. the first stop string that has been generated completely;
    this does not depend on how the tokens were split into steps. (vLLM takes the first in the
    list among those its step's new text holds; the same whenever a step adds one token's text.)
    Trailing U+FFFDs are not searched until text follows them, as vLLM's text holds them back.
    """
    cdef size_t L = _before_replacements(s, s.text.size(), s.scanned)
    # As vLLM: until more than min_tokens tokens came, text is passed over, not searched; a stop
    # string that completes afterwards is still found if it began in that text.
    if s.stops.empty() or L == s.scanned or s.num_tokens <= s.min_tokens:
        s.scanned = L
        return 0
    cdef size_t best_end = npos, best_len = 0, m, start, pos, end, idx
    cdef int best = -1
    for idx in range(s.stops.size()):
        m = s.stops[idx].size()
        # A match ending before `scanned` would have been found by an earlier check.
        start = s.scanned + 1 - m if s.scanned + 1 > m else 0
        pos = s.text.find(s.stops[idx], start)
        if pos == npos or pos + m > L:
            continue
        end = pos + m
        if end < best_end:
            best_end = end
            best_len = m
            best = <int>idx
    s.scanned = L
    if best >= 0:
        s.text.resize(best_end if s.include_stop else best_end - best_len)
        s.scanned = s.text.size()
        s.stop_index = best
        s.finished = True
        s.pending.clear()
        for idx in range(s.clean_buf.size()):
            s.clean_buf[idx].clear()
    return 0


cdef size_t _releasable(Seq* s) noexcept:
    """How far the text may be returned: all but the longest suffix that starts a stop string.

    Any future match must start inside that suffix, and the earliest such start never moves back,
    so text before it is final. With include_stop_str_in_output nothing needs holding back: text
    up to a match's end is output either way, and matches are found before anything is returned.
    """
    cdef size_t L = s.text.size()
    if s.finished:
        return L
    L = _before_replacements(s, L, s.emitted)
    if s.include_stop or s.stops.empty():
        return L
    cdef size_t avail = L - s.emitted, hold = 0, k, idx
    for idx in range(s.stops.size()):
        k = s.stops[idx].size() - 1
        if k > avail:
            k = avail
        while k > hold:
            if memcmp(s.text.data() + L - k, s.stops[idx].data(), k) == 0:
                hold = k
                break
            k -= 1
    return L - hold


cdef int _finish(TokenTable t, Seq* s, bint sequence=False) except -1:
    """End of the token stream: release the held bytes and buffers, then a last stop check. For a
    `sequence` (not TokenTable.decode), vLLM's end: no trailing U+FFFD unless a stop string cut it."""
    if s.finished:
        return 0
    if t.byte_level:
        _drain_bytes(t, s, True)
    elif not s.pending.empty():
        _close_run(t, s, sequence)
    if s.cleanup:
        _cleanup(t, s, NULL, 0, True)
    if sequence:  # the held U+FFFDs go before the last stop check: no stop string sees them
        s.text.resize(_before_replacements(s, s.text.size(), s.emitted))
        if s.scanned > s.text.size():
            s.scanned = s.text.size()
    _check_stop(s)
    s.finished = True
    return 0


cdef const int32_t[::1] _as_int32(object a, str name):
    """A 1-D int32 view of `a`: zero-copy for a contiguous int32 buffer, else a checked conversion."""
    cdef const int32_t[::1] view
    try:
        view = a
        return view
    except (TypeError, ValueError, BufferError):
        pass
    return _convert(a, name, "int32")


cdef const int64_t[::1] _as_int64(object a, str name):
    cdef const int64_t[::1] view
    try:
        view = a
        return view
    except (TypeError, ValueError, BufferError):
        pass
    return _convert(a, name, "int64")


cdef object _convert(object a, str name, str dtype):
    import numpy as np

    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if arr.dtype.kind == "O":  # Python ints too large for int64 (or not ints at all)
        from operator import index

        vals = [index(x) for x in arr]  # TypeError for non-integers
        if min(vals) < np.iinfo(dtype).min or max(vals) > np.iinfo(dtype).max:
            raise ValueError(f"{name} has values outside {dtype}")
        arr = np.array(vals, dtype=dtype)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    info = np.iinfo(dtype)
    if arr.min() < info.min or arr.max() > info.max:
        raise ValueError(f"{name} has values outside {dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


cdef class Detokenizer:
    """Incremental detokenization with stop strings for many sequences, one call per step.

    Sequences are identified by an int64 key (e.g. the core's sequence id).
    """

    cdef readonly TokenTable table
    cdef vector[Seq] seqs
    cdef vector[size_t] free_slots
    cdef unordered_map[int64_t, size_t] slot_of
    cdef int64_t epoch

    def __init__(self, TokenTable table not None) -> None:
        self.table = table
        self.epoch = 0

    def __len__(self) -> int:
        return <Py_ssize_t>self.slot_of.size()

    def __contains__(self, key) -> bool:
        return self.slot_of.count(<int64_t>key) > 0

    cdef Seq* _get(self, int64_t key) except NULL:
        cdef unordered_map[int64_t, size_t].iterator it = self.slot_of.find(key)
        if it == self.slot_of.end():
            raise KeyError(f"unknown sequence key {key}")
        return &self.seqs[deref(it).second]

    def add(
        self,
        int64_t key,
        *,
        bint skip_special_tokens=True,
        stop=(),
        bint include_stop_str_in_output=False,
        int min_tokens=0,
        bint deltas=True,
        prompt_token_ids=None,
    ) -> None:
        """Start a sequence. `stop`: strings that end it at their first occurrence in its text,
        looked for once more than `min_tokens` tokens have come. `deltas=False`: process() leaves
        it out of its result unless a stop string ends it (its text is read at the end with
        flush() and text(), so a step costs no Python object for it). `prompt_token_ids`: the
        tokens its text continues, as vLLM decodes an output after its prompt: where the prompt
        decodes to any text, the first output token is not the start of the text (SentencePiece's
        Strip and Metaspace leave its leading space)."""
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        if self.slot_of.count(key):
            raise ValueError(f"sequence key {key} already added")
        if isinstance(stop, str):
            stop = (stop,)
        cdef list encoded = []
        for x in stop:
            if not isinstance(x, str) or not x:
                raise ValueError(f"stop strings must be non-empty str, got {x!r}")
            encoded.append(x.encode())
        cdef size_t slot
        if self.free_slots.empty():
            slot = self.seqs.size()
            self.seqs.resize(slot + 1)
        else:
            slot = self.free_slots.back()
            self.free_slots.pop_back()
        cdef Seq* s = &self.seqs[slot]
        _init_seq(self.table, s, key, skip_special_tokens, include_stop_str_in_output)
        s.cleanup = False  # vLLM's decoder (tokenizers' DecodeStream) applies no cleanup
        if prompt_token_ids is not None and _has_text(self.table, prompt_token_ids, skip_special_tokens):
            s.started = True
            s.strip_left = 0
        cdef bytes e
        for e in encoded:
            s.stops.push_back(e)
        s.min_tokens = min_tokens
        s.deltas = deltas
        self.slot_of[key] = slot

    def remove(self, int64_t key) -> None:
        """Forget a sequence (finished or aborted)."""
        cdef Seq* s = self._get(key)
        cdef size_t slot = <size_t>(s - &self.seqs[0])
        # Free the memory now; the slot's strings are reused by the next add().
        s.pending.clear()
        s.text.clear()
        s.text.shrink_to_fit()
        s.tokens.clear()
        s.tokens.shrink_to_fit()
        s.stops.clear()
        s.clean_buf.clear()
        self.slot_of.erase(key)
        self.free_slots.push_back(slot)

    def process(self, keys, tokens, cu_tokens=None, stop_terminated=None) -> list:
        """Append tokens[i] to sequence keys[i], for all i, and return what each sequence gained.

        keys: int64[n], each at most once per call; tokens: int32[n]. With `cu_tokens` (int32/64
        [n + 1], prefix sums), sequence keys[i] gets tokens[cu_tokens[i]:cu_tokens[i + 1]] instead
        (several tokens per step, e.g. speculative decoding; a stop string drops the rest).
        `stop_terminated`: keys whose last token here ended them (EOS, a stop token id): that token
        joins their tokens but not their text, as vLLM leaves it out.
        Returns [(key, delta, stop)] in the order of keys: `delta` the new text (str, maybe empty),
        `stop` the stop string that finished the sequence in this call, else None. Sequences added
        with deltas=False appear only in the call in which a stop string finishes them.
        Raises (before changing anything) KeyError for an unknown key, ValueError for a repeated
        key, a finished sequence or a token id outside the table.
        """
        cdef const int64_t[::1] k = _as_int64(keys, "keys")
        cdef const int32_t[::1] tok = _as_int32(tokens, "tokens")
        cdef const int64_t[::1] cu
        cdef Py_ssize_t n = k.shape[0], i, j, lo, hi
        cdef bint multi = cu_tokens is not None
        if multi:
            cu = _as_int64(cu_tokens, "cu_tokens")
            if cu.shape[0] != n + 1 or cu[0] != 0 or cu[n] != tok.shape[0]:
                raise ValueError(
                    f"cu_tokens must be prefix sums of length {n + 1} from 0 to {tok.shape[0]}")
            for i in range(n):
                if cu[i + 1] < cu[i]:
                    raise ValueError("cu_tokens must be non-decreasing")
        elif tok.shape[0] != n:
            raise ValueError(f"{n} keys but {tok.shape[0]} tokens")
        cdef TokenTable t = self.table
        cdef int32_t vocab = <int32_t>t.flags.size()
        cdef Seq* s
        cdef vector[Seq*] batch
        cdef unordered_map[int64_t, size_t].iterator it
        cdef unordered_set[int64_t] silent  # stop_terminated
        if stop_terminated is not None:
            for key in _as_int64(stop_terminated, "stop_terminated"):
                silent.insert(key)
        # Validate everything first, so that a bad call changes no sequence.
        self.epoch += 1
        batch.resize(n)
        for i in range(n):
            it = self.slot_of.find(k[i])
            if it == self.slot_of.end():
                raise KeyError(f"unknown sequence key {k[i]}")
            s = &self.seqs[deref(it).second]
            if s.epoch == self.epoch:
                raise ValueError(f"sequence key {k[i]} appears more than once in one process() call")
            if s.finished:
                raise ValueError(
                    f"sequence {k[i]} is finished ({'stop string' if s.stop_index >= 0 else 'flushed'})"
                    " and takes no more tokens")
            s.epoch = self.epoch
            batch[i] = s
        for j in range(tok.shape[0]):
            if tok[j] < 0 or tok[j] >= vocab:
                raise ValueError(f"token id {tok[j]} outside the token table (size {vocab})")
        cdef list out = []
        for i in range(n):
            s = batch[i]
            if multi:
                lo = cu[i]
                hi = cu[i + 1]
            else:
                lo = i
                hi = i + 1
            for j in range(lo, hi):
                s.tokens.push_back(tok[j])
                if j == hi - 1 and silent.size() and silent.count(k[i]):
                    break
                _feed(t, s, tok[j])
                # Check after each token, so that a stop drops the tokens after it.
                if multi and hi - lo > 1 and s.stops.size():
                    _check_stop(s)
                    if s.finished:
                        break
            _check_stop(s)
            if s.deltas or s.stop_index >= 0:
                out.append(self._result(s))
        return out

    cdef tuple _result(self, Seq* s):
        cdef size_t end = _releasable(s)
        delta = _utf8(s.text, s.emitted, end)
        if end > s.emitted:
            s.emitted = end
        stop = None
        if s.stop_index >= 0 and s.finished and s.epoch == self.epoch:
            stop = _utf8(s.stops[s.stop_index], 0, s.stops[s.stop_index].size())
        return (s.key, delta, stop)

    def flush(self, int64_t key) -> str:
        """End of the sequence: return everything held back, as vLLM's text ends: without trailing
        U+FFFDs (an unfinished character is dropped; an open ByteFallback run keeps its valid
        beginning). The sequence takes no more tokens afterwards; flushing again returns ""."""
        cdef Seq* s = self._get(key)
        _finish(self.table, s, True)
        cdef size_t start = s.emitted
        s.emitted = s.text.size()
        return _utf8(s.text, start, s.text.size())

    def text(self, int64_t key) -> str:
        """The sequence's whole text if it ended now, as flush() would end it: its tokens decoded
        (tokenizer.decode without cleanup), cut at a stop string, without trailing U+FFFDs
        (changes nothing)."""
        cdef Seq* s = self._get(key)
        cdef Seq tmp = s[0]
        _finish(self.table, &tmp, True)
        return _utf8(tmp.text, 0, tmp.text.size())

    def token_ids(self, int64_t key, Py_ssize_t start=0) -> list:
        """The tokens fed to the sequence so far, from index `start` on."""
        cdef Seq* s = self._get(key)
        cdef Py_ssize_t i, n = <Py_ssize_t>s.tokens.size()
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        return [s.tokens[i] for i in range(start, n)]

    def stop_reason(self, int64_t key) -> str | None:
        """The stop string that finished the sequence, or None."""
        cdef Seq* s = self._get(key)
        if s.stop_index < 0:
            return None
        return _utf8(s.stops[s.stop_index], 0, s.stops[s.stop_index].size())

    def is_finished(self, int64_t key) -> bool:
        """True once a stop string matched or flush() was called."""
        return self._get(key).finished

