"""The embeddable answering service: a thread-safe ``submit() -> Future`` in front of one engine, with dynamic
batching, a bounded queue and metrics. ``fastgate serve`` puts HTTP in front of it (:mod:`fastgate.server`).

Concurrent requests are gathered into micro-batches: the worker takes the oldest request, waits at most
``max_wait_ms`` for more (up to ``max_batch``; after a batch of n with m requests queued meanwhile, up to
``regroup_wait_ms`` until n + m are in hand, so that the clients just answered rejoin), groups them by (method,
parameters) and runs each group as one ``answer_batch`` call, i.e. one batched decode loop. Example::

    from fastgate.service import AnswerService, ServiceConfig

    service = AnswerService(ServiceConfig(method="dtr"))
    service.start()
    futures = [service.submit(q) for q in ["Who wrote Hamlet?", "What is the capital of Burkina Faso?"]]
    print([f.result(timeout=60)["answer"] for f in futures])
    service.stop()
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastgate.errors import FastgateError, InputError
from fastgate.methods.base import check_questions

__all__ = ["AnswerService", "OverloadedError", "ServiceConfig"]


class OverloadedError(FastgateError):
    """The request queue is full; retry after ``retry_after_s``."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"the server is busy ({depth} requests queued); retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ServiceConfig:
    """How the service batches, bounds and answers requests."""

    method: str = "dtr"  # default method of requests that name none (fastgate ask's default)
    model: str = "smollm2-135m"  # the default embedded model
    device: str = "auto"  # CUDA when available
    index: str | None = None  # index root; None: the default corpus
    paper_defaults: bool = False  # thresholds calibrated for the model unless asked otherwise
    max_batch: int = 32  # questions per decode loop; beyond this a CPU step gets slower than it gains
    max_wait_ms: float = 10.0  # how long the first request of a batch waits for company; bounds added latency
    regroup_wait_ms: float = 250.0  # after a batch of n (m queued), wait up to this for n + m: its clients come back
    regroup_share: float = 0.05  # ... but never longer than this share of that batch's run time
    max_queue: int = 256  # requests waiting beyond this are refused with 503 instead of timing out later
    timeout_s: float = 120.0  # a request not answered by then gets 504 (it is dropped if it has not started)
    max_question_chars: int = 4000  # longer questions are refused before tokenisation (also bounded by the context)
    max_tokens_limit: int = 256  # the most answer tokens a request may ask for
    max_int_param: int = 1024  # requests cannot set an integer parameter above this (k, samples, ...)
    methods_cached: int = 8  # built (method, parameters) pipelines kept; building one is cheap but not free
    params: tuple[tuple[str, Any], ...] = ()  # server-wide parameters of the default method (requests override)
    locked_params: tuple[str, ...] = ("checkpoint", "reranker_path")  # file paths: set by the operator, not clients

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "max_question_chars", "max_tokens_limit", "max_int_param",
                     "methods_cached"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1")
        if self.max_wait_ms < 0 or self.regroup_wait_ms < 0 or not 0 <= self.regroup_share <= 1:
            raise InputError("max_wait_ms and regroup_wait_ms must be >= 0, regroup_share in [0, 1]")
        if not self.timeout_s > 0:
            raise InputError("timeout_s must be > 0")


@dataclass
class _Job:
    question: str
    request: Any  # a validated fastgate.runtime.Request; jobs with equal requests share a batch
    future: Future


