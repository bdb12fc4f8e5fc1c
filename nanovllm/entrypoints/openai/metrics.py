"""Prometheus metrics for `GET /metrics`, with vLLM's names under the `nanovllm:` prefix.

Two sources. Gauges and counters the core already keeps (running / waiting sequences, KV blocks,
prefix cache, preemptions) are read from the async engine's stats snapshot at scrape time by a
custom collector, so they are never stale and cost nothing per step. Per-request numbers (token
counts, time to first token, inter-token and end-to-end latency) are observed as outputs are
delivered (`ServerMetrics` is the async engine's RequestObserver).

Each server owns its CollectorRegistry: several servers (or tests) in one process never share or
collide on the global default registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nanovllm.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)


class EngineStatsCollector(Collector):
    """Reads the engine's counters at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]], model_name: str) -> None:
        self._stats = stats
        self._labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        total = s.get("num_total_blocks", 0)
        used = s.get("num_used_blocks", 0)
        queries = s.get("prefix_cache_queries", 0)
        hits = s.get("prefix_cache_hits", 0)
        yield self._gauge("nanovllm:num_requests_running",
                          "Sequences in the running batch (a request with n > 1 counts n times).",
                          s.get("num_running", 0))
        yield self._gauge("nanovllm:num_requests_waiting", "Sequences waiting to be scheduled.",
                          s.get("num_waiting", 0))
        yield self._gauge("nanovllm:kv_cache_blocks_used", "KV cache blocks held by sequences.", used)
        yield self._gauge("nanovllm:kv_cache_blocks_total", "KV cache blocks in the pool.", total)
        yield self._gauge("nanovllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                          used / total if total else 0.0)
        yield self._gauge("nanovllm:prefix_cache_hit_rate",
                          "Prefix cache hits / queries since start (0 before any query).",
                          hits / queries if queries else 0.0)
        yield self._counter("nanovllm:prefix_cache_queries", "Prefix cache lookups.", queries)
        yield self._counter("nanovllm:prefix_cache_hits", "Prefix cache lookups that hit.", hits)
        yield self._counter("nanovllm:num_preemptions", "Sequences preempted (to be recomputed).",
                            s.get("num_preemptions", 0))
        # Speculative decoding (vLLM's names): rows verified with drafts, drafts, accepted drafts, and
        # accepted drafts by position in their row.
        yield self._counter("nanovllm:spec_decode_num_drafts", "Rows verified with drafts.", s.get("spec_num_drafts", 0))
        yield self._counter("nanovllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                            s.get("spec_num_draft_tokens", 0))
        yield self._counter("nanovllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            s.get("spec_num_accepted_tokens", 0))
        per_pos = CounterMetricFamily("nanovllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by their position in the row.",
                                      labels=[*self._labels, "position"])
        for position, count in enumerate(s.get("spec_num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([*self._labels.values(), str(position)], count)
        yield per_pos


@dataclass
class _Timing:
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, int]], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(stats, model_name))
        labels = ["model_name"]
        r = self.registry
        self._prompt_tokens = Counter("nanovllm:prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                      registry=r).labels(model_name)
        self._generation_tokens = Counter("nanovllm:generation_tokens", "Generated tokens.", labels,
                                          registry=r).labels(model_name)
        self._success = Counter("nanovllm:request_success",
                                "Finished completions (one per sequence; n per request) by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self._aborted = Counter("nanovllm:request_aborted", "Requests aborted before finishing "
                                "(client gone or engine error).", labels, registry=r).labels(model_name)
        self._stalled = Counter("nanovllm:stream_stall_aborts", "Requests aborted because their client stopped "
                                "reading (--stream-stall-timeout, or too much output left unread).", labels,
                                registry=r).labels(model_name)
        self._ttft = Histogram("nanovllm:time_to_first_token_seconds", "Arrival to first generated token.",
                               labels, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self._itl = Histogram("nanovllm:inter_token_latency_seconds",
                              "Time between consecutive outputs of a request (one token per step).",
                              labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self._e2e = Histogram("nanovllm:e2e_request_latency_seconds", "Arrival to last token.",
                              labels, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self._model_name = model_name
        self._timings: dict[str, _Timing] = {}

    # RequestObserver -----------------------------------------------------------------------

    def on_output(self, output: RequestOutput, now: float) -> None:
        t = self._timings.get(output.request_id)
        if t is None:
            t = self._timings[output.request_id] = _Timing()
            self._prompt_tokens.inc(len(output.prompt_token_ids))
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if new_tokens:
            self._generation_tokens.inc(new_tokens)
            if t.last_token_time is None:
                m = output.metrics
                first = m.first_token_time if m and m.first_token_time is not None else now
                if m is not None:
                    self._ttft.observe(max(0.0, first - m.arrival_time))
            else:
                self._itl.observe(max(0.0, now - t.last_token_time))
            t.last_token_time = now
        for c in output.outputs:  # deltas: each completion reports its finish exactly once
            if c.finish_reason is not None:
                self._success.labels(self._model_name, c.finish_reason).inc()
        if output.finished:
            del self._timings[output.request_id]
            m = output.metrics
            if m is not None:
                self._e2e.observe(max(0.0, (m.finished_time or now) - m.arrival_time))

    def on_abort(self, request_id: str) -> None:
        self._timings.pop(request_id, None)
        self._aborted.inc()

    def on_stall(self) -> None:
        self._stalled.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
