"""What a chat template is given, as vLLM gives it: the template (vLLM's --chat-template and
LLM(chat_template=...): a file's path or the template itself), a message's content (vLLM's
"string" content format: OpenAI's list of content parts becomes their texts joined by newlines),
and the conversation's roles and tool calls as vLLM hands them over (`template_conversation`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nanovllm.quote import quote

logger = logging.getLogger(__name__)


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
        if kind != "text":
            raise ValueError(f"only text content parts are supported, got type {quote(kind)}")
        if not isinstance(text, str):
            raise ValueError(f"a text content part needs its text as a string, got {quote(text)}")
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


def template_conversation(conversation: Sequence[Mapping[str, Any]],
                          template: str | Mapping[str, str] | None) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to a chat template. "developer" (OpenAI's newer name for
    the system role) becomes "system" where the template never names it, and the system messages
    are then merged, in order, into one at the front (templates such as Qwen's accept a system
    message only there). An assistant message's tool call arguments (a JSON string in OpenAI's
    format) become the object templates expect: none, an empty string or anything that is not a
    JSON object becomes {} (with a warning: failing would break every later turn of the chat); null
    or empty tool_calls are dropped."""
    messages = [dict(m) for m in conversation]
    for m in messages:
        if m.get("role") == "assistant" and "tool_calls" in m:
            calls = m["tool_calls"]
            if calls is None or (isinstance(calls, list) and not calls):
                del m["tool_calls"]  # null or [] would take templates down their tool-call path
            elif isinstance(calls, list):
                m["tool_calls"] = [_with_parsed_arguments(call) for call in calls]
    sources = template.values() if isinstance(template, Mapping) else [template or ""]
    if not any(m.get("role") == "developer" for m in messages) or any(
            '"developer"' in t or "'developer'" in t for t in sources):
        return messages
    for m in messages:
        if m.get("role") == "developer":
            m["role"] = "system"
            m.pop("tools", None)
    systems = [i for i, m in enumerate(messages) if m.get("role") == "system"]
    if systems == [0]:
        return messages
    texts = [t for i in systems if (t := _system_text(messages[i].get("content")))]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in messages if m.get("role") != "system")]


def _system_text(content: Any) -> str:
    if isinstance(content, list):  # text parts only, as vLLM merges them
        return "\n".join(p["text"] if isinstance(p, Mapping) else p for p in content
                         if isinstance(p, str) or (isinstance(p, Mapping) and isinstance(p.get("text"), str)))
    return "" if content is None else str(content)


def _with_parsed_arguments(call: Any) -> Any:
    if not isinstance(call, Mapping) or call.get("type", "function") != "function" or not isinstance(
            call.get("function"), Mapping):
        raise ValueError("an assistant message's tool_calls must be objects of type 'function' with a 'function' "
                         "object")
    function = dict(call["function"])
    given = function.get("arguments")
    arguments = given
    if isinstance(given, str) and given:
        try:
            arguments = json.loads(given)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, Mapping):
        if given:
            logger.warning("tool call %r: its arguments are not a JSON object; the template gets {}",
                           function.get("name"))
        arguments = {}
    function["arguments"] = arguments
    return {**call, "function": function}
