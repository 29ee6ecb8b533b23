"""The config fields that are `python -m minisgl` flags, and other servers' spellings of them.

`cli_field` declares a field's flag where the field is: `--NAME` (the field's name with dashes),
its type taken from the default, its help, group and argparse extras; `add_config_flags` adds
them to a parser and `config_kwargs` reads them back. A field's rules (its `choices`, bounds
`ge` / `gt` / `le`: `cli_field`, or `minisgl.core.errors.checked` for a field that is no flag)
are checked in one place, `check_fields`, which every config's `__post_init__` calls. vLLM's spellings
(`--max-model-len`, `--dtype half`, ...) are one table; `add_aliases` lists each beside its
flag in `--help`."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from minisgl.core.errors import BOUNDS

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


def cli_field(default: Any, help: str, group: str, **extras: Any) -> Any:
    """A dataclass field with that default that is also the flag `--NAME` in `group`; `extras`
    go to argparse (choices, metavar, type when the default's type is not it), but for the
    bounds `check_fields` enforces (`ge`, `gt`, `le`)."""
    return dataclasses.field(default=default, metadata={"help": help, "group": group, **extras})


def flag_name(f: dataclasses.Field[Any]) -> str:
    return "--" + f.name.replace("_", "-")


def cli_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_config_flags(groups: Mapping[str, Any], *configs: type) -> None:
    """Add a flag per `cli_field` of `configs` to its group (argparse argument groups by name);
    a bool field is a switch (`--no-NAME` too when it defaults to True)."""
    for cls in configs:
        for f in cli_fields(cls):
            extras = {k: v for k, v in f.metadata.items() if k not in BOUNDS}
            group = groups[extras.pop("group")]
            if isinstance(f.default, bool):
                extras["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            else:
                extras.setdefault("type", str if f.default is None else type(f.default))
            group.add_argument(flag_name(f), default=f.default, **extras)


def config_kwargs(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The `cli_field`s of `cls` as parsed into `args`."""
    return {f.name: getattr(args, f.name) for f in cli_fields(cls)}


def auto_or_float(text: str) -> float | str:
    """A flag's value: "auto" or a number."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number, got {text!r}") from None


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
