"""The embeddable answering service: a thread-safe ``submit() -> Future`` in front of one engine, on one
:class:`~fastgate.scheduler.Scheduler`, with a bounded queue and metrics. ``fastgate serve`` puts HTTP in front of it
(:mod:`fastgate.entrypoints.http`).

Every accepted request becomes its method's program for its question and joins the running scheduler at its next
tick; programs of every method and parameter set share the batched calls (generation, search, embedding, gate ops),
and a request's future resolves as soon as its own program ends: a question the gate answers closed-book does not
wait for the ones that retrieve. A request that times out, or whose client goes away, is cancelled: its program stops
at the next tick and consumes no more work. Example::

    from fastgate.serving.service import AnswerService, ServiceConfig

    service = AnswerService(ServiceConfig(method="dtr"))
    service.start()
    futures = [service.submit(q) for q in ["Who wrote Hamlet?", "What is the capital of Burkina Faso?"]]
    print([f.result(timeout=60)["answer"] for f in futures])
    service.stop()
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import queue
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastgate.errors import FastgateError, InputError, OutOfMemory, out_of_memory
from fastgate.methods.base import check_questions, check_text, method_class
from fastgate.scheduler.config import SchedulerConfig
from fastgate.serving.runtime import RuntimeConfig
from fastgate.settings import setting

__all__ = ["GENERATION_LENGTH_PARAMS", "LATENCY_BUCKETS_S", "WARMUP_QUESTION", "WARMUP_SECOND", "AnswerService",
           "OverloadedError", "ServiceConfig"]

_log = logging.getLogger("fastgate.serving")
# the methods' parameters that set how many tokens one generation may take: bounded as max_tokens is
GENERATION_LENGTH_PARAMS = ("max_answer_tokens", "answer_tokens", "step_tokens", "sentence_tokens", "pseudo_tokens",
                            "max_rationale_tokens")
WARMUP_QUESTION = "Who wrote Hamlet?"  # answered (and read) once at start: see AnswerService._warm_up
WARMUP_SECOND = "What is the capital of France?"  # beside it where decode steps are compiled (two rows' graph)
# the bounds of the exporter's latency histogram (fastgate.entrypoints.http.metrics takes them from here: this module
# must not import prometheus_client, an extra): the answers between two scrapes are kept folded by them
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class OverloadedError(FastgateError):
    """The request queue is full; retry after ``retry_after_s``."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"the server is busy ({depth} requests queued); retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


def _scheduler_setting(name: str, default: Any = dataclasses.MISSING) -> Any:
    """A field of :class:`SchedulerConfig`'s ``name``: its help line and choices, and its default unless ``default``
    is given (a serving default that differs from the library's)."""
    f = SchedulerConfig.__dataclass_fields__[name]
    return dataclasses.field(default=f.default if default is dataclasses.MISSING else default, metadata=f.metadata)


