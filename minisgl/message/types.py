"""The messages that cross process boundaries, in the order a request meets them.

API server -> tokenizer: `GenerateReq`, `AbortReq`, `FlushCacheReq`
tokenizer -> scheduler: `TokenizedReq`, `AbortReq` (aborts follow their request down one pipe),
    `FlushCacheReq`
detokenizer -> scheduler: `AbortReq` (a stop string matched)
scheduler -> detokenizer: `SchedulerOut` (one per step: `TokenOut`s plus `SchedulerStats`)
detokenizer -> API server: `DetokOut` (`StrOut`s plus the stats it was given)
tokenizer -> API server: `RequestError` (the request was refused before reaching the scheduler)
launcher -> API server: `WorkerDied` (a process exited: no request can be served any more)

Every field is a plain value, list or another message, so `codec` packs them with msgpack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.core import SamplingParams


@dataclass
class ToolCall:
    """A function call of an assistant message: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass
class ChatMessage:
    role: str  # system | developer | user | assistant | tool
    content: str
    name: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # role assistant
    tool_call_id: str | None = None  # role tool: the call this message answers


@dataclass
class ChatOptions:
    """How a conversation becomes a prompt: the tools (OpenAI's function objects) and
    documents the chat template renders, and extra template variables."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    documents: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerateReq:
    """One prompt and the choices (`rids`, one per `n`) to generate for it.

    Exactly one of `text`, `input_ids`, `messages` is set. `params.max_tokens` is replaced by
    `max_tokens`, or, when that is None, by every token the context leaves after the prompt
    (only the tokenizer knows the prompt's length).
    """

    rids: list[str]
    seeds: list[int]  # choice i samples with seeds[i]
    params: SamplingParams
    max_tokens: int | None
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None  # with `messages`
    # A reasoning model's end-of-thinking text (`</think>`): the grammar starts after it, when
    # it is one token of the vocabulary (`SamplingParams.grammar_after_token`).
    grammar_after: str | None = None
    # The request field its grammar (`params.constraint`) came from, named when the grammar is
    # refused; None: the constraint's kind.
    grammar_field: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.text, self.input_ids, self.messages)]
        assert sum(given) == 1, "GenerateReq: set exactly one of text, input_ids, messages"
        assert len(self.rids) == len(self.seeds) >= 1

    @property
    def prompt_chars(self) -> int:
        """Characters the tokenizer will read (0 for token ids)."""
        if self.text is not None:
            return len(self.text)
        if self.messages is not None:
            return sum(len(m.content) for m in self.messages)
        return 0


@dataclass
class TokenizedReq:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    """Drop every prefix-cache entry nobody uses (benchmarks start each run cold with it)."""

    token: int  # echoed in the `FlushCacheOut` that answers it


@dataclass
class FlushCacheOut:
    """The scheduler's answer to a `FlushCacheReq`: it flushes only when no request is in
    flight (running requests hold cache pages)."""

    token: int
    in_flight: int  # requests that kept the cache from being flushed; 0: flushed


@dataclass
class TokenOut:
    """New tokens of one request from one step (none when it was aborted or refused)."""

    rid: str
    new_ids: list[int]
    finished: bool
    finish_reason: str | None  # a FinishReason value once finished
    prompt_tokens: int
    cached_tokens: int
    # The detokenizer's output pipeline needs these (`OutputOptions`); they ride along so it
    # keeps no table.
    stop: list[str]
    skip_special_tokens: bool
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # Per new token, when the request asked for them: log-softmax of the raw logits.
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    error: str | None = None  # the scheduler refused the request (should not happen)


@dataclass
class SchedulerStats:
    """A snapshot taken after a step; token and step counts are totals since start."""

    running: int
    waiting: int
    kv_free: int
    kv_held: int  # pages owned by running requests
    kv_protected: int  # cache pages locked by running requests
    kv_evictable: int  # cache pages nobody uses
    kv_total: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    # Grammars (`minisgl.constrain`): constrained requests added, grammars compiled (cache
    # misses), the seconds that took, and compiles served from the cache.
    constrained_requests: int = 0
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0
    # Wall-clock time (time.time()) of the snapshot: the tokens that travel with it were on the
    # scheduler's host by then (the server's own token timestamps).
    time: float = 0.0
    retractions: int = 0
    # Speculative decoding since start: request-steps that verified drafts, drafts verified,
    # drafts accepted, waits for tokens in flight that then found no draft.
    spec_verify_rows: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_missed_waits: int = 0
    retractions_by_priority: list[list[int]] = field(default_factory=list)  # [priority, count]
    # [priority, seconds from arrival at the scheduler to admission] of each request admitted
    # for the first time since the previous snapshot.
    queue_times: list[list[float]] = field(default_factory=list)
    # The step-time model: periods of the steps measured (predicted just before each was
    # seen, and measured), its coefficients now by name (seconds), and the latency target of
    # the last step planned (0: none applied).
    steps_timed: int = 0
    step_predicted_s: float = 0.0
    step_measured_s: float = 0.0
    step_abs_error_s: float = 0.0
    step_model: dict[str, float] = field(default_factory=dict)
    # The KV host tier (`Scheduler.tier_stats`; empty when off): slots per tier, hit pages,
    # bytes moved and copy / wait seconds since start.
    kv_tier: dict[str, float] = field(default_factory=dict)
    itl_target_s: float = 0.0


@dataclass
class SchedulerOut:
    outputs: list[TokenOut]
    stats: SchedulerStats


@dataclass
class TopLogprob:
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: list[TopLogprob]


@dataclass
class StrOut:
    """New text of one request. `text` may lag `new_ids`: incomplete UTF-8 and possible stop
    string prefixes are held back until they resolve."""

    rid: str
    text: str
    new_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # total so far
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    matched_stop: str | int | None = None  # the stop string or stop token id that ended it
    # When the scheduler had each of `new_ids` (`SchedulerStats.time`); the API server fills
    # it in as outputs arrive (it does not travel between processes).
    token_times: list[float] = field(default_factory=list)


@dataclass
class DetokOut:
    outputs: list[StrOut]
    stats: SchedulerStats


@dataclass
class RequestError:
    """The tokenizer refused a request: the user must change `param`."""

    rids: list[str]
    message: str
    param: str | None
    status: int  # the HTTP status to answer with: 400 for the user's mistake, 500 for ours


@dataclass
class WorkerDied:
    reason: str  # which process exited, and how


@dataclass
class EngineInfo:
    """What the scheduler process reports once its model is loaded; the tokenizer worker adds
    what only it knows before the server starts serving."""

    model_name: str
    max_context: int
    num_pages: int
    page_size: int
    vocab_size: int
    # Characters of the vocabulary's longest token (a bound on the characters one token can
    # stand for); None until the tokenizer worker fills it in.
    max_token_chars: int | None = None
    # The format of the model's tool calls (`--tool-call-parser`, or detected from the chat
    # template by the tokenizer worker); None: not known.
    tool_call_parser: str | None = None
