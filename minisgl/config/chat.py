"""How chat requests become prompts and answers: the chat template and the output parsers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minisgl.config.cli import cli_field
from minisgl.core.errors import check_fields

TOOL_CALL_PARSERS = ("hermes", "qwen25", "qwen3", "llama3", "mistral", "deepseek")
REASONING_PARSERS = ("qwen3", "deepseek-r1")


@dataclass(frozen=True)
class ChatConfig:
    # Jinja text that replaces the model's own chat template; None: the model's.
    template: str | None = None
    # Without a parser detected from the template only forced calls, as bare JSON, are parsed.
    tool_call_parser: str | None = cli_field(
        None,
        "the format of the model's tool calls (hermes = qwen25 = qwen3: <tool_call>{...}"
        "</tool_call>; llama3: JSON after <|python_tag|>; mistral: [TOOL_CALLS][...]; "
        "deepseek: DeepSeek-R1/V3's <｜tool▁calls▁begin｜>...); "
        "default: detected from the chat template",
        "chat",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = cli_field(
        None,
        "split the model's <think>...</think> part into reasoning_content; default: none (the "
        "thinking stays in the content)",
        "chat",
        choices=REASONING_PARSERS,
    )

    def __post_init__(self) -> None:
        check_fields(self)


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
