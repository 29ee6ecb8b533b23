"""The command line: every flag documented, mapped onto EngineConfig, bad values refused."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.config import ChatConfig, EngineConfig
from minisgl.config.cli import cli_fields, flag_name
from minisgl.config.secrets import ENV_API_KEY
from minisgl.config.server import ServerConfig
from minisgl.server.args import CONFIGS, build_parser, parse_args
from minisgl.server.connection import Deadlines
from minisgl.server.limits import Limits

FLAGS = [
    "--model",
    "--host",
    "--port",
    "--tp-size",
    "--cache",
    "--page-size",
    "--max-prefill-tokens",
    "--max-running-requests",
    "--dtype",
    "--load-format",
    "--api-key",
    "--shell",
    "--device",
    "--num-pages",
    "--seed",
    "--max-context-len",
    "--log-level",
    "--nnodes",
    "--node-rank",
    "--dist-init-addr",
    "--skip-warmup",
    "--mem-fraction",
    "--cuda-graph-max-bs",
    "--piecewise-graph-max-tokens",
    "--piecewise-whole-step",
    "--disable-overlap",
    "--kv-cache-dtype",
    "--kv-cache-calibrate",
    "--quantization",
    "--api-key-file",
    "--max-request-bytes",
    "--max-seqs-per-request",
    "--max-queued-seqs",
    "--header-timeout",
    "--body-timeout",
    "--send-timeout",
    "--keep-alive-timeout",
    "--itl-target-ms",
    "--schedule-policy",
    "--priority-aging-s",
    "--shutdown-timeout",
]


def test_help_documents_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    for flag in FLAGS:
        assert flag in out, flag


def test_flags_map_onto_the_engine_config() -> None:
    cfg = parse_args(
        [
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--cache",
            "naive",
            "--page-size",
            "4",
            "--max-prefill-tokens",
            "512",
            "--max-running-requests",
            "8",
            "--dtype",
            "float32",
            "--load-format",
            "dummy",
            "--api-key",
            "k",
            "--device",
            "cpu",
            "--num-pages",
            "99",
            "--seed",
            "3",
            "--max-context-len",
            "1024",
            "--log-level",
            "debug",
            "--skip-warmup",
            "--mem-fraction",
            "0.5",
            "--cuda-graph-max-bs",
            "0",
            "--piecewise-graph-max-tokens",
            "512",
            "--no-piecewise-whole-step",
            "--disable-overlap",
        ]
    )
    e = cfg.engine
    assert (e.mem_fraction, e.cuda_graph_max_bs, e.overlap) == (0.5, 0, False)
    assert e.piecewise_graph_max_tokens == 512 and not e.piecewise_whole_step
    default = parse_args([]).engine
    assert default.piecewise_whole_step
    assert (default.mem_fraction, default.cuda_graph_max_bs, default.overlap) == (0.9, 256, True)
    assert default.piecewise_graph_max_tokens == 2048
    assert (cfg.host, cfg.port, cfg.api_key, cfg.log_level) == ("0.0.0.0", 8000, "k", "debug")
    assert (e.cache, e.page_size, e.max_prefill_tokens, e.max_running_requests) == (
        "naive",
        4,
        512,
        8,
    )
    assert (e.dtype, e.load_format, e.device, e.num_pages, e.seed, e.max_context_len) == (
        "float32",
        "dummy",
        "cpu",
        99,
        3,
        1024,
    )
    assert e.model is None and not cfg.shell and e.skip_warmup
    assert not parse_args([]).engine.skip_warmup
    assert (e.tp_size, e.nnodes, e.node_rank, e.dist_init_addr) == (1, 1, 0, None)
    assert cfg.serves_http


def test_fp8_flags() -> None:
    e = parse_args(
        ["--kv-cache-dtype", "fp8_e4m3", "--kv-cache-calibrate", "512", "--quantization", "fp8"]
    ).engine
    assert (e.kv_cache_dtype, e.kv_cache_calibrate, e.quantization) == ("fp8_e4m3", 512, "fp8")
    default = parse_args([]).engine
    assert (default.kv_cache_dtype, default.kv_cache_calibrate, default.quantization) == (
        "auto",
        0,
        None,
    )


def test_scheduling_flags() -> None:
    e = parse_args(
        ["--itl-target-ms", "7.5", "--schedule-policy", "priority", "--priority-aging-s", "2"]
    ).engine
    assert (e.itl_target_ms, e.schedule_policy, e.priority_aging_s) == (7.5, "priority", 2.0)
    assert parse_args(["--itl-target-ms", "0"]).engine.itl_target_ms == 0.0  # off
    default = parse_args([]).engine
    # The machine's default (auto on a GPU, off on the CPU), resolved by the engine.
    assert (default.itl_target_ms, default.schedule_policy) == (None, "fcfs")
    assert parse_args(["--itl-target-ms", "auto"]).engine.itl_target_ms == "auto"


def test_multi_node_flags() -> None:
    node = ["--tp-size", "4", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:5000"]
    head, other = parse_args(node), parse_args([*node, "--node-rank", "1"])
    assert (head.engine.nnodes, head.engine.node_rank, head.engine.ranks_per_node) == (2, 0, 2)
    assert head.engine.dist_init_addr == "10.0.0.1:5000"
    assert head.serves_http and not other.serves_http  # node 1 runs only its ranks
    assert other.engine.node_rank == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "nnodes: 2 nodes cannot"),
        (["--tp-size", "2", "--nnodes", "2"], "dist_init_addr: several nodes need"),
        (
            ["--tp-size", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
            r"node_rank: must be in \[0, 2\)",
        ),
        (["--node-rank", "-1"], "node_rank: must be in"),
        (["--nnodes", "0"], "nnodes: 0 nodes"),
        (["--dist-init-addr", "localhost"], "expected host:port"),
        (
            ["--shell", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1"]
            + ["--dist-init-addr", "h:1"],
            "shell: runs on node 0 only",
        ),
    ],
)
def test_bad_multi_node_flags(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv",
    [
        ["--cache", "lru"],
        ["--port", "70000"],
        ["--model", "/no/such/model"],
        ["--tp-size", "0"],
        ["--max-running-requests", "0"],
        ["--api-key", ""],
        ["--mem-fraction", "0"],
        ["--mem-fraction", "1.5"],
        ["--cuda-graph-max-bs", "-1"],
        ["--piecewise-graph-max-tokens", "-1"],
        ["--max-request-bytes", "0"],
        ["--max-seqs-per-request", "0"],
        ["--max-seqs-per-request", "10", "--max-queued-seqs", "5"],
        ["--header-timeout", "0"],
        ["--send-timeout", "-1"],
        ["--keep-alive-timeout", "0"],
        ["--itl-target-ms", "-1"],
        ["--itl-target-ms", "soon"],
        ["--schedule-policy", "lifo"],
        ["--priority-aging-s", "-1"],
        ["--shutdown-timeout", "-1"],
        ["--shutdown-timeout", "nan"],
        ["--api-server-count", "-1"],
        ["--api-server-count", "257"],
    ],
)
def test_bad_values_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_api_server_count() -> None:
    assert parse_args(["--api-server-count", "3"]).api_server_count == 3
    assert parse_args(["--device", "cpu"]).api_server_count == 1  # its cores are the engine's
    assert parse_args(["--shell", "--api-server-count", "3"]).api_server_count == 1  # no HTTP


def test_limit_and_timeout_flags() -> None:
    cfg = parse_args(
        ["--max-request-bytes", "1000", "--max-seqs-per-request", "4", "--max-queued-seqs", "9"]
        + ["--header-timeout", "1.5", "--body-timeout", "2", "--send-timeout", "3"]
        + ["--keep-alive-timeout", "4", "--shutdown-timeout", "0"]
    )
    assert cfg.limits == Limits(max_request_bytes=1000, max_seqs_per_request=4, max_queued_seqs=9)
    assert cfg.deadlines == Deadlines(
        header_timeout=1.5, body_timeout=2, send_timeout=3, keep_alive_timeout=4
    )
    default = parse_args([])
    assert default.limits == Limits() and default.deadlines == Deadlines()
    assert default.limits.max_request_bytes >= 2**20  # "a few MB"
    assert default.deadlines.header_timeout == default.deadlines.body_timeout == 60  # nginx's
    assert cfg.shutdown_timeout == 0  # answer what is in flight at once
    assert 1 <= default.shutdown_timeout <= 10  # "a few seconds"


# ---- the API key ------------------------------------------------------------------------------


def test_api_key_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_API_KEY, raising=False)
    assert parse_args([]).api_key is None
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")  # the newline an editor leaves is not part of the key
    assert parse_args(["--api-key-file", str(key_file)]).api_key == "from-file"
    monkeypatch.setenv(ENV_API_KEY, "from-env")
    assert parse_args([]).api_key == "from-env"
    # A flag is more explicit than the environment.
    assert parse_args(["--api-key", "flag"]).api_key == "flag"
    assert parse_args(["--api-key-file", str(key_file)]).api_key == "from-file"


def test_the_key_stays_out_of_reprs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_API_KEY, "very-secret-key")
    assert "very-secret-key" not in repr(parse_args([]))


@pytest.mark.parametrize(
    ("content", "env", "message"),
    [
        (None, None, "api_key_file: cannot read"),
        ("  \n", None, "api_key: --api-key-file .* gives an empty key"),
        ("two words", None, "whitespace or control characters"),
        ("", "", f"api_key: {ENV_API_KEY} gives an empty key"),
    ],
)
def test_bad_keys_are_refused_without_showing_them(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    env: str | None,
    message: str,
) -> None:
    key_file = tmp_path / "key"
    argv = []
    if content is not None:
        key_file.write_text(content)
    if env is None:
        monkeypatch.delenv(ENV_API_KEY, raising=False)
        argv = ["--api-key-file", str(key_file)]
    else:
        monkeypatch.setenv(ENV_API_KEY, env)
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(message, err), err
    if content and content.strip():
        assert content.strip() not in err


def test_both_key_flags_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--api-key", "a", "--api-key-file", str(tmp_path / "k")])
    assert "not both" in capsys.readouterr().err


def test_chat_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    c = parse_args(["--chat-template", str(path), "--tool-call-parser", "llama3"]).chat
    assert (c.template, c.tool_call_parser, c.reasoning_parser) == (template, "llama3", None)
    c = parse_args(["--chat-template", template, "--reasoning-parser", "deepseek-r1"]).chat
    assert c.template == template and c.reasoning_parser == "deepseek-r1"
    assert parse_args([]).chat.template is None
    for argv, why in (
        (["--chat-template", str(tmp_path / "missing.jinja")], "chat_template: .* neither a file"),
        (["--chat-template", "plain {text}"], "chat_template: not a Jinja template"),
        (["--tool-call-parser", "nope"], "invalid choice: 'nope'"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert re.search(why, capsys.readouterr().err), argv


@pytest.mark.parametrize(
    ("alias", "native"),
    [
        (["--max-model-len", "512"], ["--max-context-len", "512"]),
        (["--max-model-len=512"], ["--max-context-len=512"]),
        (["--gpu-memory-utilization", "0.5"], ["--mem-fraction", "0.5"]),
        (["--max-num-seqs", "7"], ["--max-running-requests", "7"]),
        (["--max-num-batched-tokens", "64"], ["--max-prefill-tokens", "64"]),
        (["--tensor-parallel-size", "2"], ["--tp-size", "2"]),
        (["-tp", "2"], ["--tp-size", "2"]),
        (["--dtype", "half"], ["--dtype", "float16"]),
        (["--dtype", "bf16"], ["--dtype", "bfloat16"]),
        (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"]),
        (["--enable-prefix-caching"], ["--cache", "radix"]),
        (["--no-enable-prefix-caching"], ["--cache", "naive"]),
    ],
    ids=lambda argv: " ".join(argv),
)
def test_vllm_spellings_parse_to_the_same_config(alias: list[str], native: list[str]) -> None:
    assert parse_args(alias) == parse_args(native)
    # Each alias changes something (radix is the default cache: it undoes the other switch).
    base = ["--no-enable-prefix-caching"] if alias == ["--enable-prefix-caching"] else []
    assert parse_args(alias) != parse_args(base)


def test_the_last_cache_spelling_wins() -> None:
    cfg = parse_args(["--cache", "radix", "--no-enable-prefix-caching"])
    assert cfg.engine.cache == "naive"
    assert parse_args(["--no-enable-prefix-caching", "--cache", "radix"]).engine.cache == "radix"


def test_an_alias_value_outside_the_table_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "double"])
    assert "invalid choice: 'double'" in capsys.readouterr().err


def test_each_config_field_with_cli_metadata_is_one_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    own = [a for a in parser._actions if a.default is not argparse.SUPPRESS]  # no switch aliases
    with pytest.raises(SystemExit):
        parse_args(["--help"])  # what `minisgl --help` prints
    out = capsys.readouterr().out
    assert {EngineConfig, ServerConfig, ChatConfig, Limits, Deadlines} == set(CONFIGS)
    engine_fields = {f.name for f in cli_fields(EngineConfig)}
    assert {"max_prefill_tokens", "itl_target_ms", "speculative_max_batch"} <= engine_fields
    for cls in CONFIGS:
        for f in cli_fields(cls):
            (action,) = [a for a in own if a.dest == f.name]
            assert action.option_strings[0] == flag_name(f)
            assert action.default == f.default and action.help.startswith(f.metadata["help"])
            assert re.search(rf"^\s+{flag_name(f)}\b", out, re.M), f.name
    # No hand-written flag sets an EngineConfig field of the same name but --model (fetched).
    other = {f.name for f in dataclasses.fields(EngineConfig)} - engine_fields
    assert other & {a.dest for a in own} == {"model"}
