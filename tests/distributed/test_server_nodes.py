"""`python -m minisgl` over two "nodes" on 127.0.0.1 (one rank each, gloo): node 0 serves HTTP,
node 1 runs only its rank; the OpenAI client gets tp=1's greedy answers. Also: a node whose
flags do not fit node 0's engine is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import random_prompts, randomize, tiny_hf_config
from server.serving_helpers import descendants, free_port, start_server

from minisgl import LLM, SamplingParams
from minisgl.__main__ import main
from minisgl.config import EngineConfig
from minisgl.distributed.group import host_store, store_address
from minisgl.runtime import ranks
from minisgl.runtime.ranks import publish_config

VOCAB = 385
MAX_TOKENS = 8
ENGINE_FLAGS = ["--device", "cpu", "--num-pages", "2048", "--max-running-requests", "16"]


def save_model_with_tokenizer(path: Path) -> Path:
    """A tiny random Llama and a word-level tokenizer ("t17" is token 17) for the server."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_config(tiny_hf_config("llama3", vocab=VOCAB))
    randomize(model, seed=1)
    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def test_two_nodes_serve_tp1_answers(tmp_path: Path) -> None:
    model = save_model_with_tokenizer(tmp_path / "model")
    prompts = random_prompts(3, VOCAB, seed=5, lo=3, hi=20)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model), device="cpu", num_pages=2048, max_running_requests=16) as llm:
        ref = llm.generate(prompts, greedy, use_tqdm=False)
    assert all(len(r["text"].split()) == MAX_TOKENS for r in ref)  # "t17 t3 ...": one per token

    addr = f"127.0.0.1:{free_port()}"
    flags = ["--model", str(model), *ENGINE_FLAGS, "--tp-size", "2", "--nnodes", "2"]
    flags += ["--dist-init-addr", addr]
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "minisgl", *flags, "--node-rank", "1"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = start_server(tmp_path, *flags)  # node 0: --node-rank defaults to 0
    try:
        server.wait_ready()
        assert descendants(node1.pid)  # node 1's rank runs there, not under node 0
        client: Any = server.openai()
        name = client.models.list().data[0].id
        for prompt, r in zip(prompts, ref):
            out = client.completions.create(
                model=name,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].text == r["text"]
            assert out.usage.completion_tokens == MAX_TOKENS
        assert server.terminate() == []
        # Stopping node 0 stops node 1's rank, and node 1 with it.
        assert node1.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        for proc in (server.proc, node1):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_node_flags_must_match_node0(capsys: pytest.CaptureFixture[str]) -> None:
    """Node 1 reads node 0's engine from the rendezvous and refuses a different tp size."""
    store = host_store(None)
    addr = store_address(store)
    publish_config(store, EngineConfig(tp_size=2, nnodes=2, dist_init_addr=addr))
    argv = ["--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr]
    assert main(argv) == 2
    assert "tp_size: 4 given here but rank 0 runs with 2" in capsys.readouterr().err


def test_rank_launcher_refuses_a_bad_node_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m minisgl.runtime.ranks` checks this node's memory flags before starting ranks."""
    store = host_store(None)
    addr = store_address(store)
    publish_config(store, EngineConfig(tp_size=2, nnodes=2, dist_init_addr=addr))
    argv = ["--dist-init-addr", addr, "--node-rank", "1", "--mem-fraction", "1.5"]
    with pytest.raises(SystemExit) as exit_info:
        ranks.main(argv)
    assert exit_info.value.code == 2
    assert "mem_fraction: must be in (0, 1], got 1.5" in capsys.readouterr().err
