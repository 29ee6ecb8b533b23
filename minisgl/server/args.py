"""Command-line flags of `python -m minisgl` and the frozen config they resolve to
(`minisgl.config.ServerConfig`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from minisgl import __version__
from minisgl.config import ChatConfig, EngineConfig, resolve_chat_template
from minisgl.config.cli import add_aliases, add_config_flags, config_kwargs
from minisgl.config.secrets import ENV_API_KEY, resolve_api_key
from minisgl.config.server import Deadlines, Limits, ServerConfig
from minisgl.weights import fetch_model, resolve_source

# argparse groups in --help order, with their descriptions; `cli_field`s name their group
GROUPS = {
    "model": None,
    "scheduling and memory": None,
    "speculative decoding": "Each verify step scores the drafts of every speculating request "
    "in one forward and keeps the longest prefix the target's own sampling agrees with (greedy "
    "output and the sampling distribution are unchanged); a request whose drafts are mostly "
    "rejected, and a batch larger than --speculative-max-batch, decodes plainly.",
    "multi-node": "Ranks spread evenly over the nodes. Node 0 serves HTTP and holds ranks "
    "0..tp/nnodes-1; on node K > 0 the same command with --node-rank K runs only its ranks.",
    "serving": None,
    "chat": None,
    "request limits": "Checked before any expensive work; each refusal is a 4xx (503 for a full "
    "queue) with an OpenAI-style error body.",
    "connection time-outs": "In seconds, like nginx's; each closes the connection.",
}
CONFIGS = (EngineConfig, ServerConfig, ChatConfig, Limits, Deadlines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minisgl",
        description="Serve a model over an OpenAI-compatible HTTP API, or chat with it (--shell).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"minisgl {__version__}")
    groups = {name: p.add_argument_group(name, text) for name, text in GROUPS.items()}
    _add_special_flags(groups)
    add_config_flags(groups, *CONFIGS)
    add_aliases(p)
    return p


def _add_special_flags(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """The flags that are not one config field each."""
    m, h = groups["model"], groups["serving"]
    m.add_argument(
        "--model",
        default=None,
        help="a Hugging Face hub id (org/name, or org/name/file.gguf: fetched into the hub "
        "cache with a progress bar; HF_TOKEN, HF_HUB_CACHE and HF_HUB_OFFLINE=1 respected), an "
        "HF model directory or a .gguf file; default: the embedded SmolLM2-135M-Instruct",
    )
    m.add_argument(
        "--revision",
        default=None,
        help="with a hub id: the branch, tag or commit to fetch; default: main",
    )
    groups["scheduling and memory"].add_argument(
        "--disable-overlap",
        action="store_true",
        help="schedule each step after the previous step's tokens are back (by default on "
        "CUDA the host prepares step N+1 while the GPU runs step N)",
    )
    h.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every endpoint but /health (visible to "
        f"other local users in `ps`: prefer --api-key-file or {ENV_API_KEY})",
    )
    h.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"read the API key from this file (surrounding whitespace dropped); without either "
        f"flag the key comes from ${ENV_API_KEY} when set",
    )
    h.add_argument(
        "--api-server-count",
        type=int,
        default=0,
        metavar="N",
        help="HTTP server processes, all accepting on the port (each parses requests and "
        "streams answers; a busy host needs several); 0: one per 4 CPU cores up to 4 with a "
        "GPU, 1 on a CPU",
    )
    h.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names requests may give as `model` (the first is the one answers carry; "
        "`default` names it too); other names get 404 model_not_found; default: the model's "
        "directory or GGUF file name",
    )
    groups["chat"].add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_STRING",
        help="a Jinja chat template (a file, or the template itself) used instead of the "
        "model's own; it renders `messages`, `tools`, `documents` and chat_template_kwargs",
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Raises ValueError naming the flag to change."""
    model = fetch_model(args.model, args.revision)  # a hub id: its snapshot in the hub cache
    resolve_source(model)  # fail here, not after the workers started, on a bad path
    # A hub id is the served name unless names are given (the snapshot's folder is a hash).
    served = args.served_model_name or ([args.model] if model != args.model else [])
    engine = EngineConfig(
        model=model,
        overlap=not args.disable_overlap,
        show_progress=False,
        **config_kwargs(EngineConfig, args),
    )
    return ServerConfig(
        engine=engine,
        chat=ChatConfig(
            template=resolve_chat_template(args.chat_template),
            **config_kwargs(ChatConfig, args),
        ),
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        served_model_names=tuple(served),
        limits=Limits(**config_kwargs(Limits, args)),
        deadlines=Deadlines(**config_kwargs(Deadlines, args)),
        # The shell is one client of its own (no HTTP).
        api_server_count=1
        if args.shell
        else args.api_server_count or auto_api_servers(engine.device),
        **config_kwargs(ServerConfig, args),
    )


def auto_api_servers(device: str) -> int:
    """One API server process per 4 CPU cores, up to 4, when a GPU serves (the engine then
    outpaces one); 1 on a CPU (whose cores the engine needs)."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return 1
    return min(4, max(1, (os.cpu_count() or 1) // 4))


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    """Flags to config; a bad value exits with the parser's usage message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
