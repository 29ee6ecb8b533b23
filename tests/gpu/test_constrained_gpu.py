"""Constrained decoding on the fast path (CUDA graphs, overlap, Triton kernels): dummy weights of
the Qwen3-0.6B shape with a real 151k vocabulary (llama.cpp's tokenizer-only
`ggml-vocab-qwen2.gguf`; its path in MINISGL_TEST_VOCAB_GGUF, else `.gguf/` in the repository).

A mixed batch: constrained rows follow their grammar token by token, and every unconstrained row
gives exactly the tokens it gives when no row is constrained (the same steps run: every request
goes to max_tokens, and the grammars cannot end sooner).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from helpers import assert_kv_clean, random_prompts  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.constrain import GrammarCompiler, RequestGrammar  # noqa: E402
from minisgl.core import Constraint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "minisgl" / "benchmark" / "models" / "qwen3-0.6b"
VOCAB_GGUF = Path(os.environ.get("MINISGL_TEST_VOCAB_GGUF", ROOT / ".gguf/ggml-vocab-qwen2.gguf"))
N = 32
LETTERS = r"[a-z ]{200,}"  # never complete within N tokens: the stop token never allowed
ARRAY = json.dumps(
    {"type": "array", "items": {"type": "integer"}, "minItems": 1000}  # likewise
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if not VOCAB_GGUF.exists():
        pytest.skip(f"{VOCAB_GGUF} is missing (llama.cpp's ggml-vocab-qwen2.gguf)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(VOCAB_GGUF.parent), gguf_file=VOCAB_GGUF.name)


def test_mixed_batch_on_the_fast_path(tokenizer: Any) -> None:
    llm = LLM(str(MODEL), load_format="dummy", cache="naive", max_running_requests=16)
    assert llm.engine.graphs is not None and llm.scheduler.overlap
    llm.scheduler.grammars.load_tokenizer = lambda: tokenizer
    prompts = random_prompts(8, 20000, seed=5, lo=20, hi=200)
    plain = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    params = [plain] * 8
    params[1] = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, regex=LETTERS)
    params[4] = SamplingParams(max_tokens=N, temperature=0.7, seed=3, ignore_eos=True,
                               json_schema=ARRAY)  # fmt: skip
    params[6] = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, regex=LETTERS)
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed = llm.generate(prompts, params, use_tqdm=False)
    for i, (m, a) in enumerate(zip(mixed, alone)):
        assert len(m["token_ids"]) == N
        if params[i].constraint is None:
            assert m["token_ids"] == a["token_ids"], f"unconstrained row {i} changed"
    for i in (1, 6):
        text = tokenizer.decode(mixed[i]["token_ids"])
        assert re.fullmatch(r"[a-z ]+", text), text
    # The JSON row, sampled: every token it took is one its grammar allows, in order.
    compiler = GrammarCompiler(lambda: tokenizer, llm.engine.model_config.vocab_size)
    grammar = RequestGrammar(compiler.compile(Constraint("json_schema", ARRAY)), [])
    assert all(grammar.accept(t) for t in mixed[4]["token_ids"])
    assert tokenizer.decode(mixed[4]["token_ids"]).lstrip().startswith("[")
    assert_kv_clean(llm)
