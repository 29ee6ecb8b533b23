"""The command line: every flag documented, mapped onto EngineConfig, bad values refused."""

from __future__ import annotations

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
        ]
    )
    e = cfg.engine
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
    assert e.model is None and not cfg.shell


@pytest.mark.parametrize(
    "argv",
    [
        ["--cache", "lru"],
        ["--port", "70000"],
        ["--model", "/no/such/model"],
        ["--tp-size", "0"],
        ["--max-running-requests", "0"],
        ["--api-key", ""],
    ],
)
def test_bad_values_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
