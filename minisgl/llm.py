"""The offline API: `LLM(model).generate(prompts, params)` over the same scheduler and engine
that the server runs (in-process: no HTTP, no ZMQ)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from minisgl.config import EngineConfig
from minisgl.core import FinishReason, InvalidRequestError, Req, SamplingParams
from minisgl.engine import Engine
from minisgl.runtime.ranks import TPLaunch, start_scheduler
from minisgl.weights import load_tokenizer, resolve_source

Prompt = str | list[int]
Conversation = list[dict[str, Any]]


class LLM:
    """Generate text offline.

    `model` is None (the embedded SmolLM2-135M-Instruct), an HF directory or a `.gguf` file.
    Options are the fields of `EngineConfig` (dtype, device, load_format, page_size,
    max_prefill_tokens, max_running_requests, num_pages, cache, tp_size, seed, ...).
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        unknown = set(options) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"LLM: unknown options {sorted(unknown)}")
        config = EngineConfig(model=model, **options)
        # At tp > 1 this process is rank 0; ranks 1..N-1 run in processes of their own.
        self._tp: TPLaunch | None = None
        self.scheduler, self._tp = start_scheduler(config)
        self.engine: Engine = self.scheduler.engine
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
        return self._tokenizer

    @property
    def has_tokenizer(self) -> bool:
        try:
            return self.tokenizer is not None
        except (OSError, ValueError):  # a weights-only directory: token-id prompts only
            return False

    # ---- public API --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        params = self._params_per_prompt(len(prompts), sampling_params)
        reqs = [self._make_req(p, sp) for p, sp in zip(prompts, params)]
        for r in reqs:  # validate all before admitting any, so a bad one leaves nothing behind
            self.scheduler.check_request(r.prompt_len, r.params.max_tokens)
        for r in reqs:
            self.scheduler.add_request(r)
        self._run(reqs, use_tqdm)
        return [self._result(r) for r in reqs]

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = (
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else conversations
        )
        prompts = [self.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: Conversation) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if not isinstance(out, list) else out
        return list(ids)

    # ---- internals ---------------------------------------------------------------------------

    @staticmethod
    def _params_per_prompt(
        n: int, sp: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise ValueError(f"sampling_params: {len(sp)} given for {n} prompts")
        return list(sp)

    def _make_req(self, prompt: Prompt, params: SamplingParams) -> Req:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty")
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
            vocab = self.engine.model_config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab})")
        self._next_id += 1
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return Req(rid=f"offline-{self._next_id}", prompt_ids=ids, params=params, seed=seed)

    def _run(self, reqs: list[Req], use_tqdm: bool) -> None:
        bar = tqdm(total=len(reqs), desc="Generating", disable=not use_tqdm or None)
        try:
            while self.scheduler.has_work:
                for ev in self.scheduler.step():
                    if not ev.finished and ev.req.params.stop:
                        self._check_stop_strings(ev.req)
                    if ev.req.finished:
                        bar.update(1)
        finally:
            bar.close()

    def _check_stop_strings(self, req: Req) -> None:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if any(s in text for s in req.params.stop):
            self.scheduler.abort(req.rid)
            req.finish_reason = FinishReason.STOP

    def _result(self, req: Req) -> dict[str, Any]:
        text = None
        if self.has_tokenizer:
            skip = req.params.skip_special_tokens
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=skip)
            for s in req.params.stop:
                if s in text:
                    text = text[: text.index(s)]
        assert req.finish_reason is not None
        out: dict[str, Any] = {
            "text": text,
            "token_ids": list(req.output_ids),
            "finish_reason": req.finish_reason.value,
            "prompt_tokens": req.prompt_len,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
        }
        if req.params.logprobs:
            out["logprobs"] = list(req.output_logprobs)
        if req.params.top_logprobs:
            out["top_logprobs"] = [list(t) for t in req.output_top_logprobs]
        return out
