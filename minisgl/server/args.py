"""Command-line flags of `python -m minisgl` and the frozen config they resolve to
(`minisgl.config.ServerConfig`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from minisgl import __version__
from minisgl.config import (
    DTYPES,
    REASONING_PARSERS,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    TOOL_CALL_PARSERS,
    ChatConfig,
    EngineConfig,
    resolve_chat_template,
)
from minisgl.config.cli import add_aliases
from minisgl.config.quant import KV_CACHE_DTYPES, QUANTIZATIONS
from minisgl.config.secrets import ENV_API_KEY, resolve_api_key
from minisgl.config.server import LOG_LEVELS, Deadlines, Limits, ServerConfig
from minisgl.kvcache import CACHE_KINDS
from minisgl.weights import fetch_model, resolve_source


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minisgl",
        description="Serve a model over an OpenAI-compatible HTTP API, or chat with it (--shell).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"minisgl {__version__}")
    m = p.add_argument_group("model")
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
    m.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="weight and activation dtype; auto: float32 on CPU, the checkpoint's on GPU",
    )
    m.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="fp8: linear and expert weights in FP8 e4m3 (16-bit checkpoints quantized at load, "
        "one scale per output channel; needs compute capability >= 8.9 on a GPU); FP8 "
        "checkpoints (quant_method fp8, compressed-tensors) load as FP8 without it; int4/int8: "
        "weight-only integers, round-to-nearest per group of 128 (GGUF, AWQ, GPTQ checkpoints "
        "load as integers without it); dequantize: serve an integer checkpoint in the model dtype",
    )
    m.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="auto: read the weights; dummy: random weights (benchmarks)",
    )
    m.add_argument(
        "--device", default="auto", help="auto, cpu, cuda or cuda:N; auto picks cuda when available"
    )
    m.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks (GPUs), over all nodes",
    )
    m.add_argument(
        "--seed",
        type=int,
        default=0,
        help="engine seed (dummy weights; requests without a seed draw their own)",
    )
    s = p.add_argument_group("scheduling and memory")
    s.add_argument(
        "--cache",
        default="radix",
        choices=CACHE_KINDS,
        help="prefix cache: radix shares KV of common prefixes, naive shares none",
    )
    s.add_argument(
        "--kv-host-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="host memory per rank for KV pages the GPU evicts from the radix cache; a later "
        "prefix hit loads them back instead of computing them again; 0: off",
    )
    s.add_argument(
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="with --kv-host-gib: page files here take what the host tier evicts",
    )
    s.add_argument(
        "--kv-disk-gib", type=float, default=16.0, help="size of each rank's --kv-disk-dir file"
    )
    s.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache storage; auto: the model dtype; fp8_e4m3 holds twice the tokens of "
        "bfloat16 in the same memory (a scale per layer and KV head)",
    )
    s.add_argument(
        "--kv-cache-calibrate",
        type=int,
        default=0,
        metavar="N",
        help="with --kv-cache-dtype fp8_e4m3: set the KV scales from N prefill tokens of a "
        "built-in text at start-up; 0: the checkpoint's KV scales, else 1.0",
    )
    s.add_argument(
        "--page-size", type=int, default=0, help="tokens per KV page; 0: auto (1 on CPU, 16 on GPU)"
    )
    s.add_argument(
        "--num-pages",
        type=int,
        default=0,
        help="KV pool size in pages; 0: auto, sized from free memory",
    )
    s.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=8192,
        help=(
            "tokens per step while prompts wait: decoding requests' tokens plus prefill chunks "
            "(longer prompts are chunked; prefill keeps at least a quarter)"
        ),
    )
    s.add_argument(
        "--max-running-requests", type=int, default=256, help="requests decoded together at most"
    )
    s.add_argument(
        "--itl-target-ms",
        type=itl_target,
        default=None,
        metavar="auto|MS",
        help="inter-token latency target: while requests decode, a step prefills only the "
        "prompt tokens that the measured step-time model says fit in it (long prompts are "
        "chunked at page boundaries; alone, a prompt prefills at full size). auto: 2.5x the "
        "predicted time of the step's decodes alone; 0: off (steps are filled up to "
        "--max-prefill-tokens); default: auto on a GPU, 0 on the CPU",
    )
    s.add_argument(
        "--schedule-policy",
        default="fcfs",
        choices=SCHEDULE_POLICIES,
        help="fcfs: first come, first served; priority: by each request's `priority` (lower "
        "is more urgent), the least urgent retracted first when KV runs short",
    )
    s.add_argument(
        "--priority-aging-s",
        type=float,
        default=10.0,
        help="with --schedule-policy priority: a waiting request gains one priority level per "
        "this many seconds of waiting, so none starves; 0: no aging",
    )
    s.add_argument(
        "--mem-fraction",
        type=float,
        default=0.9,
        help="share of the GPU's memory the engine may fill (weights, CUDA graphs, activations, "
        "then the KV pool with the rest); on a CPU --num-pages sizes the pool",
    )
    s.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=256,
        help="decode batches up to this size replay CUDA graphs (padded to a captured size); "
        "0 disables the graphs",
    )
    s.add_argument(
        "--piecewise-graph-max-tokens",
        type=int,
        default=2048,
        help="steps that prefill up to this many tokens replay piecewise CUDA graphs (dense "
        "models at tp 1; attention runs between the pieces); 0 runs them eagerly",
    )
    s.add_argument(
        "--piecewise-whole-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capture each prefilling step's token bucket as one graph, attention included "
        "(one mixed-attention kernel per layer; Triton backend); --no-piecewise-whole-step: "
        "graphs of the dense parts with attention launched between them",
    )
    s.add_argument(
        "--disable-overlap",
        action="store_true",
        help="schedule each step after the previous step's tokens are back (by default on "
        "CUDA the host prepares step N+1 while the GPU runs step N)",
    )
    s.add_argument(
        "--max-context-len",
        type=int,
        default=0,
        help="longest prompt + output in tokens; 0: the model's maximum",
    )
    add_speculative_args(p)
    d = p.add_argument_group(
        "multi-node",
        "Ranks spread evenly over the nodes. Node 0 serves HTTP and holds ranks "
        "0..tp/nnodes-1; on node K > 0 the same command with --node-rank K runs only its ranks.",
    )
    d.add_argument("--nnodes", type=int, default=1, help="hosts the tensor-parallel ranks span")
    d.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
    d.add_argument(
        "--dist-init-addr",
        default=None,
        help="host:port where node 0 hosts the ranks' rendezvous (required when nnodes > 1; "
        "every node passes node 0's address); default: a free local port",
    )
    h = p.add_argument_group("serving")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on")
    h.add_argument("--port", type=int, default=1919, help="port to listen on")
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
    h.add_argument(
        "--shell",
        action="store_true",
        help="chat with the model in this terminal instead of serving HTTP",
    )
    h.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="logging verbosity")
    h.add_argument(
        "--shutdown-timeout",
        type=float,
        default=ServerConfig.shutdown_timeout,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM the server takes no new request (503, /health too) and gives "
        "those in flight this long to finish; the rest get 503 (a stream: an error event, then "
        "[DONE]); a second signal exits at once",
    )
    h.add_argument(
        "--skip-warmup",
        action="store_true",
        help="start without the warm-up steps; the first requests then wait for the kernels' "
        "JIT compiles",
    )
    _add_chat_flags(p)
    _add_limit_flags(p)
    add_aliases(p)
    return p


def _add_chat_flags(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("chat")
    c.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_STRING",
        help="a Jinja chat template (a file, or the template itself) used instead of the "
        "model's own; it renders `messages`, `tools`, `documents` and chat_template_kwargs",
    )
    c.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="the format of the model's tool calls (hermes = qwen25 = qwen3: <tool_call>{...}"
        "</tool_call>; llama3: JSON after <|python_tag|>; mistral: [TOOL_CALLS][...]; "
        "deepseek: DeepSeek-R1/V3's <｜tool▁calls▁begin｜>...); "
        "default: detected from the chat template",
    )
    c.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split the model's <think>...</think> part into reasoning_content; default: none "
        "(the thinking stays in the content)",
    )


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    lim, dl = Limits(), Deadlines()
    g = p.add_argument_group(
        "request limits",
        "Checked before any expensive work; each refusal is a 4xx (503 for a full queue) with "
        "an OpenAI-style error body.",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=lim.max_request_bytes,
        help="largest request body: 413 once Content-Length announces more, or once a chunked "
        "body passes it (the rest is not read)",
    )
    g.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=lim.max_seqs_per_request,
        help="most sequences (prompts x n) one request may ask for; more: 400",
    )
    g.add_argument(
        "--max-queued-seqs",
        type=int,
        default=lim.max_queued_seqs,
        help="sequences accepted but without their first token yet (waiting to be tokenized, "
        "admitted or prefilled); a request that would pass it gets 503 with Retry-After",
    )
    t = p.add_argument_group(
        "connection time-outs", "In seconds, like nginx's; each closes the connection."
    )
    t.add_argument(
        "--header-timeout",
        type=float,
        default=dl.header_timeout,
        help="a request's header must arrive whole within this (from the connection or the "
        "request's first byte); else 408",
    )
    t.add_argument(
        "--body-timeout",
        type=float,
        default=dl.body_timeout,
        help="a request's body must arrive whole within this after its header; else 408",
    )
    t.add_argument(
        "--send-timeout",
        type=float,
        default=dl.send_timeout,
        help="a client that reads nothing for this long while its answer waits to be written "
        "(a full buffer) is dropped; its request is aborted and its KV freed",
    )
    t.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=dl.keep_alive_timeout,
        help="an idle connection between two requests is closed after this",
    )


def itl_target(text: str) -> float | str:
    """`--itl-target-ms`: "auto" or milliseconds."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or milliseconds, got {text!r}") from None


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    sp = p.add_argument_group(
        "speculative decoding",
        "Each verify step scores the drafts of every speculating request in one forward and "
        "keeps the longest prefix the target's own sampling agrees with (greedy output and "
        "the sampling distribution are unchanged); a request whose drafts are mostly rejected, "
        "and a batch larger than --speculative-max-batch, decodes plainly.",
    )
    sp.add_argument(
        "--speculative-algorithm",
        default=None,
        choices=SPECULATIVE_ALGORITHMS,
        help="ngram: prompt lookup (what followed the last earlier occurrence of the last n "
        "tokens); draft: the model's own first --speculative-draft-layers layers with its "
        "final norm and LM head; default: off",
    )
    sp.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=4,
        metavar="K",
        help="drafts verified per request and step at most",
    )
    sp.add_argument(
        "--speculative-ngram-n",
        type=int,
        default=3,
        help="ngram: the longest suffix looked up (shorter ones when it is not found)",
    )
    sp.add_argument(
        "--speculative-ngram-min-n",
        type=int,
        default=3,
        help="ngram: the shortest suffix looked up (shorter ones match by chance in any text)",
    )
    sp.add_argument(
        "--speculative-draft-model",
        default=None,
        metavar="PATH",
        help="draft: a smaller model of the same vocabulary (HF directory or .gguf) instead of "
        "the layer-skip draft; its own weights and KV pool",
    )
    sp.add_argument(
        "--speculative-draft-layers",
        type=int,
        default=0,
        metavar="L",
        help="draft: layers of the layer-skip draft; 0: a quarter of the model's, at least one",
    )
    sp.add_argument(
        "--speculative-max-batch",
        type=int,
        default=8,
        help="steps with more decoding requests than this do not speculate",
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Raises ValueError naming the flag to change."""
    model = fetch_model(args.model, args.revision)  # a hub id: its snapshot in the hub cache
    resolve_source(model)  # fail here, not after the workers started, on a bad path
    # A hub id is the served name unless names are given (the snapshot's folder is a hash).
    served = args.served_model_name or ([args.model] if model != args.model else [])
    engine = EngineConfig(
        model=model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_calibrate=args.kv_cache_calibrate,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        itl_target_ms=args.itl_target_ms,
        schedule_policy=args.schedule_policy,
        priority_aging_s=args.priority_aging_s,
        speculative_algorithm=args.speculative_algorithm,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_ngram_n=args.speculative_ngram_n,
        speculative_ngram_min_n=args.speculative_ngram_min_n,
        speculative_draft_layers=args.speculative_draft_layers,
        speculative_draft_model=args.speculative_draft_model,
        speculative_max_batch=args.speculative_max_batch,
        max_context_len=args.max_context_len,
        mem_fraction=args.mem_fraction,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        piecewise_graph_max_tokens=args.piecewise_graph_max_tokens,
        piecewise_whole_step=args.piecewise_whole_step,
        overlap=not args.disable_overlap,
        cache=args.cache,
        kv_host_gib=args.kv_host_gib,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_gib=args.kv_disk_gib,
        tp_size=args.tp_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        seed=args.seed,
        skip_warmup=args.skip_warmup,
        show_progress=False,
    )
    return ServerConfig(
        engine=engine,
        chat=ChatConfig(
            template=resolve_chat_template(args.chat_template),
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        ),
        host=args.host,
        port=args.port,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        shell=args.shell,
        served_model_names=tuple(served),
        log_level=args.log_level,
        limits=Limits(
            max_request_bytes=args.max_request_bytes,
            max_seqs_per_request=args.max_seqs_per_request,
            max_queued_seqs=args.max_queued_seqs,
        ),
        deadlines=Deadlines(
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            send_timeout=args.send_timeout,
            keep_alive_timeout=args.keep_alive_timeout,
        ),
        shutdown_timeout=args.shutdown_timeout,
        # The shell is one client of its own (no HTTP).
        api_server_count=1
        if args.shell
        else args.api_server_count or auto_api_servers(engine.device),
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
