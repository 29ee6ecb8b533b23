"""Every code block of the README runs, against one real server on the default model: a block
runs as written (its `http://127.0.0.1:1919` pointed at the test's server) and what it prints
must match the `<!-- output: REGEX -->` comment right above it. A block that cannot run here (a
GPU, a big model, an install, a server of its own) carries `<!-- readme-test: skip (why) -->`
instead; those are counted, and any other block must run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from serving_helpers import Server, running_server

pytestmark = pytest.mark.slow  # a server of its own

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_URL = "http://127.0.0.1:1919"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
MARKER = re.compile(r"<!-- (readme-test: skip \((?P<why>.+)\)|output: (?P<out>.+)) -->")


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    output: str | None  # the regex its output must match
    skip: str | None  # why it does not run here


def readme_blocks() -> list[Block]:
    text = README.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.fullmatch(before)
        line = text.count("\n", 0, m.start()) + 1
        blocks.append(Block(line, m[1], m[2], marker and marker["out"], marker and marker["why"]))
    return blocks


BLOCKS = readme_blocks()
RUN = [b for b in BLOCKS if b.skip is None]


def test_every_block_runs_or_says_why_not() -> None:
    fences = sum(1 for line in README.read_text().splitlines() if re.match(r"```\w+$", line))
    assert len(BLOCKS) == fences  # every block was found
    skipped = [b for b in BLOCKS if b.skip is not None]
    assert len(skipped) + len(RUN) == len(BLOCKS) and len(RUN) >= 6, [b.line for b in RUN]
    for b in BLOCKS:
        assert b.lang in ("bash", "python"), b
        assert (b.output is None) != (b.skip is None), f"line {b.line}: an output or a skip"
    # The skipped ones (counted here, each with its reason): installs, servers, big models.
    print(f"{len(RUN)} README blocks run, {len(skipped)} skipped:")
    for b in skipped:
        print(f"  line {b.line}: {b.skip}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.mark.parametrize("block", RUN, ids=[f"line{b.line}-{b.lang}" for b in RUN])
def test_readme_block(block: Block, server: Server) -> None:
    code = block.code.replace(DEFAULT_URL, server.url)
    argv = ["bash", "-euo", "pipefail", "-c", code] if block.lang == "bash" else [
        sys.executable, "-c", code]  # fmt: skip
    env = {**os.environ, "TQDM_DISABLE": "1"}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, f"line {block.line}:\n{out.stdout}\n{out.stderr[-3000:]}"
    assert block.output is not None
    assert re.search(block.output, out.stdout.strip()), f"line {block.line}:\n{out.stdout}"
