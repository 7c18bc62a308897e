"""The Prometheus metrics of one app (``GET /metrics``): requests by status code and their latency, counted by the
routes, and the service's own counters (``AnswerService.metrics``: decode-step rows, answers, retrievals,
cancellations, queue depth), read when the metrics are scraped.

Imports prometheus_client only; :mod:`fastgate.entrypoints.http.app` builds one per app and passes it to the routes.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from fastgate.serving.service import LATENCY_BUCKETS_S

__all__ = ["CONTENT_TYPE_LATEST", "HttpMetrics"]

_SECONDS = LATENCY_BUCKETS_S  # the service folds its answers' latencies into these buckets between scrapes


# the service's own counters, exported as Prometheus counters (they only grow): name -> (its attribute of
# ``AnswerService.metrics``, help)
_TOTALS: dict[str, tuple[str, str]] = {
    "fastgate_generation_calls_total": ("generation_calls",
                                        "decode steps (closed generation calls without the decode loop)"),
    "fastgate_shared_generation_calls_total": ("shared_generation_calls",
                                               "decode steps whose rows came from programs of more than one method"),
    "fastgate_scheduler_ticks_total": ("ticks_total", "scheduler ticks that ran requests"),
    "fastgate_cancelled_total": ("cancelled", "requests cancelled (timeout, disconnect), running or still queued"),
    "fastgate_answered_total": ("answered", "questions answered"),
    "fastgate_retrieved_total": ("retrieved", "answered questions that read retrieved passages"),
    "fastgate_searches_total": ("searches", "retrieval calls: searches, read or not (the read gate searches every "
                                            "question)"),
    "fastgate_failed_total": ("failed", "requests that ended without an answer (errors and cancellations)"),
    "fastgate_rejected_total": ("rejected_total", "requests refused because the queue was full (503)"),
}


class _Totals:
    """A collector of the service's counters as they were at the last render (read there, under the service's
    lock, with the histograms they go with)."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def collect(self):
        for name, (_, help_line) in _TOTALS.items():
            family = CounterMetricFamily(name, help_line)
            family.add_metric([], self.values[name])
            yield family


class HttpMetrics:
    """One app's registry (its own: several apps may live in one process)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests_total = Counter("fastgate_requests_total", "HTTP answer requests by status code", ["status"],
                                      registry=registry)
        self.latency = Histogram("fastgate_request_latency_seconds", "answer request latency", registry=registry,
                                 buckets=_SECONDS)
        self.rows = Histogram("fastgate_generation_rows",
                              "sequences per decode step (per closed generation call without the decode loop)",
                              registry=registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.class_latency = Histogram("fastgate_answer_latency_seconds",
                                       "submit-to-answer latency by whether it retrieved", ["retrieved"],
                                       registry=registry, buckets=_SECONDS)
        self.live = Gauge("fastgate_live_programs", "requests whose programs are running", registry=registry)
        self.retrieval_rate = Gauge("fastgate_retrieval_rate", "retrieved / answered", registry=registry)
        self.depth = Gauge("fastgate_queue_depth", "requests waiting for a batch", registry=registry)
        self._totals: dict[str, float] = dict.fromkeys(_TOTALS, 0.0)  # the service's counters at the last render
        registry.register(_Totals(self._totals))

    def count(self, status: int) -> None:
        """One request answered with ``status``."""
        self.requests_total.labels(str(status)).inc()

    def observe(self, seconds: float) -> None:
        """The latency of one request answered with 200."""
        self.latency.observe(seconds)

    def render(self, service: Any) -> str:
        """The exposition text, with ``service``'s counters read now."""
        m = service.metrics
        new_rows, latencies = m.drain()
        for n in new_rows:
            self.rows.observe(n)
        for was_retrieved, seconds in latencies:
            self.class_latency.labels("yes" if was_retrieved else "no").observe(seconds)
        self.live.set(service.live_programs)
        self._totals.update({name: getattr(m, attr) for name, (attr, _) in _TOTALS.items()})
        self.retrieval_rate.set(m.retrieved / m.answered if m.answered else 0.0)
        self.depth.set(service.queue_depth)
        return generate_latest(self.registry).decode()
