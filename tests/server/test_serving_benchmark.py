"""The serving benchmark's own machinery (W4, `minisgl.benchmark.serving`): the synthetic
tokenizer that lets a config-only dummy model serve text, and requests sent from several client
processes against a real server, every one of them counted whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serving_helpers import QWEN3_06B, start_server, tiny_dummy_model
from transformers import AutoTokenizer

from minisgl.benchmark.serving import (
    Workload,
    main,
    needs_synthetic_tokenizer,
    run_clients,
    summarize,
    synthetic_tokenizer_model,
)


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
    model = tiny_dummy_model(tmp_path)
    server = start_server(tmp_path, "--model", model, "--load-format", "dummy", "--skip-warmup")
    try:
        server.wait_ready()
        work = Workload.draw(10, 3, (8, 40), (3, 12))
        traces = run_clients(server.url, work, float("inf"), 0, procs=3)
        result = summarize(traces, work)
        assert result["incomplete"] == 0 and result["requests"] == 10
        assert result["output_tokens"] == work.output_tokens
        assert [t.completion_tokens for t in traces] == work.output_lens  # in request order
        # Every request's time on the wire is known, between its send and the API taking it.
        assert all(t.wire is not None and t.received is not None for t in traces)
        assert all(t.sent_epoch <= t.wire <= t.received for t in traces)  # type: ignore[operator]
        assert 0 <= result["ingest_ms"]["p50"] <= result["ingest_ms"]["p99"]
        short = Workload(work.prompts, [m + 1 for m in work.output_lens])  # asked for one more
        assert summarize(traces, short)["incomplete"] == 10
        bad = Workload([[10**6]], [4])  # an id past the vocabulary: the server answers 400
        with pytest.raises(RuntimeError, match="BadRequestError"):
            run_clients(server.url, Workload(work.prompts[:2] + bad.prompts, [3, 3, 4]),
                        float("inf"), 0, procs=3)  # fmt: skip
    finally:
        server.terminate()


@pytest.mark.slow
def test_policies_and_priority_classes_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What the GPU runs compare: the latency target against the old policy (a server each),
    # two priority classes, a pool set through --server-args; every token timed by the server.
    model = tiny_dummy_model(tmp_path)
    main(["--model", model, "--load-format", "dummy", "--skip-offline", "--rates", "inf",
          "--num-requests", "8", "--prompt-len", "8-40", "--output-len", "3-8", "--repeats", "1",
          "--itl-targets", "auto,0", "--priority-classes", "0,1", "--client-procs", "2",
          "--server-args", "--num-pages 2048", "--server-log", str(tmp_path / "server.log"),
          "--token-times-out", str(tmp_path / "times.json")])  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    times = json.loads((tmp_path / "times.json").read_text())
    for target in ("auto", "0"):
        requests = times[target]["inf"]
        assert len(requests) == 8 and {r[0] for r in requests} <= {0, 1}
        assert all(r[1:] == sorted(r[1:]) and 3 <= len(r) - 1 <= 8 for r in requests)
    assert "token_times" not in result["online"]["inf"]
    server = result["online"]["inf"]["server"]  # the server's own counters over the run
    assert server["steps_timed"] > 0 and server["step_measured_s"] > 0
    assert server["retractions"] == 0  # 2048 pages hold every request
    assert set(result["by_itl_target"]) == {"auto", "0"}
    for online in result["by_itl_target"].values():
        run = online["inf"]
        assert run["requests"] == 8 and run["incomplete"] == 0 and run["untimed"] == 0
        assert set(run["by_priority"]) == {"0", "1"} and run["itl_server_ms"]["p50"] > 0
        # The server's TTFT (from its API taking a request) is within the client's.
        assert 0 < run["ttft_server_ms"]["p50"] <= run["ttft_ms"]["p50"]
    assert result["online"] == result["by_itl_target"]["auto"]
    logs = [(tmp_path / f"server.log.{t}").read_text() for t in ("auto", "0")]
    assert all("Traceback" not in log for log in logs)


def test_against_a_keyed_server_with_a_sharegpt_file_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_dummy_model(tmp_path)
    words = [" ".join(f"t{(7 * i + j) % 9000 + 10}" for j in range(n)) for i, n in
             enumerate((12, 30, 5, 18, 9, 2, 25))]  # fmt: skip
    records = [{"conversations": [{"from": "human", "value": w}, {"from": "gpt", "value": w}]}
               for w in words]  # fmt: skip
    records.append({"conversations": [{"from": "gpt", "value": "t1 t2"}]})  # no human turn
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(records))
    key = "bench-key-123"
    server = start_server(tmp_path, "--model", model, "--load-format", "dummy", "--skip-warmup",
                          api_key=key)  # fmt: skip
    try:
        server.wait_ready()
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        argv = ["--url", server.url, "--model", model, "--skip-offline", "--rates", "inf",
                "--num-requests", "5", "--output-len", "3-8", "--repeats", "1",
                "--dataset", str(dataset), "--plot", str(tmp_path / "lat.png")]  # fmt: skip
        with pytest.raises(Exception, match="401|missing or wrong API key"):
            main(argv)  # the server refuses a client without the key
        main([*argv, "--api-key", key])
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        saturated = result["online"]["inf"]
        assert saturated["requests"] == 5 and saturated["incomplete"] == 0
        # The prompts are five of the file's six usable conversations (one is under 4 tokens).
        tok = AutoTokenizer.from_pretrained(model)
        lens = [len(tok.encode(w, add_special_tokens=False)) for w in words]
        usable = [n for n in lens if n >= 4]
        assert len(usable) == 6 and result["prompt_tokens"] in {sum(usable) - n for n in usable}
        assert "ttft_each_ms" not in saturated and "token_times" not in saturated
        assert (tmp_path / "lat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        server.terminate()


def test_the_help_names_files_that_exist() -> None:
    import re

    import minisgl.benchmark.serving as serving

    root = Path(__file__).resolve().parents[2]
    named = set(re.findall(r"`((?:scripts|minisgl|docs)/[\w./-]+)`", serving.__doc__ or ""))
    assert named and all((root / p).exists() for p in named), named
