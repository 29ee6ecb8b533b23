"""Prometheus metrics of one server (own registry, so several servers can share a process).

Under `PROMETHEUS_MULTIPROC_DIR` (the launcher sets it for its API server processes) every
process writes its values to files there and /metrics reads them all (prometheus_client's
multiprocess mode): counters and histograms add up; a gauge shows the value last set by any
process (they all see the same scheduler stats, and the same server-wide queue)."""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from minisgl.message import SchedulerStats, StrOut

PRIORITY_LABELS = 16  # distinct priorities labelled; the rest count as "other"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0,
    20.0, 60.0,
)  # fmt: skip
# Inter-token gaps are a few milliseconds on a GPU.
_ITL_BUCKETS = (
    0.001, 0.002, 0.003, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2,
    0.5, 1.0, 5.0,
)  # fmt: skip


def observe_many(hist: Histogram, value: float, n: int) -> None:
    """`hist.observe(value)` `n` times, at the cost of one (a step's tokens share their gap).
    prometheus_client has no call for it: this adds to the bucket and the sum it would."""
    hist._sum.inc(value * n)
    hist._buckets[bisect_left(hist._upper_bounds, value)].inc(n)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = self._gauge("minisgl_num_running_reqs", "Requests being decoded")
        self.waiting = self._gauge("minisgl_num_waiting_reqs", "Requests queued for admission")
        self.queued_seqs = self._gauge(
            "minisgl_num_queued_seqs",
            "Sequences accepted without their first token yet (--max-queued-seqs caps them)",
        )
        self.kv_usage = self._gauge(
            "minisgl_kv_cache_usage", "Share of KV pages held by running requests"
        )
        self.kv_pages = self._gauge(
            "minisgl_kv_pages",
            "KV pages by state: free, held (by requests), "
            "protected (cached, in use), evictable (cached, unused), total",
            ["state"],
        )
        self.prefix_hit_rate = self._gauge(
            "minisgl_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens, since start",
        )
        self.engine_generated = self._gauge(
            "minisgl_engine_generated_tokens",
            "Tokens the engine sampled since start, also those dropped after a stop string "
            "matched or the request was aborted",
        )
        self.constrained = self._gauge(
            "minisgl_constrained_requests",
            "Requests with a grammar (JSON schema, regex, EBNF) the scheduler took, since start",
        )
        self.grammar_compiles = self._gauge(
            "minisgl_grammar_compiles",
            "Grammars the scheduler compiled (cache misses), since start",
        )
        self.grammar_compile_seconds = self._gauge(
            "minisgl_grammar_compile_seconds",
            "Time the scheduler's grammar compiles took, since start",
        )
        self.grammar_cache_hits = self._gauge(
            "minisgl_grammar_cache_hits",
            "Grammars the scheduler took from its compile cache, since start",
        )
        self.prompt_tokens = Counter(
            "minisgl_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "minisgl_generation_tokens", "Tokens generated for finished requests", registry=r
        )
        self.requests = Counter(
            "minisgl_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds",
            "Time between tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds",
            "Request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._labels: set[str] = set()
        self._scheduling_metrics()

    def _scheduling_metrics(self) -> None:
        r = self.registry
        by_priority = ["priority"]
        self.queue_time = Histogram(
            "minisgl_queue_time_seconds",
            "Time from arrival at the scheduler to admission (first admission only)",
            by_priority,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_by_priority = Histogram(
            "minisgl_time_to_first_token_by_priority_seconds",
            "Time to first token, by request priority",
            by_priority,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl_by_priority = Histogram(
            "minisgl_inter_token_latency_by_priority_seconds",
            "Time between tokens on the scheduler's clock, by request priority",
            by_priority,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.kv_tier = self._gauge(
            "minisgl_kv_tier",
            "KV host tier: slots per tier (host_used, disk_total, ...), pages hit on the host / "
            "on disk, bytes saved / loaded / spilled / fetched, load copy and wait seconds, "
            "since start",
            ["stat"],
        )
        self.retractions = self._gauge(
            "minisgl_retractions",
            "Requests retracted (KV pages ran short, or a more urgent request needed them), "
            "since start",
        )
        self.spec_tokens = self._gauge(
            "minisgl_spec_tokens",
            "Speculative decoding since start: draft tokens proposed (verified) and accepted",
            ["kind"],
        )
        self.spec_accept_length = self._gauge(
            "minisgl_spec_mean_accepted_length",
            "Tokens a speculating request gained per verify step on average, since start "
            "(accepted drafts plus the target's own token; 0 before any)",
        )
        self.spec_missed_waits = self._gauge(
            "minisgl_spec_missed_waits",
            "Speculative decoding since start: times the overlapped loop waited for a step's "
            "tokens to speculate and the request then had no draft",
        )
        self.retractions_by_priority = self._gauge(
            "minisgl_retractions_by_priority",
            "Retractions since start, by the retracted request's priority",
            by_priority,
        )
        self.steps_timed = self._gauge(
            "minisgl_steps_timed", "Steps whose period the scheduler measured"
        )
        self.step_time = self._gauge(
            "minisgl_step_time_seconds",
            "Sum over the steps timed of their period: measured, as predicted by the step-time "
            "model just before, and the absolute difference",
            ["kind"],
        )
        self.step_model = self._gauge(
            "minisgl_step_model_coefficient_seconds",
            "The step-time model's coefficients: seconds per step (base), per step that "
            "prefills (mixed), per 64 decode rows, per 1024 prefill tokens, per 65536 KV tokens",
            ["term"],
        )
        self.itl_target = self._gauge(
            "minisgl_itl_target_seconds",
            "The inter-token latency target of the last step planned (0: none applied)",
        )

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        """Under several processes /metrics shows the value last set by any of them."""
        return Gauge(name, doc, labels, registry=self.registry, multiprocess_mode="mostrecent")

    def priority_label(self, priority: int | float) -> str:
        """The label of a priority (a bounded set, whatever the clients send)."""
        label = str(int(priority))
        if label in self._labels or len(self._labels) < PRIORITY_LABELS:
            self._labels.add(label)
            return label
        return "other"

    def set_scheduler_stats(self, s: SchedulerStats) -> None:
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        in_use = s.kv_held + s.kv_protected
        self.kv_usage.set(in_use / s.kv_total if s.kv_total else 0.0)
        for state, pages in (
            ("free", s.kv_free),
            ("held", s.kv_held),
            ("protected", s.kv_protected),
            ("evictable", s.kv_evictable),
            ("total", s.kv_total),
        ):
            self.kv_pages.labels(state).set(pages)
        self.prefix_hit_rate.set(s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0)
        self.engine_generated.set(s.generated_tokens)
        self.constrained.set(s.constrained_requests)
        self.grammar_compiles.set(s.grammar_compiles)
        self.grammar_compile_seconds.set(s.grammar_compile_seconds)
        self.grammar_cache_hits.set(s.grammar_cache_hits)
        self._set_scheduling_stats(s)

    def _set_scheduling_stats(self, s: SchedulerStats) -> None:
        for priority, seconds in s.queue_times:
            self.queue_time.labels(self.priority_label(priority)).observe(seconds)
        self.retractions.set(s.retractions)
        self.spec_tokens.labels("proposed").set(s.spec_proposed)
        self.spec_tokens.labels("accepted").set(s.spec_accepted)
        rows = s.spec_verify_rows
        self.spec_accept_length.set((s.spec_accepted + rows) / rows if rows else 0.0)
        self.spec_missed_waits.set(s.spec_missed_waits)
        for priority, count in s.retractions_by_priority:
            self.retractions_by_priority.labels(self.priority_label(priority)).set(count)
        self.steps_timed.set(s.steps_timed)
        self.step_time.labels("measured").set(s.step_measured_s)
        self.step_time.labels("predicted").set(s.step_predicted_s)
        self.step_time.labels("abs_error").set(s.step_abs_error_s)
        for term, value in s.step_model.items():
            self.step_model.labels(term).set(value)
        self.itl_target.set(s.itl_target_s)
        for stat, value in s.kv_tier.items():
            self.kv_tier.labels(stat).set(value)

    def on_first_token(self, ttft: float, priority: int) -> None:
        self.ttft.observe(ttft)
        self.ttft_by_priority.labels(self.priority_label(priority)).observe(ttft)

    def on_tokens(self, gaps: Mapping[tuple[float, int], int]) -> None:
        """`gaps[gap, priority]` tokens of that priority arrived `gap` seconds apart each."""
        for (gap, priority), n in gaps.items():
            observe_many(self.itl, gap, n)
            observe_many(self.itl_by_priority.labels(self.priority_label(priority)), gap, n)

    def on_finished(self, out: StrOut, latency: float) -> None:
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.requests.labels(out.finish_reason or "error").inc()
        self.e2e.observe(latency)

    def render(self) -> bytes:
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if folder is None:
            return generate_latest(self.registry)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process, folder)
        return generate_latest(every_process)
