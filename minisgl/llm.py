"""The offline API: `LLM(model).generate(prompts, params)` over the same scheduler and engine
that the server runs (in-process: no HTTP, no ZMQ)."""

from __future__ import annotations

import contextlib
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

from tqdm import tqdm

from minisgl.config import ChatConfig, EngineConfig, resolve_chat_template
from minisgl.core import InvalidRequestError, Req, SamplingParams
from minisgl.engine import Engine
from minisgl.engine.startup import summarize
from minisgl.message import ChatOptions
from minisgl.runtime.ranks import TPLaunch, start_scheduler
from minisgl.tokenizer.output import OutputDelta, OutputOptions, RequestOutput
from minisgl.tokenizer.parsers import THINK_END, detect_tool_call_parser
from minisgl.tokenizer.tokenize import chat_ids, message_from_dict, prompt_ids, single_token
from minisgl.tokenizer.tools import ToolPlan, assistant_message, choice_parsers, tool_plan
from minisgl.weights import fetch_model, load_tokenizer, resolve_source

Prompt = str | list[int]
Conversation = list[dict[str, Any]]
# Sampling parameters as the dataclass or as a dict of its fields (vLLM's habit).
Params = SamplingParams | dict[str, Any]


class LLM:
    """Generate text offline.

    `model` is None (the embedded SmolLM2-135M-Instruct), a hub id (`org/name`, fetched into
    the hub cache; `revision` picks a branch, tag or commit), an HF directory or a `.gguf` file.
    Options are the fields of `EngineConfig` (dtype, device, load_format, page_size,
    max_prefill_tokens, max_running_requests, num_pages, cache, tp_size, seed, ...). The chat
    options are the server's: `chat_template` (a file or Jinja text in place of the model's),
    `tool_call_parser` (None: detected from the template) and `reasoning_parser`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        revision: str | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        **options: Any,
    ) -> None:
        unknown = set(options) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"LLM: unknown options {sorted(unknown)}")
        self.chat_config = ChatConfig(
            resolve_chat_template(chat_template), tool_call_parser, reasoning_parser
        )
        started = time.perf_counter()
        path = fetch_model(model, revision)  # a hub id: its snapshot in the hub cache
        name = resolve_source(path).name if path == model else str(model)  # a hub id as given
        model = path
        config = EngineConfig(model=model, **options)
        if config.show_progress:  # loading takes seconds to minutes: say so, terminal or not
            print(f"minisgl: loading {name} ...", file=sys.stderr, flush=True)
        # At tp > 1 this process is rank 0; ranks 1..N-1 run in processes of their own.
        self._tp: TPLaunch | None = None
        self.scheduler, self._tp = start_scheduler(config)
        # Grammars compile against the tokenizer this LLM loads anyway.
        self.scheduler.grammars.load_tokenizer = lambda: self.tokenizer
        self.engine: Engine = self.scheduler.engine
        # What start-up built and how long it took (printed with `show_progress`).
        self.startup = summarize(self.engine, name, started)
        if config.show_progress:
            print(self.startup.text(), file=sys.stderr, flush=True)
        self._model = model
        self._tokenizer: Any = None
        self._rng = random.Random(config.seed)
        self._next_id = 0

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, after which the LLM cannot generate (nothing
        to do at tp=1). Also runs at garbage collection and at interpreter exit."""
        tp, self._tp = getattr(self, "_tp", None), None
        if tp is not None:
            tp.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded on first use (token-id prompts never need it)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(resolve_source(self._model))
            if self.chat_config.template is not None:
                self._tokenizer.chat_template = self.chat_config.template
        return self._tokenizer

    @property
    def tool_call_parser(self) -> str | None:
        """The format of the model's tool calls: the option, or detected from the template."""
        parser = self.chat_config.tool_call_parser
        return parser or detect_tool_call_parser(self.tokenizer.chat_template)

    @property
    def has_tokenizer(self) -> bool:
        try:
            return self.tokenizer is not None
        except (OSError, ValueError):  # a weights-only directory: token-id prompts only
            return False

    # ---- public API --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Generate for every prompt (text or token ids); results in prompt order. One string,
        or one list of token ids, is one prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(Prompt, prompts)]
        prompts = cast(Sequence[Prompt], prompts)
        params = self._params_per_prompt(len(prompts), sampling_params)
        reqs = [self._make_req(p, sp) for p, sp in zip(prompts, params)]
        for r in reqs:  # validate all before admitting any, so a bad one leaves nothing behind
            self.scheduler.check_request(r.prompt_len, r.params)
            self.scheduler.check_grammar(r.params)
        has_text = self.has_tokenizer
        if not has_text and any(r.params.stop for r in reqs):
            raise InvalidRequestError(
                "stop: stop strings need the model's tokenizer, and this model has none; use "
                "stop_token_ids"
            )
        answers = {r.rid: _Answer(r, self.tokenizer if has_text else None) for r in reqs}
        for r in reqs:
            self.scheduler.add_request(r)
        self._run(answers, use_tqdm)
        return [answers[r.rid].result(has_text) for r in reqs]

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Apply the chat template to each conversation (OpenAI-style messages, with `tools`
        and `chat_template_kwargs`), then generate. Tool calls and reasoning are handled as the
        server handles them: `tool_choice` (`none`, `auto`, `required` or a named function)
        offers, forces or withholds the tools, and each result gets OpenAI's assistant
        `message` (`content`, `reasoning_content` with a reasoning parser, `tool_calls`) with
        `finish_reason` "tool_calls" for an answer that stopped after its calls."""
        single = bool(conversations) and isinstance(conversations[0], dict)
        convs = cast(list[Conversation], [conversations] if single else list(conversations))
        params = self._params_per_prompt(len(convs), sampling_params)
        other = next((p.constraint.kind for p in params if p.constraint is not None), None)
        plan = tool_plan(list(tools or ()), tool_choice, parallel_tool_calls,
                         self.tool_call_parser, other)  # fmt: skip
        kwargs = dict(chat_template_kwargs or {})
        chat = replace(self.chat_config, tool_call_parser=self.tool_call_parser)
        thinking, make_parser = choice_parsers(plan, chat, kwargs)
        prompts = [self.apply_chat_template(c, plan.template_tools, kwargs) for c in convs]
        params = [self._chat_params(p, plan, thinking) for p in params]
        outs = self.generate(prompts, params, use_tqdm)
        for out in outs:
            parser = make_parser() if make_parser is not None else None
            out.update(assistant_message(out["text"], out["finish_reason"], parser))
        return outs

    def apply_chat_template(
        self,
        conversation: Conversation,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids, rendered as the server renders a chat request."""
        options = ChatOptions(list(tools or ()), [], dict(chat_template_kwargs or {}))
        return chat_ids(self.tokenizer, [message_from_dict(m) for m in conversation], options)

    def _chat_params(
        self, params: SamplingParams, plan: ToolPlan, thinking: bool
    ) -> SamplingParams:
        """A forced call's grammar; with a reasoning parser and thinking on, any grammar starts
        after the end of the thinking (when the vocabulary has it as one token)."""
        if plan.grammar is not None:
            params = replace(params, tool_calls=plan.grammar)
        if thinking and self.chat_config.reasoning_parser and params.constraint is not None:
            params = replace(params, grammar_after_token=single_token(self.tokenizer, THINK_END))
        return params

    # ---- internals ---------------------------------------------------------------------------

    @staticmethod
    def _params_per_prompt(n: int, sp: Params | Sequence[Params] | None) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, (SamplingParams, dict)):
            return [_sampling_params(sp)] * n
        if len(sp) != n:
            raise ValueError(f"sampling_params: {len(sp)} given for {n} prompts")
        return [_sampling_params(p) for p in sp]

    def _make_req(self, prompt: Prompt, params: SamplingParams) -> Req:
        vocab = self.engine.model_config.vocab_size
        params.check_vocab(vocab)
        if prompt == "":
            raise InvalidRequestError("prompt: must not be empty")
        ids = prompt_ids(lambda: self.tokenizer, prompt, vocab)
        self._next_id += 1
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return Req(rid=f"offline-{self._next_id}", prompt_ids=ids, params=params, seed=seed)

    def _run(self, answers: dict[str, _Answer], use_tqdm: bool) -> None:
        bar = tqdm(total=len(answers), desc="Generating", disable=not use_tqdm or None)
        try:
            while self.scheduler.has_work:
                for ev in self.scheduler.step():
                    a = answers[ev.req.rid]
                    # Requests with stop strings are read every step (to stop early); the others
                    # once, when they finish (the output does not depend on how it is chunked).
                    if (ev.finished or a.eager) and a.feed() and not ev.finished:
                        self.scheduler.abort(ev.req.rid)  # a stop string ended the answer
                    if ev.req.finished:
                        bar.update(1)
        finally:
            bar.close()


