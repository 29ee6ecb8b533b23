"""Prometheus metrics of one server (own registry, so several servers can share a process).

Under `PROMETHEUS_MULTIPROC_DIR` (the launcher sets it for its API server processes) every
process writes its values to files there and /metrics reads them all (prometheus_client's
multiprocess mode): counters and histograms add up; a gauge shows the value last set by any
process (they all see the same scheduler stats, and the same server-wide queue)."""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Mapping

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

# Gauges set from `SchedulerStats`: attribute -> (metric name, help, label). A gauge without a
# label shows the stats field of its attribute's name unless `set_scheduler_stats` computes it.
_GAUGES: dict[str, tuple[str, str, str | None]] = {
    "running": ("minisgl_num_running_reqs", "Requests being decoded", None),
    "waiting": ("minisgl_num_waiting_reqs", "Requests queued for admission", None),
    "queued_seqs": (
        "minisgl_num_queued_seqs",
        "Sequences accepted without their first token yet (--max-queued-seqs caps them)",
        None,
    ),
    "kv_usage": ("minisgl_kv_cache_usage", "Share of KV pages held by running requests", None),
    "kv_pages": (
        "minisgl_kv_pages",
        "KV pages by state: free, held (by requests), protected (cached, in use), evictable "
        "(cached, unused), total",
        "state",
    ),
    "prefix_hit_rate": (
        "minisgl_prefix_cache_hit_rate",
        "Prompt tokens served from the prefix cache / prompt tokens, since start",
        None,
    ),
    "generated_tokens": (
        "minisgl_engine_generated_tokens",
        "Tokens the engine sampled since start, also those dropped after a stop string matched "
        "or the request was aborted",
        None,
    ),
    "constrained_requests": (
        "minisgl_constrained_requests",
        "Requests with a grammar (JSON schema, regex, EBNF) the scheduler took, since start",
        None,
    ),
    "grammar_compiles": (
        "minisgl_grammar_compiles",
        "Grammars the scheduler compiled (cache misses), since start",
        None,
    ),
    "grammar_compile_seconds": (
        "minisgl_grammar_compile_seconds",
        "Time the scheduler's grammar compiles took, since start",
        None,
    ),
    "grammar_cache_hits": (
        "minisgl_grammar_cache_hits",
        "Grammars the scheduler took from its compile cache, since start",
        None,
    ),
    "kv_tier": (
        "minisgl_kv_tier",
        "KV host tier: slots per tier (host_used, disk_total, ...), pages hit on the host / on "
        "disk, bytes saved / loaded / spilled / fetched, load copy and wait seconds, since start",
        "stat",
    ),
    "retractions": (
        "minisgl_retractions",
        "Requests retracted (KV pages ran short, or a more urgent request needed them), since "
        "start",
        None,
    ),
    "spec_tokens": (
        "minisgl_spec_tokens",
        "Speculative decoding since start: draft tokens proposed (verified) and accepted",
        "kind",
    ),
    "spec_accept_length": (
        "minisgl_spec_mean_accepted_length",
        "Tokens a speculating request gained per verify step on average, since start (accepted "
        "drafts plus the target's own token; 0 before any)",
        None,
    ),
    "spec_missed_waits": (
        "minisgl_spec_missed_waits",
        "Speculative decoding since start: times the overlapped loop waited for a step's "
        "tokens to speculate and the request then had no draft",
        None,
    ),
    "retractions_by_priority": (
        "minisgl_retractions_by_priority",
        "Retractions since start, by the retracted request's priority",
        "priority",
    ),
    "steps_timed": ("minisgl_steps_timed", "Steps whose period the scheduler measured", None),
    "step_time": (
        "minisgl_step_time_seconds",
        "Sum over the steps timed of their period: measured, as predicted by the step-time "
        "model just before, and the absolute difference",
        "kind",
    ),
    "step_model": (
        "minisgl_step_model_coefficient_seconds",
        "The step-time model's coefficients: seconds per step (base), per step that prefills "
        "(mixed), per 64 decode rows, per 1024 prefill tokens, per 65536 KV tokens",
        "term",
    ),
    "itl_target_s": (
        "minisgl_itl_target_seconds",
        "The inter-token latency target of the last step planned (0: none applied)",
        None,
    ),
}
_COMPUTED = {"queued_seqs", "kv_usage", "prefix_hit_rate", "spec_accept_length"}
# Histograms: (metric name, help, buckets, by priority), in `Metrics`'s attribute order
_HISTOGRAMS = (
    ("minisgl_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS, 0),
    ("minisgl_inter_token_latency_seconds", "Time between tokens", _LATENCY_BUCKETS, 0),
    ("minisgl_e2e_request_latency_seconds", "Request latency", _LATENCY_BUCKETS, 0),
    (
        "minisgl_queue_time_seconds",
        "Time from arrival at the scheduler to admission (first admission only)",
        _LATENCY_BUCKETS,
        1,
    ),
    (
        "minisgl_time_to_first_token_by_priority_seconds",
        "Time to first token, by request priority",
        _LATENCY_BUCKETS,
        1,
    ),
    (
        "minisgl_inter_token_latency_by_priority_seconds",
        "Time between tokens on the scheduler's clock, by request priority",
        _ITL_BUCKETS,
        1,
    ),
)


def observe_many(hist: Histogram, value: float, n: int) -> None:
    """`hist.observe(value)` `n` times, at the cost of one (a step's tokens share their gap).
    prometheus_client has no call for it: this adds to the bucket and the sum it would."""
    hist._sum.inc(value * n)
    hist._buckets[bisect_left(hist._upper_bounds, value)].inc(n)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Under several processes /metrics shows the value last set by any of them.
        self.gauges = {
            attr: Gauge(
                name, doc, [label] if label else [], registry=r, multiprocess_mode="mostrecent"
            )
            for attr, (name, doc, label) in _GAUGES.items()
        }
        self.queued_seqs = self.gauges["queued_seqs"]
        hist = (
            Histogram(name, doc, ["priority"] * by, buckets=buckets, registry=r)
            for name, doc, buckets, by in _HISTOGRAMS
        )
        (
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.ttft_by_priority,
            self.itl_by_priority,
        ) = hist
        self.prompt_tokens = Counter(
            "minisgl_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "minisgl_generation_tokens", "Tokens generated for finished requests", registry=r
        )
        self.requests = Counter(
            "minisgl_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self._labels: set[str] = set()

    def priority_label(self, priority: int | float) -> str:
        """The label of a priority (a bounded set, whatever the clients send)."""
        label = str(int(priority))
        if label in self._labels or len(self._labels) < PRIORITY_LABELS:
            self._labels.add(label)
            return label
        return "other"

    def set_scheduler_stats(self, s: SchedulerStats) -> None:
        g = self.gauges
        for attr, (_, _, label) in _GAUGES.items():
            if label is None and attr not in _COMPUTED:
                g[attr].set(getattr(s, attr))
        g["kv_usage"].set((s.kv_held + s.kv_protected) / s.kv_total if s.kv_total else 0.0)
        kv: dict[str, float] = {"free": s.kv_free, "held": s.kv_held, "protected": s.kv_protected,
              "evictable": s.kv_evictable, "total": s.kv_total}  # fmt: skip
        g["prefix_hit_rate"].set(s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0)
        rows = s.spec_verify_rows
        g["spec_accept_length"].set((s.spec_accepted + rows) / rows if rows else 0.0)
        times = {"measured": s.step_measured_s, "predicted": s.step_predicted_s,
                 "abs_error": s.step_abs_error_s}  # fmt: skip
        spec: dict[str, float] = {"proposed": s.spec_proposed, "accepted": s.spec_accepted}
        for attr, values in (("kv_pages", kv), ("spec_tokens", spec), ("step_time", times),
                             ("step_model", s.step_model), ("kv_tier", s.kv_tier)):  # fmt: skip
            for key, value in values.items():
                g[attr].labels(key).set(value)
        for priority, count in s.retractions_by_priority:
            g["retractions_by_priority"].labels(self.priority_label(priority)).set(count)
        for prio, seconds in s.queue_times:
            self.queue_time.labels(self.priority_label(prio)).observe(seconds)

    def on_first_token(self, ttft: float, priority: int) -> None:
        self.ttft.observe(ttft)
        self.ttft_by_priority.labels(self.priority_label(priority)).observe(ttft)

    def on_tokens(self, gaps: Mapping[tuple[float, int], int]) -> None:
        """`gaps[gap, priority]` tokens of that priority arrived `gap` seconds apart each."""
        for (gap, priority), n in gaps.items():
            observe_many(self.itl, gap, n)
            by = self.itl_by_priority.labels(self.priority_label(priority))
            observe_many(by, gap, n)

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