@dataclass(frozen=True)
class ServiceConfig(RuntimeConfig):
    """How the service batches, bounds and answers requests, and what its runtime loads (the fields of
    :class:`~fastgate.serving.runtime.RuntimeConfig`: model, device, dtype, step, weights, index, paper_defaults). The
    fields with a help line are ``fastgate serve``'s flags (:func:`fastgate.settings.add_setting_args`); those of the
    scheduler are checked by :class:`~fastgate.scheduler.SchedulerConfig` (:meth:`scheduler_config`)."""

    # the method of requests that name none: the gate `fastgate ask` uses by default
    method: str = setting("dtr", "default method of requests that name none (default: %(default)s)")
    # programs running at once; beyond this a CPU decode step gets slower than it gains
    max_live: int = setting(32, "requests whose programs run at once; more wait in the queue (default: %(default)s)")
    # the library scheduler's: sequences (prompts x samples) per engine call; bounds the KV cache
    max_rows: int = _scheduler_setting("max_rows")
    # not the library's 8: with a chunked prefill a generation joining at once is cheap, and it does not wait 8 steps
    admit_every: int = _scheduler_setting("admit_every", 1)
    # not the library's whole prompts: 512 prompt tokens a decode step keep cheap requests cheap under load; packed,
    # they ride in the decode rows' forward (no extra pass); 0: whole prompts at admission (docs/RESULTS.md)
    prefill_budget: int = _scheduler_setting("prefill_budget", 512)
    # the library scheduler's 0 (the whole budget) until measured otherwise (bench/bench_mixed.py)
    decoding_prefill_budget: int = _scheduler_setting("decoding_prefill_budget")
    # not the library's 0: a cheap request's short prompt does not queue behind older requests' long ones (16
    # closed-loop clients 2.05-2.25 -> 2.26-2.33 req/s; a burst's skip p50 0.40-0.48 s against 0.48, within this VM's
    # noise; docs/RESULTS.md)
    express_prefill: int = _scheduler_setting("express_prefill", 64)
    # not the library's 0: a cheap question arriving while up to 8 programs run is answered inside the reading prompts'
    # pass instead of after it (docs/RESULTS.md); beyond 8, packing it into the next pass costs less
    interject: int = _scheduler_setting("interject", 8)
    # a server is ready when its first request costs what later ones do (the one-time work of a model's first passes
    # made qwen2.5-0.5b's first answer 4.3 s instead of 0.17 s on a 2-core CPU)
    no_warmup: bool = setting(False, "serve at once, without answering a warm-up question with the default method and "
                                     "reading one through its retriever first (the first requests then pay for the "
                                     "model's one-time work: seconds on a CPU)")
    # KV cache of the decode loop (the library's is unbounded); generations wait beyond it (SmolLM2: ~45 KiB/token)
    kv_budget_mb: float = setting(2048.0, "KV cache of the decode loop in MiB; generations wait for room beyond it, "
                                          "one that cannot fit alone gets 422 (default: %(default)s)")
    # the library scheduler's: packed (decode rows + prompt chunks in one forward) where the model allows it
    layout: str = _scheduler_setting("layout")
    # the library scheduler's: the oldest request's prompts first, so a RAG prompt after its gate does not queue
    # behind newer requests (closed-loop p95, docs/RESULTS.md)
    prefill_order: str = _scheduler_setting("prefill_order")
    # an idle scheduler waits this long after a request for others of the same burst
    admit_wait_ms: float = setting(10.0, "an idle server waits this long after a request for the rest of its burst "
                                         "(default: %(default)s)")
    # requests waiting beyond this are refused with 503 instead of timing out later
    max_queue: int = setting(256, "queued requests before 503 (default: %(default)s)")
    # a request not answered by then gets 504 (it is dropped if it has not started)
    timeout_s: float = setting(120.0, "seconds before 504 (default: %(default)s)", flag="--timeout")
    max_question_chars: int = 4000  # longer questions are refused before tokenisation (also bounded by the context)
    max_tokens_limit: int = 256  # the most answer tokens a request may ask for
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 unread: a question is 4,000 characters at most
    max_int_param: int = 1024  # requests cannot set an integer parameter above this (k, samples, ...)
    methods_cached: int = 8  # built (method, parameters) pipelines kept; building one is cheap but not free
    params: tuple[tuple[str, Any], ...] = ()  # server-wide parameters of the default method (requests override)
    locked_params: tuple[str, ...] = ("checkpoint", "reranker_path")  # file paths: set by the operator, not clients
    remote: Any = None  # a fastgate.engine.remote.RemoteConfig: generate on that server instead of a local model

    def __post_init__(self) -> None:
        for name in ("max_live", "max_queue", "max_question_chars", "max_tokens_limit", "max_int_param",
                     "methods_cached", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1")
        if not self.kv_budget_mb > 0:
            raise InputError("kv_budget_mb must be > 0")
        self.scheduler_config()  # max_rows, admit_every, prefill_budget, layout and prefill_order: checked there
        if not self.timeout_s > 0:
            raise InputError("timeout_s must be > 0")
        if not 0 <= self.admit_wait_ms <= 1000:
            raise InputError(f"admit_wait_ms must be in [0, 1000], got {self.admit_wait_ms}")

    def scheduler_config(self) -> SchedulerConfig:
        """The settings of the service's scheduler."""
        return SchedulerConfig(max_rows=self.max_rows, admit_every=self.admit_every,
                               prefill_budget=self.prefill_budget,
                               decoding_prefill_budget=self.decoding_prefill_budget,
                               express_prefill=self.express_prefill, kv_budget=int(self.kv_budget_mb * 2**20),
                               layout=self.layout, prefill_order=self.prefill_order, interject=self.interject)


@dataclass
class _Queued:
    """A request waiting in the service's queue, then running as a scheduler task."""

    question: str
    request: Any  # a validated fastgate.serving.runtime.AnswerRequest, its method's config with it
    future: Future
    submitted: float
    task: Any = None  # its scheduler task once admitted
    listener: Any = None  # progress events of its program (fastgate.scheduler), for streaming
    program: Any = None  # a bare program (a plain completion) instead of a method's: its result is the future's
    answer_tokens: bool = False  # add the answer generation's tokens and log-probs to the record (``_answer_tokens``)
    max_tokens: int | None = None  # the client's bound on the answer (max_tokens), for answers no one generation made


def cut_to_tokens(count_tokens, text: str, limit: int) -> str | None:
    """The longest prefix of ``text`` (cut at a character, trailing space dropped) that ``count_tokens`` puts at most
    ``limit`` tokens in, or None when ``text`` is within it already (one count). A binary search over prefixes:
    ~log2(len) counts, and only for an answer over its bound."""
    if count_tokens(text) <= limit:
        return None
    lo, hi = 0, len(text)  # count(text[:lo]) <= limit < count(text[:hi])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(text[:mid]) <= limit:
            lo = mid
        else:
            hi = mid
    return text[:lo].rstrip()


def _rows_at_once(req) -> int:
    """Sequences the request's method decodes at once with its parameters (1 without a config)."""
    return method_class(req.method).rows_at_once(req.config) if req.config is not None else 1


class AnswerService:
    """Thread-safe answering on one scheduler (see the module docstring).

    Args:
        config: the service settings.
        runtime: an existing :class:`~fastgate.serving.runtime.Runtime` (tests pass one with a tiny model); default:
        built
            from ``config``.
    """

    def __init__(self, config: ServiceConfig | None = None, runtime=None) -> None:
        from fastgate.serving.runtime import Runtime

        self.config = config or ServiceConfig()
        self.runtime = runtime or Runtime(self.config.model, self.config.device, self.config.index,
                                          self.config.paper_defaults, dtype=self.config.dtype,
                                          step=self.config.step, remote=self.config.remote,
                                          weights=self.config.weights)
        self._queue: queue.Queue[_Queued] = queue.Queue(maxsize=self.config.max_queue)
        self._methods: OrderedDict[tuple, Any] = OrderedDict()
        self._requests: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self._scheduler = None  # built with the engine, in start()
        self._running: dict[int, _Queued] = {}  # id(task) -> job, for timeouts and cancellation
        self._cancel: list[Future] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # submit's "running?" and its put, and stop's closing, under one lock: a request checked as accepted just
        # before stop() drained the queue was put into a queue nobody read (its future never resolved)
        self._accepting = threading.Lock()
        self._closing = False
        self.metrics = _Metrics()
        self.warmup_s: float | None = None  # how long start()'s warm-up took (None: none ran, or it failed)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> AnswerService:
        """Load the model, build the default method (so the first request does not pay for it), start the worker."""
        if self._thread is not None:
            return self
        from fastgate.scheduler import Scheduler

        self._method(self._request(self.config.method, None))
        if not self.config.no_warmup and self.runtime.remote is None:
            self._warm_up(Scheduler)
        self._scheduler = self._new_scheduler(Scheduler)
        self._stop.clear()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="fastgate-scheduler", daemon=True)
        self._thread.start()
        return self

    def _warm_up(self, scheduler_cls) -> None:
        """Answer :data:`WARMUP_QUESTION` with the default method (where decode steps are compiled, also beside
        :data:`WARMUP_SECOND`: the step's graph for several rows) and read it through the default method's retriever
        (``always``; not for a method that never retrieves), on a scheduler of the service's settings dropped after,
        so that the first request does not pay for the one-time work of the model's first passes: oneDNN's reordered
        weights, the quantized kernels' tiles, the few-shot block's cached prefix, each prompt chunk's first product,
        the indexes' first reads. That work changes no result (the same bits as without it: tests/test_server.py),
        and these answers count in no metric. A failure is said and serving starts anyway (the requests then say
        their own errors)."""
        from fastgate.serving.runtime import check_request

        start = time.perf_counter()
        try:
            default = self._request(self.config.method, None)
            # a scheduler of the service's settings, without the service's queue (``feed``): nothing else runs
            sched = scheduler_cls(self.runtime.engine, self.config.scheduler_config())
            sched.answer(self._method(default), [WARMUP_QUESTION])
            if self.step_name == "compiled" and 2 * _rows_at_once(default) <= self.config.max_rows:
                # two at once: the compiled step's graph for more than one row (batch 1's is a graph of its own) is
                # built here, not under the first requests that decode together (tens of seconds on a GPU)
                sched.answer(self._method(default), [WARMUP_QUESTION, WARMUP_SECOND])
            if default.retriever is not None:  # a method that never retrieves opens no index (nor builds one)
                reader = self._method(check_request("always", {}, default.retriever, self.runtime.model))  # kept
                sched.answer(reader, [WARMUP_QUESTION])
            self.runtime.engine.finish_warm_up()  # the products' probes for more rows than these passes had
        except Exception as exc:  # noqa: BLE001 - said, and the server starts: a request gets its own error
            _log.warning("fastgate: warning: the warm-up failed (%s: %s); serving without it", type(exc).__name__, exc)
            return
        self.warmup_s = time.perf_counter() - start

    def stop(self, drain: bool = True) -> None:
        """Stop the worker; with ``drain`` the queued requests are answered first, else they fail."""
        if self._thread is None:
            return
        with self._accepting:  # no request is accepted from here on; those already queued are answered or failed
            self._closing = True
        if drain:
            while (not self._queue.empty() or self._running) and self._thread.is_alive():
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
        for job in list(self._running.values()):
            if not job.future.done():
                job.future.set_exception(FastgateError("the service stopped before answering"))
        self._running.clear()
        # the programs that ran hold their KV rows in this scheduler, which nothing steps any more: dropped with it
        # (start() builds a new one; kv_used_bytes is 0 when stopped)
        self._scheduler = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def live_programs(self) -> int:
        """Requests whose programs are running."""
        return len(self._running)

    @property
    def kv_used_bytes(self) -> int:
        """Bytes the decode loop's KV cache holds now (0 when stopped)."""
        sched = self._scheduler
        return sched.kv_bytes if sched is not None else 0

    @property
    def layout(self) -> str:
        """The decode loop's layout the scheduler chose (``packed`` or ``padded``; the configured one when stopped)."""
        sched = self._scheduler
        return sched.layout if sched is not None else self.config.layout

    @property
    def scheduler(self):
        return self._scheduler

    @property
    def model_name(self) -> str:
        return self.runtime.model_name

    @property
    def step_name(self) -> str:
        """How decode steps run, ``compiled`` or ``eager`` (``auto`` resolved for the device), as ``/healthz`` says."""
        from fastgate.assets.models import resolve_device
        from fastgate.engine.static_step import compiled_by_default

        rt = self.runtime
        if rt.remote is not None:
            return "remote"  # the server's own steps
        if rt.loaded:
            return "compiled" if rt.engine.runner.compiled else "eager"
        if rt.step != "auto":
            return rt.step
        return "compiled" if compiled_by_default(resolve_device(rt.device)) else "eager"

    @property
    def device_name(self) -> str:
        """Where the model runs (``cpu``, ``cuda:0``; ``remote`` behind a remote engine), as ``/healthz`` says."""
        import torch

        from fastgate.assets.models import resolve_device

        rt = self.runtime
        if rt.remote is not None:
            return "remote"
        dev = rt.engine.runner.device if rt.loaded else resolve_device(rt.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return str(dev)

    @property
    def device_reserved_bytes(self) -> int | None:
        """Bytes torch's CUDA allocator holds on the model's device (the KV store, the compiled step's graphs and
        buffers, the weights: more than ``kv_used_bytes``); None off CUDA."""
        import torch

        name = self.device_name
        return torch.cuda.memory_reserved(torch.device(name)) if name.startswith("cuda") else None

    @property
    def weights_name(self) -> str | None:
        """How the linear weights are held (``float``, ``int8``, ``int4``, ``int4-dense``; None on a remote engine), as
        ``/healthz`` says."""
        return self.runtime.weights_name

    @property
    def dtype_name(self) -> str:
        """The weights' dtype (``float32``, ``bfloat16``), as ``/healthz`` reports it."""
        return self.runtime.dtype_name

    # ------------------------------------------------------------------ requests
    def _request(self, method: str | None, params: dict[str, Any] | None):
        """A validated request, memoised by (method, parameters): validation builds the method's config (calibrated
        for the model) and checks checkpoints."""
        from fastgate.serving.runtime import check_request

        name = self.config.method if method is None else method
        client = dict(params or {})
        locked = sorted(set(client) & set(self.config.locked_params))
        if locked:
            raise InputError(f"parameter {locked[0]} cannot be set per request; start the server with it")
        from fastgate.methods import METHODS, check_parameter_names

        if name in METHODS:  # said here, not by the library: its message lists the operator's parameters as valid
            check_parameter_names(name, client, self.config.locked_params, "valid per request")
        params = {**(dict(self.config.params) if name == self.config.method else {}), **client}
        for key, value in params.items():
            if not isinstance(key, str) or not isinstance(value, (bool, int, float, str)):
                raise InputError(f"parameter {key!r} must be a number, string or boolean")
            if isinstance(value, float) and not math.isfinite(value):
                # 1e400 parses as inf: refused as a number; the string "inf" is how a request asks for one
                raise InputError(f"parameter {key} must be a finite number (for an infinite one, send the string "
                                 "\"inf\" or \"-inf\")")
            if isinstance(value, str) and len(value) > 200:
                raise InputError(f"parameter {key} is too long")
        remote = self.runtime.engine_name if self.runtime.remote is not None else None

        def validated():  # the method's config is built here, once, and travels with the request
            req = check_request(name, params, None, self.runtime.model, remote=remote,
                                calibrate=functools.partial(self.runtime.calibrated, warn=False))  # said at build
            _check_int_params(req, self.config.max_int_param)
            rows = _rows_at_once(req) if remote is None else 1
            if rows > self.config.max_rows:  # the scheduler would refuse it only once it ran (a default method: every
                # request, after the warm-up's failure was logged)
                raise InputError(f"method {name} decodes {rows} sequences at once with these parameters, more than "
                                 f"max_rows={self.config.max_rows} (--max-rows)")
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

    def _method(self, req):
        """The built method of a request; only the worker thread (and :meth:`start`) build methods. Keyed by the
        typed config it builds, not the parameters as sent: ``{}`` and ``{"k": 3}`` are one method (a read gate's
        answerable-share estimate is its method's state: two keys split it in two)."""
        key = (req.method, req.retriever, req.config if req.config is not None else req.params)
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

    def submit_completion(self, prompt: str, config, seed: int | None = None, top_logprobs: int = 0) -> Future:
        """Queue a plain completion of ``prompt`` (a :class:`~fastgate.config.GenerationConfig`); the future resolves
        to a :class:`~fastgate.serving.completion.Completion` (the generation, its tokens' bytes, the top
        ``top_logprobs`` alternatives at each token). It shares the scheduler with the questions. Not on a remote
        engine.

        Raises:
            InputError: an empty or over-long prompt, or ``top_logprobs`` out of range (nothing is queued).
            OverloadedError: the queue is full.
        """
        from fastgate.serving.completion import MAX_TOP_LOGPROBS, completion_program

        engine = self.runtime.engine
        if engine.remote:
            raise InputError("plain completions are served by a local model, not through a remote engine")
        if not isinstance(prompt, str) or not prompt:
            raise InputError("the prompt must be a non-empty string")
        if "\x00" in prompt:
            raise InputError("the prompt contains a NUL character")
        check_text(prompt, "prompt")
        if len(prompt) > 8 * engine.lm.max_context:
            raise InputError(f"the prompt is too long ({len(prompt)} characters) for the {engine.lm.max_context}-"
                             "token context")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InputError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if config.max_new_tokens > self.config.max_tokens_limit:
            raise InputError(f"max_tokens must be between 1 and {self.config.max_tokens_limit}")
        future: Future = Future()
        self._enqueue(_Queued(prompt, None, future, time.perf_counter(),
                              program=completion_program(engine, prompt, config, seed, top_logprobs)))
        return future

    def submit(self, question: str, method: str | None = None, params: dict[str, Any] | None = None,
               max_tokens: int | None = None, listener: Callable[[dict], None] | None = None,
               answer_tokens: bool = False) -> Future:
        """Queue a question; the future resolves to the ``fastgate ask --json`` record of its answer.

        ``listener`` gets its program's progress events (gate decisions, searches, the answer's text as it is
        decoded; see :mod:`fastgate.scheduler`) on the worker thread: it must be quick and thread-safe.
        ``answer_tokens``: the record also holds ``_answer_tokens``, the bytes and log-probabilities of the tokens
        of the generation the answer was taken from (methods whose answer is one generation: never, always, ...),
        or None.

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
            given = params.get("max_answer_tokens")
            if given is not None and given != max_tokens:  # one of the two would be dropped without a word
                raise InputError(f"max_tokens ({max_tokens}) and the parameter max_answer_tokens ({given!r}) differ: "
                                 "give one")
            params["max_answer_tokens"] = max_tokens
        req = self._request(method, params)
        for name in GENERATION_LENGTH_PARAMS:  # max_tokens's bound, whichever way a generation's length is asked for
            value = getattr(req.config, name, None) if name in params else None  # typed: "300" is 300
            if isinstance(value, int) and not isinstance(value, bool) and value > self.config.max_tokens_limit:
                raise InputError(f"parameter {name}={value} is above this server's limit of "
                                 f"{self.config.max_tokens_limit} tokens a generation")
        # checked with the tokenizer only: building a method or running the model here would race the worker's decode
        question = check_questions(self.runtime.engine, req.config, [question])[0]
        future: Future = Future()
        self._enqueue(_Queued(question, req, future, time.perf_counter(), listener=listener,
                              answer_tokens=answer_tokens, max_tokens=max_tokens))
        return future

    def _enqueue(self, job: _Queued) -> None:
        """Put ``job`` on the queue, or count it rejected and raise :class:`OverloadedError` when the queue is full.

        Raises:
            FastgateError: the service is not running, or is stopping."""
        with self._accepting:
            if self._closing or not self.running:
                raise FastgateError("the service is stopping" if self.running else "the service is not running")
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self.metrics.rejected()
                raise OverloadedError(self._queue.qsize(), retry_after_s=self._retry_after()) from None

    def cancel(self, future: Future) -> None:
        """Give up on a submitted request (timed out, or its client went away): dropped if still queued (its place
        is free at once), else its program stops at the next tick. Thread-safe."""
        if future.cancelled():  # given up already (a second cancel would be True again, and counted twice)
            return
        if future.cancel():  # still queued: dropped, counted as a cancellation here (the worker never sees it run)
            self.metrics.finished(0.0, retrieved=False, failed=True, cancelled=True)
            self._unqueue(future)
        else:  # already running: the worker cancels its program
            with self._lock:
                self._cancel.append(future)

    def _unqueue(self, future: Future) -> None:
        """Take the job of the cancelled ``future`` out of the queue, unless the worker took it already (it then
        drops it). Left there, a given-up request held its place until the worker reached it, behind the running
        programs: a queue full of them refused new requests with 503, and a Retry-After that counted them."""
        q = self._queue
        with q.mutex:  # queue.Queue's own lock over its deque: put and get hold it too
            for i, job in enumerate(q.queue):
                if job.future is future:
                    del q.queue[i]
                    q.not_full.notify()  # as a get does: a put waiting for room (none here blocks) may go on
                    return

    def _retry_after(self) -> int:
        """Seconds until the queue has room, from the recent per-question service time."""
        per_q = self.metrics.recent_seconds_per_question()
        return max(1, math.ceil(per_q * self._queue.qsize() / 2))

    # ------------------------------------------------------------------ the worker
    def _loop(self) -> None:
        self.runtime.engine.bind_thread()  # this thread's current CUDA device: the model's (graphs, Triton kernels)
        sched = self._scheduler
        while not self._stop.is_set():
            self._admit(block=sched.idle)
            self._expire()
            if not sched.idle:
                try:
                    sched.step()
                except Exception as exc:  # noqa: BLE001 - a failure outside any one program: fail what is running
                    _log.error("fastgate: a scheduler tick failed (%s: %s): its %d running requests fail, a new "
                               "scheduler takes the next ones", type(exc).__name__, exc, len(self._running),
                               exc_info=exc)
                    with contextlib.suppress(AttributeError):  # the HTTP layer's 500s do not log it again, each
                        exc.fastgate_logged = True  # type: ignore[attr-defined]
                    if out_of_memory(exc):  # the clients get 503 and a reason, not a 500 "internal error"
                        exc = OutOfMemory(f"the server ran out of memory answering {len(self._running)} request(s) "
                                          f"at once ({type(exc).__name__}); retry, or ask the operator for a lower "
                                          "--max-live / --max-rows / --kv-budget-mb")
                    for job in list(self._running.values()):
                        if not job.future.done():
                            job.future.set_exception(exc)
                    self._running.clear()
                    self.metrics.ticks(sched)  # the decode steps the failed tick ran count, before its scheduler goes
                    self._scheduler = sched = self._new_scheduler(type(sched))
                self.metrics.ticks(sched)

    def _new_scheduler(self, cls):
        sched = cls(self.runtime.engine, self.config.scheduler_config())
        sched.feed = self._feed  # a pass that pauses takes in the requests queued since the tick began
        return sched

    def _feed(self) -> None:
        """Queued requests into the scheduler, and the cancellations and timeouts since the tick began, from inside a
        paused pass (``--interject``): a request answered in the pass's lane is cancelled there, not a tick later. Its
        step runs in inference mode, and a method built here (its gate's modules) must not be made of inference
        tensors."""
        import torch

        with torch.inference_mode(False):
            self._admit(block=False)
        self._expire()

    def _admit(self, block: bool) -> None:
        """Move queued requests into the scheduler (up to ``max_live`` running).

        When idle, wait for a request, then up to ``admit_wait_ms`` for the rest of its burst: requests sent together
        reach the server over a few milliseconds, and those that miss the first tick would wait for its whole engine
        call (a lone request pays the window once)."""
        window_end = None
        while len(self._running) < self.config.max_live:
            try:
                if block:
                    job = self._queue.get(timeout=0.05)
                elif window_end is not None and (left := window_end - time.perf_counter()) > 0:
                    job = self._queue.get(timeout=left)
                else:
                    job = self._queue.get_nowait()
            except queue.Empty:
                return
            if block:
                block = False
                window_end = time.perf_counter() + self.config.admit_wait_ms / 1000
            if not job.future.set_running_or_notify_cancel():  # cancelled while queued (counted then): dropped
                continue
            if job.program is not None:  # a plain completion
                job.task = self._scheduler.submit(None, "", on_done=self._done, program=job.program)
                self._running[id(job.task)] = job
                continue
            try:
                method = self._method(job.request)
            except Exception as exc:  # noqa: BLE001 - e.g. a checkpoint that fails to load
                job.future.set_exception(exc)
                self.metrics.finished(time.perf_counter() - job.submitted, retrieved=False, failed=True)  # counted
                continue
            job.task = self._scheduler.submit(method, job.question, on_done=self._done, listener=job.listener)
            self._running[id(job.task)] = job

    def _expire(self) -> None:
        """Cancel the programs of requests past their timeout or given up by their clients."""
        with self._lock:
            cancel, self._cancel = self._cancel, []
        gone = {id(f) for f in cancel}
        deadline = time.perf_counter() - self.config.timeout_s
        for job in self._running.values():
            if id(job.future) in gone or job.submitted < deadline:
                self._scheduler.cancel(job.task)

    def _done(self, task) -> None:
        """A program ended: resolve its future now (the others keep running)."""
        job = self._running.pop(id(task), None)
        if job is None or job.future.done():
            return
        try:
            self._resolve(job, task)
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be made a record: the client gets it
            if not job.future.done():  # (popped from the running jobs: no later failure would resolve it)
                job.future.set_exception(exc)
                self.metrics.finished(time.perf_counter() - job.submitted, retrieved=False, failed=True)

    def _resolve(self, job, task) -> None:
        """Resolve ``job``'s future with its ended program's result or error."""
        from fastgate.serving.runtime import result_record

        latency = time.perf_counter() - job.submitted
        if task.error is not None:
            job.future.set_exception(task.error)
            self.metrics.finished(latency, retrieved=False, failed=True, cancelled=task.cancelled)
            return
        if job.program is not None:
            job.future.set_result(task.result)
            self.metrics.finished(latency, retrieved=False)
            return
        record = result_record(task.result, self.model_name, job.request.retriever, engine=self.runtime.engine_name,
                               dtype=self.runtime.dtype_name, weights=self.runtime.weights_name)
        if job.max_tokens is not None and task.trace.answer is None and self.runtime.remote is None:
            # max_tokens bounds the answer's own generation (counting its text again would not: a U+FFFD of a split
            # character is several tokens); flare, scaar, probing and a reading seakr have none and take theirs out of
            # a chain of thought, which it does not bound: cut there, as a generation at its limit stops
            # (a remote engine counts bytes / 4: not cut there; a BOS the tokenizer adds is not the answer's)
            count, bos = self.runtime.engine.count_tokens, self.runtime.engine.count_tokens("")
            cut = cut_to_tokens(lambda t: count(t) - bos, record["answer"], job.max_tokens)
            if cut is not None:
                record["answer"], record["finish_reason"] = cut, "length"
        if job.answer_tokens:
            seq = task.trace.answer
            record["_answer_tokens"] = None if seq is None else (
                self.runtime.engine.token_pieces(seq.token_ids[:seq.answer_tokens]),
                list(seq.token_logprobs[:seq.answer_tokens]))
        job.future.set_result(record)
        self.metrics.finished(latency, retrieved=bool(task.result.retrieved),
                              searches=int(task.result.retrieval_calls))


def _check_int_params(req, limit: int) -> None:
    """Refuse an integer parameter the client set above ``limit`` (its value in the request's config: the user's)."""
    for name, _ in req.params:
        value = getattr(req.config, name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise InputError(f"parameter {name}={value} is above this server's limit ({limit})")


class _Metrics:
    """Counters the worker updates; :mod:`fastgate.entrypoints.http` exports them in the Prometheus format.

    What the exporter's histograms observe (rows per decode step, latencies) is kept from one scrape to the next
    folded, in a size that does not grow with the steps and answers: a server nobody scraped kept an entry per decode
    step and per answer (see :meth:`drain`). The totals only grow, across the new scheduler a failed tick leaves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.answered = 0
        self.retrieved = 0  # answered questions that read retrieved passages into a prompt
        self.searches = 0  # retrieval calls (the read gate searches every question and reads some)
        self.failed = 0
        self.cancelled = 0
        self.rejected_total = 0
        self.ticks_total = 0
        self.generation_calls = 0
        self.shared_generation_calls = 0  # decode steps with rows of several methods
        # decode steps by their sequences (a few distinct counts, up to max_rows) since the last drain
        self.generation_rows: Counter[int] = Counter()
        # answers since the last drain by (retrieved, latency bucket): [answers, seconds in all, least, most]
        self.latencies: dict[tuple[bool, int], list[float]] = {}
        self._recent: list[float] = []  # latencies of the last answers
        # the scheduler read last, and its generation calls and ticks counted so far
        self._scheduler_ref: Callable[[], Any] = lambda: None  # a weak reference to it (not kept alive here)
        self._seen, self._ticks_seen = 0, 0

    def finished(self, seconds: float, retrieved: bool, failed: bool = False, cancelled: bool = False,
                 searches: int = 0) -> None:
        with self._lock:
            if failed:
                self.failed += 1
                self.cancelled += bool(cancelled)
                return
            self.answered += 1
            self.retrieved += bool(retrieved)
            self.searches += int(searches)
            key = (bool(retrieved), bisect.bisect_left(LATENCY_BUCKETS_S, seconds))  # the first bound >= seconds: "le"
            fold = self.latencies.get(key)
            if fold is None:
                self.latencies[key] = [1, seconds, seconds, seconds]
            else:
                fold[0] += 1
                fold[1] += seconds
                fold[2], fold[3] = min(fold[2], seconds), max(fold[3], seconds)
            self._recent = (self._recent + [seconds])[-50:]

    def ticks(self, scheduler) -> None:
        """Take the scheduler's new ticks and generation calls (rows per call, methods sharing them)."""
        with self._lock:
            # a new scheduler (after a failure, or a stop and a start) counts from zero: its counts add to the old
            # one's (taken ticks_total as it was, the exported total went back: 165 -> 5). Compared by a weak
            # reference, not id(): a stopped scheduler's address may be reused by the next one
            if self._scheduler_ref() is not scheduler:
                try:
                    ref = weakref.ref(scheduler)
                except TypeError:  # an object without weak references (a test's stand-in): held
                    ref = functools.partial(lambda s: s, scheduler)
                self._scheduler_ref, self._seen, self._ticks_seen = ref, 0, 0
            self.ticks_total += scheduler.ticks - self._ticks_seen
            self._ticks_seen = scheduler.ticks
            new = scheduler.generation_calls - self._seen
            if new > 0:
                rows = scheduler.generation_rows[-new:]
                self.generation_rows.update(rows)
                self.shared_generation_calls += sum(len(m) > 1 for m in scheduler.generation_methods[-new:])
                self.generation_calls += new
                self._seen = scheduler.generation_calls

    def rejected(self) -> None:
        with self._lock:
            self.rejected_total += 1

    def drain(self) -> tuple[Iterator[int], Iterator[tuple[bool, float]]]:
        """Rows per generation call and (retrieved, seconds) per answered request since the last drain, one by one
        for the exporter's histograms to observe. The rows are their own; the answers of one latency bucket come as
        their mean latency (kept within their least and most: the float mean may round past a bound they sit on):
        each histogram's bucket counts, count and sum are those of the answers themselves."""
        with self._lock:
            rows, self.generation_rows = self.generation_rows, Counter()
            lat, self.latencies = self.latencies, {}
        rows_out = itertools.chain.from_iterable(itertools.repeat(n, count) for n, count in sorted(rows.items()))
        lat_out = itertools.chain.from_iterable(
            itertools.repeat((retrieved, min(max(total / count, least), most)), int(count))
            for (retrieved, _), (count, total, least, most) in sorted(lat.items()))
        return rows_out, lat_out

    def recent_seconds_per_question(self) -> float:
        """Mean latency of the last answers (over the programs that ran concurrently: an estimate)."""
        with self._lock:
            return sum(self._recent) / len(self._recent) if self._recent else 1.0