def _sampling_params(sp: Params) -> SamplingParams:
    if isinstance(sp, SamplingParams):
        return sp
    unknown = set(sp) - set(SamplingParams.__dataclass_fields__)
    if unknown:
        raise ValueError(f"sampling_params: unknown fields {sorted(unknown)}")
    return SamplingParams(**sp)


class _Answer:
    """One request's answer: the output pipeline, fed from the request's token lists."""

    def __init__(self, req: Req, tokenizer: Any | None) -> None:
        self.req = req
        self.pipeline = RequestOutput(tokenizer, OutputOptions.of(req.params))
        self.eager = bool(req.params.stop)
        self._fed = 0
        self._parts: list[str] = []
        self._deltas: list[OutputDelta] = []

    def feed(self) -> bool:
        """Pass the tokens the request gained since the last call; True once the answer has
        ended (a stop string, or the scheduler finished it)."""
        req, p, n = self.req, self.req.params, self._fed
        if self.pipeline.finished:
            return True
        self._fed = len(req.output_ids)
        top = req.output_top_logprobs[n:] if p.top_logprobs else []
        delta = self.pipeline.add(
            req.output_ids[n:],
            req.finished,
            req.finish_reason.value if req.finish_reason is not None else None,
            req.output_logprobs[n:] if p.logprobs else (),
            [[t for t, _ in row] for row in top],
            [[lp for _, lp in row] for row in top],
        )
        assert delta is not None
        self._parts.append(delta.text)
        self._deltas.append(delta)
        return delta.finished

    def result(self, has_text: bool) -> dict[str, Any]:
        self.feed()  # a request finished outside a step (none today) still gets its ending
        last, req = self._deltas[-1], self.req
        out: dict[str, Any] = {
            "text": "".join(self._parts) if has_text else None,
            "token_ids": [t for d in self._deltas for t in d.token_ids],
            "finish_reason": last.finish_reason,
            "matched_stop": last.matched_stop,
            "prompt_tokens": req.prompt_len,
            "completion_tokens": last.completion_tokens,
            "cached_tokens": req.cached_tokens,
        }
        if req.params.logprobs:
            out["logprobs"] = [lp for d in self._deltas for lp in d.logprobs]
        if req.params.top_logprobs:
            out["top_logprobs"] = [
                list(zip(ids, lps, strict=True))
                for d in self._deltas
                for ids, lps in zip(d.top_ids, d.top_logprobs, strict=True)
            ]
        return out
