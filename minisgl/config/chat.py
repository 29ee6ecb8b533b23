"""How chat requests become prompts and answers: the chat template and the output parsers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TOOL_CALL_PARSERS = ("hermes", "qwen25", "qwen3", "llama3", "mistral", "deepseek")
REASONING_PARSERS = ("qwen3", "deepseek-r1")


@dataclass(frozen=True)
class ChatConfig:
    # Jinja text that replaces the model's own chat template; None: the model's.
    template: str | None = None
    # How tool calls are parsed; None: detected from the chat template (if it shows a known
    # format; otherwise only forced calls, as bare JSON, are parsed).
    tool_call_parser: str | None = None
    # How the thinking part of the output is split off; None: it stays in the content.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser: {self.tool_call_parser!r} is not one of {TOOL_CALL_PARSERS}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser: {self.reasoning_parser!r} is not one of {REASONING_PARSERS}"
            )


def resolve_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the value itself when it is a Jinja template."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and "\n" not in value:
        if not path.is_file():
            raise ValueError(
                f"chat_template: {value!r} is neither a file nor a Jinja template (one holds "
                "`{{` or `{%`)"
            )
        return path.read_text()
    if "{{" not in value and "{%" not in value:
        raise ValueError("chat_template: not a Jinja template (no `{{` or `{%` in it)")
    return value
