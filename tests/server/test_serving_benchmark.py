"""The serving benchmark's own machinery (W4, `minisgl.benchmark.serving`): the synthetic
tokenizer that lets a config-only dummy model serve text, and requests sent from several client
processes against a real server, every one of them counted whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serving_helpers import start_server
from transformers import AutoTokenizer

from minisgl.benchmark.serving import (
    Workload,
    needs_synthetic_tokenizer,
    run_clients,
    summarize,
    synthetic_tokenizer_model,
)

QWEN3_06B = Path(__file__).resolve().parents[2] / "minisgl" / "benchmark" / "models" / "qwen3-0.6b"


def test_synthetic_tokenizer_covers_the_vocabulary(tmp_path: Path) -> None:
    assert needs_synthetic_tokenizer(str(QWEN3_06B), "dummy")
    assert not needs_synthetic_tokenizer(str(QWEN3_06B), "auto")  # real weights bring their own
    model = synthetic_tokenizer_model(str(QWEN3_06B), tmp_path)
    assert not needs_synthetic_tokenizer(model, "dummy")
    tok = AutoTokenizer.from_pretrained(model)
    assert len(tok) == 151936 and tok.eos_token_id == 151645  # the config's vocab and EOS
    assert tok.decode([5, 151935]) == "t5 t151935"
    assert tok.encode("t7 t8", add_special_tokens=False) == [7, 8]
    config = json.loads((Path(model) / "config.json").read_text())
    assert config == json.loads((QWEN3_06B / "config.json").read_text())


def test_clients_in_several_processes_count_every_token(tmp_path: Path) -> None:
    config = json.loads((QWEN3_06B / "config.json").read_text())
    config |= dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=10000, eos_token_id=2)  # fmt: skip
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    model = synthetic_tokenizer_model(str(tmp_path / "cfg"), tmp_path)
    server = start_server(tmp_path, "--model", model, "--load-format", "dummy", "--skip-warmup")
    try:
        server.wait_ready()
        work = Workload.draw(10, 3, (8, 40), (3, 12))
        traces = run_clients(server.url, work, float("inf"), 0, procs=3)
        result = summarize(traces, work)
        assert result["incomplete"] == 0 and result["requests"] == 10
        assert result["output_tokens"] == work.output_tokens
        assert [t.completion_tokens for t in traces] == work.output_lens  # in request order
        short = Workload(work.prompts, [m + 1 for m in work.output_lens])  # asked for one more
        assert summarize(traces, short)["incomplete"] == 10
        bad = Workload([[10**6]], [4])  # an id past the vocabulary: the server answers 400
        with pytest.raises(RuntimeError, match="BadRequestError"):
            run_clients(server.url, Workload(work.prompts[:2] + bad.prompts, [3, 3, 4]),
                        float("inf"), 0, procs=3)  # fmt: skip
    finally:
        server.terminate()
