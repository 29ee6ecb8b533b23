"""Flags declared on config fields: `cli_field` gives a field its flag, `add_config_flags` adds
one argparse argument per such field (type and default from the field), `config_kwargs` reads
them back into the config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from minisgl.config.cli import add_config_flags, cli_field, config_kwargs


@dataclass(frozen=True)
class Toy:
    steps: int = cli_field(3, "steps to take", "a")
    rate: float = cli_field(0.5, "a share", "a")
    name: str | None = cli_field(None, "a name", "b", metavar="NAME")
    mode: str = cli_field("x", "x or y", "b", choices=("x", "y"))
    fast: bool = cli_field(True, "go fast", "b")
    quiet: bool = cli_field(False, "say nothing", "a")
    hidden: int = 7  # no flag


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags({"a": p.add_argument_group("a"), "b": p.add_argument_group("b")}, Toy)
    return p


def test_defaults_come_from_the_fields() -> None:
    assert Toy(**config_kwargs(Toy, parser().parse_args([]))) == Toy()


def test_types_switches_and_extras() -> None:
    args = parser().parse_args(
        ["--steps", "5", "--rate", "2", "--name", "n", "--mode", "y", "--no-fast", "--quiet"]
    )
    toy = Toy(**config_kwargs(Toy, args))
    assert toy == Toy(steps=5, rate=2.0, name="n", mode="y", fast=False, quiet=True)
    assert isinstance(toy.rate, float) and isinstance(toy.steps, int)
    with pytest.raises(argparse.ArgumentError):
        parser().parse_args(["--steps", "1.5"])
    with pytest.raises(argparse.ArgumentError):
        parser().parse_args(["--mode", "z"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--no-quiet"])  # a False switch has no --no- form
    with pytest.raises(SystemExit):
        parser().parse_args(["--hidden", "1"])


def test_help_and_groups() -> None:
    p = parser()
    text = p.format_help()
    for flag, words in [
        ("--steps", "steps to take"),
        ("--name NAME", "a name"),
        ("--fast", "go fast"),
    ]:
        assert flag in text and words in text
    groups = {g.title: [a.dest for a in g._group_actions] for g in p._action_groups}
    assert groups["a"] == ["steps", "rate", "quiet"]
    assert groups["b"] == ["name", "mode", "fast"]
