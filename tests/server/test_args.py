"""The command line: every flag documented, mapped onto EngineConfig, bad values refused."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from minisgl.server.args import parse_args

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
    "--disable-overlap",
    "--kv-cache-dtype",
    "--kv-cache-calibrate",
    "--quantization",
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
            "--disable-overlap",
        ]
    )
    e = cfg.engine
    assert (e.mem_fraction, e.cuda_graph_max_bs, e.overlap) == (0.5, 0, False)
    default = parse_args([]).engine
    assert (default.mem_fraction, default.cuda_graph_max_bs, default.overlap) == (0.9, 256, True)
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
    ],
)
def test_bad_values_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
