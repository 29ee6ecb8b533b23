"""The registry of `MINISGL_*` switches: typed values, a clear error for a bad one, read when
asked, every switch of the package registered and named in the README."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.config import EngineConfig, apply_env_switches, env

ROOT = Path(__file__).resolve().parents[2]


def test_values_by_type_and_defaults_while_unset() -> None:
    assert env.DISABLE_PDL.get({}) is False
    assert env.MOE_W8A8.get({}) is True
    assert env.MOE_W8A8_BLOCK_M.get({}) == 16
    assert env.API_KEY.get({}) is None
    for text, value in (("1", True), ("true", True), ("ON", True), ("0", False), ("no", False)):
        assert env.DISABLE_FUSED.get({"MINISGL_DISABLE_FUSED": text}) is value
    assert env.MOE_W8A8.get({"MINISGL_MOE_W8A8": ""}) is False  # set but empty: off
    assert env.MOE_W8A8_BLOCK_M.get({"MINISGL_MOE_W8A8_BLOCK_M": "32"}) == 32
    assert env.API_KEY.get({"MINISGL_API_KEY": "s3cret"}) == "s3cret"


@pytest.mark.parametrize(
    ("switch", "text"),
    [(env.DISABLE_OVERLAP, "2"), (env.DEBUG_KV, "maybe"), (env.MOE_W8A8_BLOCK_M, "0"),
     (env.MOE_W8A8_BLOCK_M, "sixteen")],
)  # fmt: skip
def test_a_bad_value_names_the_switch(switch: env.Switch, text: str) -> None:
    with pytest.raises(ValueError, match=rf"^{switch.name}={text!r}: expected "):
        switch.get({switch.name: text})


def test_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's switches are heard whenever they are set before the config is resolved,
    and a bad value stops it with the switch's name."""
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP", "1")
    monkeypatch.setenv("MINISGL_DEBUG_KV", "true")
    cfg = apply_env_switches(EngineConfig(overlap=True, debug_kv=False))
    assert cfg.overlap is False and cfg.debug_kv is True
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP", "0")
    monkeypatch.setenv("MINISGL_DEBUG_KV", "0")
    cfg = apply_env_switches(EngineConfig(overlap=True, debug_kv=False))
    assert cfg.overlap is True and cfg.debug_kv is False
    monkeypatch.setenv("MINISGL_DISABLE_CUDA_GRAPH", "yes please")
    with pytest.raises(ValueError, match="MINISGL_DISABLE_CUDA_GRAPH"):
        apply_env_switches(EngineConfig())
    monkeypatch.delenv("MINISGL_DISABLE_CUDA_GRAPH")
    monkeypatch.setenv("MINISGL_DISABLE_PDL", "2")  # a kernel switch fails at start-up too
    with pytest.raises(ValueError, match="MINISGL_DISABLE_PDL='2'"):
        apply_env_switches(EngineConfig())


def test_every_switch_of_the_package_is_registered() -> None:
    """No `MINISGL_*` name in the package's code that the registry does not hold."""
    names = {s.name for s in env.SWITCHES}
    assert len(names) == len(env.SWITCHES)
    found = set()
    for path in (ROOT / "minisgl").rglob("*.py"):
        if "benchmark" not in path.parts:  # (benchmarks keep their own flags)
            found |= set(re.findall(r"MINISGL_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert found <= names, sorted(found - names)


def test_the_readme_lists_every_switch() -> None:
    """The README holds the registry's table as `python -m minisgl.config` prints it."""
    readme = (ROOT / "README.md").read_text()
    assert env.markdown() in readme
    printed = subprocess.run(
        [sys.executable, "-m", "minisgl.config"], capture_output=True, text=True, check=True
    )
    assert printed.stdout == env.markdown() and not printed.stderr
    for s in env.SWITCHES:
        assert f"`{s.name}`" in readme
