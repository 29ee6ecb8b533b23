"""Other servers' spellings of this server's flags and values, accepted as aliases: vLLM's, the
ones its users type (`--max-model-len`, `--dtype half`, ...). One table; `add_aliases` adds
them to a parser whose own flags already exist, so `--help` lists each beside its flag."""

from __future__ import annotations

import argparse
from collections.abc import Callable

# alias -> this server's flag (the same value, the same meaning)
FLAG_ALIASES = {
    "--max-model-len": "--max-context-len",
    "--gpu-memory-utilization": "--mem-fraction",
    "--max-num-seqs": "--max-running-requests",
    "--tensor-parallel-size": "--tp-size",
    "-tp": "--tp-size",
    "--max-num-batched-tokens": "--max-prefill-tokens",
}
# flag -> {alias value: this server's value}
VALUE_ALIASES = {
    "--dtype": {"half": "float16", "bf16": "bfloat16", "float": "float32", "fp16": "float16"},
    "--kv-cache-dtype": {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"},
}
# switch alias -> (this server's flag, the value it stands for)
SWITCH_ALIASES = {
    "--enable-prefix-caching": ("--cache", "radix"),
    "--no-enable-prefix-caching": ("--cache", "naive"),
}


def add_aliases(parser: argparse.ArgumentParser) -> None:
    """Add the table's aliases to `parser`, which must have every flag they stand for."""
    actions = parser._option_string_actions  # argparse's own index of option strings
    for alias, flag in FLAG_ALIASES.items():
        action = actions[flag]
        action.option_strings = [*action.option_strings, alias]
        actions[alias] = action
    for flag, values in VALUE_ALIASES.items():
        action = actions[flag]
        then = action.type if callable(action.type) else None
        action.type = _translate(values, then)
        action.help = (
            f"{action.help} (also: " + ", ".join(f"{a} = {v}" for a, v in values.items()) + ")"
        )
    for alias, (flag, value) in SWITCH_ALIASES.items():
        target = actions[flag]
        group = getattr(target, "container", parser)  # argparse notes the action's group
        group.add_argument(  # listed in the flag's own group
            alias,
            dest=target.dest,
            action="store_const",
            const=value,
            default=argparse.SUPPRESS,
            help=f"the same as {flag} {value}",
        )


def _translate(
    values: dict[str, str], then: Callable[[str], object] | None
) -> Callable[[str], object]:
    def convert(text: str) -> object:
        text = values.get(text, text)
        return then(text) if then is not None else text

    return convert