class AnswerService:
    """Thread-safe answering with dynamic batching (see the module docstring).

    Args:
        config: the service settings.
        runtime: an existing :class:`~fastgate.runtime.Runtime` (tests pass one with a tiny model); default: built
            from ``config``.
    """

    def __init__(self, config: ServiceConfig | None = None, runtime=None) -> None:
        from fastgate.runtime import Runtime

        self.config = config or ServiceConfig()
        self.runtime = runtime or Runtime(self.config.model, self.config.device, self.config.index,
                                          self.config.paper_defaults)
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=self.config.max_queue)
        self._methods: OrderedDict[tuple, Any] = OrderedDict()
        self._requests: dict[tuple, Any] = {}
        self._configs: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.metrics = _Metrics()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> AnswerService:
        """Load the model, build the default method (so the first request does not pay for it), start the worker."""
        if self._thread is not None:
            return self
        self._method(self._request(self.config.method, None))
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="fastgate-batcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True) -> None:
        """Stop the worker; with ``drain`` the queued requests are answered first, else they fail."""
        if self._thread is None:
            return
        if drain:
            while not self._queue.empty() and self._thread.is_alive():
                time.sleep(0.01)
        self._stop.set()
        self._thread.join()
        self._thread = None
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(FastgateError("the service stopped before answering"))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def model_name(self) -> str:
        return self.runtime.model_name

    # ------------------------------------------------------------------ requests
    def _request(self, method: str | None, params: dict[str, Any] | None):
        """A validated request, memoised by (method, parameters): validation builds a config, checks checkpoints."""
        from fastgate.runtime import check_request

        name = self.config.method if method is None else method
        client = dict(params or {})
        locked = sorted(set(client) & set(self.config.locked_params))
        if locked:
            raise InputError(f"parameter {locked[0]} cannot be set per request; start the server with it")
        params = {**(dict(self.config.params) if name == self.config.method else {}), **client}
        for key, value in params.items():
            if not isinstance(key, str) or not isinstance(value, (bool, int, float, str)):
                raise InputError(f"parameter {key!r} must be a number, string or boolean")
            if isinstance(value, float) and not math.isfinite(value):
                raise InputError(f"parameter {key} must be finite")
            if isinstance(value, str) and len(value) > 200:
                raise InputError(f"parameter {key} is too long")
        def validated():
            req = check_request(name, params, None, self.runtime.model)
            _check_int_params(req, self.config.max_int_param)
            return req

        cache_key = (name, tuple(sorted((k, type(v).__name__, repr(v)) for k, v in params.items())))
        return self._memo(self._requests, cache_key, validated)

    def _memo(self, store: dict, key, make):
        """``store[key]``, computed by ``make()`` on a miss (outside the lock); at most 256 entries, oldest out."""
        with self._lock:
            value = store.get(key)
        if value is None:
            value = make()
            with self._lock:
                store[key] = value
                if len(store) > 256:
                    store.pop(next(iter(store)))
        return value

    def _config(self, req):
        """The typed config of a request (calibrated thresholds applied), memoised."""
        from fastgate.methods import make_config

        return self._memo(self._configs, req, lambda: make_config(req.method, self.runtime.effective_params(req)))

    def _method(self, req):
        """The built method of a request; only the worker thread (and :meth:`start`) build methods."""
        key = (req.method, req.retriever, req.params)
        with self._lock:
            method = self._methods.get(key)
            if method is not None:
                self._methods.move_to_end(key)
                return method
        method = self.runtime.build(req)
        with self._lock:
            self._methods[key] = method
            while len(self._methods) > self.config.methods_cached:
                self._methods.popitem(last=False)
        return method

    def submit(self, question: str, method: str | None = None, params: dict[str, Any] | None = None,
               max_tokens: int | None = None) -> Future:
        """Queue a question; the future resolves to the ``fastgate ask --json`` record of its answer.

        Raises:
            InputError: an invalid question, method or parameter (nothing is queued).
            OverloadedError: the queue is full.
        """
        if not isinstance(question, str):
            raise InputError(f"question must be a string, got {type(question).__name__}")
        if len(question) > self.config.max_question_chars:
            raise InputError(f"the question is too long ({len(question)} characters; this server takes at most "
                             f"{self.config.max_question_chars})")
        if "\x00" in question:
            raise InputError("the question contains a NUL character")
        params = dict(params or {})
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
                raise InputError("max_tokens must be an integer")
            if not 1 <= max_tokens <= self.config.max_tokens_limit:
                raise InputError(f"max_tokens must be between 1 and {self.config.max_tokens_limit}")
            params["max_answer_tokens"] = max_tokens
        req = self._request(method, params)
        # checked with the tokenizer only: building a method or running the model here would race the worker's decode
        question = check_questions(self.runtime.engine, self._config(req), [question])[0]
        if not self.running:
            raise FastgateError("the service is not running")
        future: Future = Future()
        job = _Job(question, req, future)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.metrics.rejected()
            raise OverloadedError(self._queue.qsize(), retry_after_s=self._retry_after()) from None
        return future

    def _retry_after(self) -> int:
        """Seconds until the queue has room, from the recent per-question service time."""
        per_q = self.metrics.recent_seconds_per_question()
        return max(1, math.ceil(per_q * self._queue.qsize() / 2))

    # ------------------------------------------------------------------ the worker
    def _loop(self) -> None:
        expected, last_s, ended = 1, 0.0, 0.0
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                if time.perf_counter() - ended > self.config.regroup_wait_ms / 1000:
                    expected = 1  # idle since: the last batch's clients are not coming straight back
                continue
            jobs = self._gather(first, expected, last_s)
            t0 = time.perf_counter()
            groups: OrderedDict[Any, list[_Job]] = OrderedDict()
            for job in jobs:
                if job.future.set_running_or_notify_cancel():  # a request that timed out while queued is dropped
                    groups.setdefault(job.request, []).append(job)
            for req, group in groups.items():
                self._run_group(req, group)
            # the clients just answered usually come straight back; those queued meanwhile are already here
            ended = time.perf_counter()
            expected, last_s = len(jobs) + self._queue.qsize(), ended - t0

    def _gather(self, first: _Job, expected: int, last_s: float) -> list[_Job]:
        """The next micro-batch: ``first`` plus what arrives within ``max_wait_ms``, or, until ``expected`` requests
        are in hand, within ``regroup_wait_ms`` (capped at ``regroup_share`` of the last run ``last_s``).

        ``expected`` is the last batch's size plus the requests queued while it ran. Clients that wait for their
        answer before asking again send their next request a few milliseconds after their batch ends; without
        waiting for them, the clients split into two groups whose batches alternate, each group idle during the
        other's run, and the split persists. Waiting for the last batch plus the backlog merges them into one batch.
        A lone client (expected = 1) never waits longer than ``max_wait_ms``."""
        c = self.config
        now = time.perf_counter()
        deadline = now + c.max_wait_ms / 1000
        regroup = now + max(c.max_wait_ms, min(c.regroup_wait_ms, c.regroup_share * last_s * 1000)) / 1000
        expected = min(expected, c.max_batch)
        jobs = [first]
        while len(jobs) < c.max_batch:
            remaining = (regroup if len(jobs) < expected else deadline) - time.perf_counter()
            try:
                jobs.append(self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _run_group(self, req, group: list[_Job]) -> None:
        from fastgate.runtime import result_record

        t0 = time.perf_counter()
        try:
            results = self._method(req).answer_batch([j.question for j in group])
        except Exception as exc:  # noqa: BLE001 - every accepted request gets an outcome, whatever failed
            for j in group:
                j.future.set_exception(exc)
            self.metrics.batch(len(group), time.perf_counter() - t0, retrieved=0, failed=True)
            return
        took = time.perf_counter() - t0
        retrieved = 0
        for j, r in zip(group, results):
            retrieved += bool(r.retrieved)
            j.future.set_result(result_record(r, self.model_name, req.retriever))
        self.metrics.batch(len(group), took, retrieved=retrieved)


def _check_int_params(req, limit: int) -> None:
    from fastgate.methods import make_config

    config = make_config(req.method, req.param_dict)
    for name, _ in req.params:
        value = getattr(config, name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise InputError(f"parameter {name}={value} is above this server's limit ({limit})")


class _Metrics:
    """Counters the worker updates; :mod:`fastgate.server` exports them in the Prometheus format."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches = 0
        self.batch_sizes: list[int] = []  # recent, for the histogram exporter to drain
        self.answered = 0
        self.retrieved = 0
        self.failed = 0
        self.rejected_total = 0
        self._recent: list[tuple[int, float]] = []  # (questions, seconds) of the last batches

    def batch(self, size: int, seconds: float, retrieved: int, failed: bool = False) -> None:
        with self._lock:
            self.batches += 1
            self.batch_sizes.append(size)
            if failed:
                self.failed += size
            else:
                self.answered += size
                self.retrieved += retrieved
            self._recent = (self._recent + [(size, seconds)])[-20:]

    def rejected(self) -> None:
        with self._lock:
            self.rejected_total += 1

    def drain_batch_sizes(self) -> list[int]:
        with self._lock:
            out, self.batch_sizes = self.batch_sizes, []
            return out

    def recent_seconds_per_question(self) -> float:
        with self._lock:
            q = sum(n for n, _ in self._recent)
            s = sum(t for _, t in self._recent)
        return s / q if q else 1.0
