"""What a chat template is given, as vLLM gives it: the template (vLLM's --chat-template and
LLM(chat_template=...): a file's path or the template itself), and a message's content (vLLM's
"string" content format: OpenAI's list of content parts becomes their texts joined by newlines)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nanovllm.quote import quote


def joined_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """`content` as one string: a string as it is, None as "", a list of {"type": "text", "text": ...}
    parts joined by newlines. Any other part (an image, audio) is a ValueError naming its type."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        text = part.get("text") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(text, str):
            raise ValueError(f"only text content parts are supported, got type {quote(kind)}")
        texts.append(text)
    return "\n".join(texts)


def load_chat_template(value: str | Path | None, where: str) -> str | None:
    """The template `value` names: a file's path, or the template itself (Jinja needs braces; a
    path has none). A path to no file is a FileNotFoundError naming `where` (the option)."""
    if value is None or (isinstance(value, str) and any(c in value for c in "{}\n")):
        return value
    path = Path(value)
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no such file: {path}")
    return path.read_text(encoding="utf-8")
