"""Models by hub id, from a local mirror laid out as the Hugging Face hub cache (HF_HUB_CACHE)
with the hub offline (HF_HUB_OFFLINE=1): no network. `huggingface_hub` reads those variables
when it is imported, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from minisgl.weights import default_model_path

MAIN, V2 = "a" * 40, "b" * 40  # the commits `main` and the `v2` tag point at


def mirror(
    cache: Path, repo: str, files_by_commit: dict[str, Path | list[Path]], refs: dict[str, str]
) -> None:
    """`cache/models--org--name/{refs/REF, snapshots/COMMIT/FILE}`: the hub cache's layout."""
    root = cache / ("models--" + repo.replace("/", "--"))
    for commit, src in files_by_commit.items():
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in src.iterdir() if isinstance(src, Path) else src:
            (snap / f.name).symlink_to(f.resolve())
    (root / "refs").mkdir()
    for ref, commit in refs.items():
        (root / "refs" / ref).write_text(commit)


def run(cache: Path, code: str) -> Any:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_hub_ids_load_from_the_cache_offline(tiny_model_dir, tmp_path: Path) -> None:
    tiny = tiny_model_dir("llama3")
    other = tmp_path / "v2"  # the v2 tag: the same weights, a shorter context
    shutil.copytree(tiny, other)
    config = json.loads((other / "config.json").read_text())
    config["max_position_embeddings"] = 96
    (other / "config.json").write_text(json.dumps(config))
    gguf = default_model_path()
    cache = tmp_path / "hub"
    mirror(cache, "org/tiny", {MAIN: tiny, V2: other}, {"main": MAIN, "v2": V2})
    mirror(cache, "org/smol-gguf", {MAIN: [gguf]}, {"main": MAIN})
    got = run(
        cache,
        """
import json
from minisgl import LLM
from minisgl.server.args import parse_args
from minisgl.weights import load_model_config, resolve_source
opts = dict(device="cpu", dtype="float32", num_pages=64, skip_warmup=True, show_progress=False)
hub = LLM("org/tiny", **opts)
local = LLM(hub.engine.config.model, **opts)
p = {"max_tokens": 4, "temperature": 0}
v2 = parse_args(["--model", "org/tiny", "--revision", "v2"])
named = parse_args(["--model", "org/tiny", "--served-model-name", "t"])
gguf = parse_args(["--model", "org/smol-gguf/GGUF_NAME"])
print(json.dumps({
    "path": hub.engine.config.model, "name": hub.startup.model,
    "same": hub.generate([1, 2, 3], p)[0]["token_ids"] == local.generate([1, 2, 3], p)[0]["token_ids"],
    "v2": v2.engine.model, "v2_context": load_model_config(resolve_source(v2.engine.model)).max_position,
    "served": v2.served_model_names, "named": named.served_model_names,
    "gguf": gguf.engine.model,
}))
""".replace("GGUF_NAME", gguf.name),
    )
    snapshots = cache / "models--org--tiny" / "snapshots"
    assert got["path"] == str(snapshots / MAIN) and got["name"] == "org/tiny" and got["same"]
    assert got["v2"] == str(snapshots / V2) and got["v2_context"] == 96
    assert got["served"] == ["org/tiny"] and got["named"] == ["t"]  # the id is the served name
    assert got["gguf"] == str(cache / "models--org--smol-gguf" / "snapshots" / MAIN / gguf.name)


def test_a_hub_id_missing_offline_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", "org/absent"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2
    assert "'org/absent'" in out.stderr and "HF_HUB_OFFLINE=1" in out.stderr, out.stderr
