"""How an error message quotes what it was given: a short prefix, never a whole 100 KB value (a
client's bad input echoed back in full costs bandwidth and hides the message)."""

from __future__ import annotations

QUOTE_LIMIT = 64


def shorten(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text` cut to its first `limit` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """repr(value), shortened."""
    return shorten(repr(value), limit)
