"""Serving: the embeddable service (one scheduler, overload, timeouts, cancellation) and the HTTP server on loopback
(tiny model)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import httpx  # noqa: E402

from fastgate.errors import FastgateError, InputError  # noqa: E402
from fastgate.serving.runtime import Runtime  # noqa: E402
from fastgate.serving.service import AnswerService, OverloadedError, ServiceConfig  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "capital of Kyrgyzstan", "largest planet",
             "When was the Eiffel Tower completed?", "capital of Germany"]


def _service(tiny_engine, small_index, **kw) -> AnswerService:
    runtime = Runtime("tiny", index=str(small_index), engine=tiny_engine)
    cfg = ServiceConfig(method="dtr", params=(("tau", 0.0),), index=str(small_index), **kw)
    return AnswerService(cfg, runtime)


@pytest.fixture(scope="module")
def service(tiny_engine, small_index):
    svc = _service(tiny_engine, small_index).start()
    yield svc
    svc.stop()


def test_submit_batches_concurrent_requests_and_matches_answer_batch(service):
    futures = [service.submit(q) for q in QUESTIONS]
    records = [f.result(timeout=60) for f in futures]
    direct = service._method(service._request(None, None)).answer_batch(QUESTIONS)
    assert [r["answer"] for r in records] == [d.answer for d in direct]
    assert all(r["retrieved"] and r["model"] == "tiny" and r["retriever"] == "dense" for r in records)
    assert max(service.scheduler.generation_rows) > 1  # concurrent requests shared engine calls


@pytest.mark.parametrize("method", ["flare", "scaar"])
def test_max_tokens_bounds_an_answer_taken_out_of_a_chain_of_thought(service, method):
    """flare and scaar answer from sentences their max_answer_tokens does not bound: max_tokens did nothing (536
    tokens for max_tokens=1); the answer is now cut to it, finish_reason "length", as a generation at its limit."""
    engine = service.runtime.engine
    free = service.submit(QUESTIONS[0], method).result(timeout=60)
    assert engine.count_tokens(free["answer"]) > 3  # the tiny random model rambles
    record = service.submit(QUESTIONS[0], method, max_tokens=3).result(timeout=60)
    assert 0 < engine.count_tokens(record["answer"]) <= 3 and record["finish_reason"] == "length"
    assert free["answer"].startswith(record["answer"])


def test_a_kept_closed_book_answer_cut_at_max_tokens_finishes_with_length(service):
    """dtr's skip path returns its closed-book generation, which was not asked for as the answer (the gate decides
    after it): its finish reason was "stop" at the token limit where never's was "length", and its answer tokens were
    none (no logprobs). Now the kept generation is the answer's."""
    never = service.submit(QUESTIONS[1], "never", max_tokens=3).result(timeout=60)
    skip = service.submit(QUESTIONS[1], "dtr", params={"tau": "inf"}, max_tokens=3).result(timeout=60)
    assert not skip["retrieved"] and skip["answer"] == never["answer"]
    assert never["finish_reason"] == skip["finish_reason"] == "length"  # the tiny random model rambles
    job = service.submit(QUESTIONS[1], "dtr", params={"tau": "inf"}, max_tokens=3, answer_tokens=True)
    pieces, logprobs = job.result(timeout=60)["_answer_tokens"]
    assert len(pieces) == len(logprobs) == 3


def test_cut_to_tokens():
    from fastgate.serving.service import cut_to_tokens

    words = lambda t: len(t.split())  # noqa: E731 - a tokenizer of whitespace-separated words
    assert cut_to_tokens(words, "a bb ccc", 3) is None
    assert cut_to_tokens(words, "a bb ccc dddd", 2) == "a bb"
    assert cut_to_tokens(words, "a bb ccc", 0) == ""


def test_submit_rejects_bad_input_without_queueing(service):
    depth = service.queue_depth
    for kwargs, message in [
        ({"question": "   "}, "empty"),
        ({"question": "x" * 5000}, "too long"),
        ({"question": 42}, "must be a string"),
        ({"question": "ok?", "method": "magic"}, "unknown method"),
        ({"question": "ok?", "params": {"k": 2.5}}, "expects int"),
        ({"question": "ok?", "params": {"k": 10**6}}, "limit"),
        ({"question": "ok?", "params": {"checkpoint": "/etc"}, "method": "probing"}, "cannot be set per request"),
        ({"question": "ok?", "max_tokens": 0}, "max_tokens"),
        ({"question": "ok?", "params": {"tau": float("inf")}}, 'send the string "inf"'),  # JSON's 1e400
    ]:
        with pytest.raises(InputError, match=message):
            service.submit(**kwargs)
    assert service.queue_depth == depth
    with pytest.raises(InputError, match=r"unknown parameter\(s\) for probing: bogus; valid per request") as err:
        service.submit("ok?", "probing", {"bogus": 1})
    assert "checkpoint" not in str(err.value) and "max_iterations" in str(err.value)  # the operator's are not listed


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory, tiny):
    from fastgate.gates.checkpoints import random_probe_params, save_probe_checkpoint

    root = tmp_path_factory.mktemp("svc-ckpt")
    conf = save_probe_checkpoint(root / "conf", random_probe_params(1, tiny.hidden_size, 16, seed=2),
                                 kind="confidence", model=tiny, layers=(2,))
    return {"cbdr": {"checkpoint": str(conf), "beta": 0.81, "n_candidates": 4}}


def test_mixed_methods_share_generation_calls_and_answer_as_alone(tiny_engine, small_index, tiny_checkpoints):
    svc = _service(tiny_engine, small_index, locked_params=()).start()
    try:
        kinds = [("dtr", {"tau": 0.95, "pseudo_tokens": 12}), ("cbdr", tiny_checkpoints["cbdr"]),
                 ("seakr", {"samples": 3, "step_tokens": 6, "max_steps": 2, "n_candidates": 2, "answer_tokens": 8,
                            "max_answer_tokens": 6, "delta": -0.9})]
        jobs = [(m, p, q) for q in QUESTIONS[:4] for m, p in kinds]
        futures = [svc.submit(q, m, p) for m, p, q in jobs]
        records = [f.result(timeout=300) for f in futures]
        assert svc.metrics.shared_generation_calls >= 1  # rows of several methods in one engine call
        for (m, p, q), rec in zip(jobs, records):
            alone = svc._method(svc._request(m, p)).answer(q)  # what `fastgate ask` answers
            assert (rec["answer"], rec["retrieved"], [s["retrieve"] for s in rec["gate_steps"]]) == (
                alone.answer, alone.retrieved, [s.retrieve for s in alone.gate_steps]), (m, q)
            assert [h["id"] for h in rec["passages"]] == [h.id for h in alone.passages]
    finally:
        svc.stop()


def _quantized_engine():
    """A fresh bf16 tiny model with int4-dense weights (the server's CPU form: oneDNN's reordered copies and the C++
    kernels' tiles are made at its first passes), its own engine."""
    import torch

    from fastgate.assets.quant import quantize_model
    from fastgate.engine.local import Engine
    from fastgate.testing import tiny_model

    lm = tiny_model(n_layers=2, hidden=128, dtype=torch.bfloat16)
    quantize_model(lm.model, "int4-dense")
    return Engine(lm)


def _adopted(engine) -> int:
    """How many quantized layers' kept copies a product holds (oneDNN's reordered weight, fastgate.ops.dense)."""
    return sum(getattr(m, "_kept_product", None) is not None for m in engine.lm.model.modules())


def test_start_warms_up_off_the_books_and_answers_as_a_cold_start(small_index):
    """The warm-up answers a question and reads one on a scheduler of its own: the service's scheduler and metrics
    see none of it, and every later answer is the one a server without it gives, bit for bit."""
    def records(svc):
        out = []
        for method in ("dtr", "always"):
            for r in [svc.submit(q, method).result(timeout=120) for q in QUESTIONS[:4]]:
                out.append({k: v for k, v in r.items() if k not in ("timings", "latency_s")})
        return out

    services, held = [], []
    try:
        for no_warmup in (True, False):
            runtime = Runtime("tiny", index=str(small_index), engine=_quantized_engine())
            cfg = ServiceConfig(method="dtr", params=(("tau", 1e9),), index=str(small_index), no_warmup=no_warmup)
            services.append(svc := AnswerService(cfg, runtime).start())
            assert (svc.warmup_s is None) is no_warmup
            held.append(_adopted(runtime.engine))
            assert svc.metrics.answered == 0 and svc.scheduler.generation_calls == 0 and svc.scheduler.ticks == 0
        cold, warm = (records(svc) for svc in services)
        assert warm == cold
        assert [r["retrieved"] for r in cold] == [False] * 4 + [True] * 4  # dtr closed-book, always reads
        assert services[1].metrics.answered == 8
        # where this CPU hands the kept copies to oneDNN, the warm-up did it before the first request
        assert held[0] == 0 and held[1] == _adopted(services[0].runtime.engine)
    finally:
        for svc in services:
            svc.stop()


def test_a_compiled_step_s_warm_up_builds_its_graph_for_several_rows(small_index):
    """Where decode steps are compiled, the warm-up also answers two questions at once: the step's graph for more
    than one row (batch 1's is its own) is built before the server listens, not under the first requests that
    decode together (tens of seconds on a GPU); an eager server's warm-up stays one question."""
    from fastgate.engine.local import Engine
    from fastgate.engine.static_step import StepConfig
    from fastgate.testing import tiny_model

    engine = Engine(tiny_model(), step=StepConfig("compiled", backend="eager"))
    svc = AnswerService(ServiceConfig(method="dtr", params=(("tau", 1e9),), index=str(small_index)),
                        Runtime("tiny", index=str(small_index), engine=engine)).start()
    try:
        assert svc.step_name == "compiled" and svc.warmup_s is not None
        rows = {b for step in engine.runner._static.values() for b, _ in step.buckets}
        assert 1 in rows and max(rows) >= 2, rows
        assert svc.submit(QUESTIONS[0]).result(timeout=60)["answer"] is not None
    finally:
        svc.stop()


def test_the_scheduler_thread_binds_the_engine_s_device(tiny_engine, small_index, monkeypatch):
    """torch's current CUDA device is per thread: the server's scheduler thread makes the engine's its own before it
    steps (on cuda:1 its graphs and Triton kernels went to device 0); the engine's thread did when it was built."""
    import threading

    bound = []
    monkeypatch.setattr(type(tiny_engine), "bind_thread", lambda self: bound.append(threading.current_thread().name))
    svc = _service(tiny_engine, small_index, no_warmup=True).start()
    try:
        assert svc.submit(QUESTIONS[0]).result(timeout=30)["answer"] is not None
        assert bound == ["fastgate-scheduler"]
    finally:
        svc.stop()


def test_a_server_whose_method_never_retrieves_warms_up_without_an_index(tiny_engine, tmp_path, caplog):
    """No index opened (nor the default corpus's built) for a method that never reads."""
    runtime = Runtime("tiny", index=str(tmp_path / "no-index-here"), engine=tiny_engine)
    with caplog.at_level("WARNING", logger="fastgate.serving"):
        svc = AnswerService(ServiceConfig(method="never", index=str(tmp_path / "no-index-here")), runtime).start()
    try:
        assert svc.warmup_s is not None and "warm-up failed" not in caplog.text and not runtime._retrievers
    finally:
        svc.stop()


def test_a_failed_warm_up_is_said_and_the_server_serves(tiny_engine, small_index, monkeypatch, caplog):
    from fastgate.scheduler import Scheduler

    def broken(self, method, questions):
        raise RuntimeError("no room")

    monkeypatch.setattr(Scheduler, "answer", broken)
    with caplog.at_level("WARNING", logger="fastgate.serving"):
        svc = _service(tiny_engine, small_index).start()
    try:
        assert svc.warmup_s is None
        assert "the warm-up failed (RuntimeError: no room); serving without it" in caplog.text
        assert svc.submit("Who wrote Hamlet?", "never").result(timeout=60)["answer"] is not None
    finally:
        svc.stop()


def test_a_closed_book_answer_does_not_wait_for_the_retrieving_ones(tiny_engine, small_index):
    svc = _service(tiny_engine, small_index).start()
    try:
        slow = [svc.submit(q, "seakr", {"samples": 3, "step_tokens": 6, "max_steps": 3, "delta": -1e9})
                for q in QUESTIONS]
        fast = svc.submit("Who wrote Hamlet?", "never")
        fast.result(timeout=120)
        assert not all(f.done() for f in slow)  # answered while the others still run
        [f.result(timeout=300) for f in slow]
    finally:
        svc.stop()


@pytest.mark.parametrize("wait_ms", [0.0, 200.0])
def test_a_burst_arriving_over_milliseconds_starts_in_one_engine_call(tiny_engine, small_index, wait_ms):
    svc = _service(tiny_engine, small_index, admit_wait_ms=wait_ms).start()
    try:
        futures = []
        for q in QUESTIONS[:3]:
            futures.append(svc.submit(q, "never"))
            time.sleep(0.02)  # a burst over HTTP reaches the server spread out like this
        [f.result(timeout=60) for f in futures]
        rows = svc.scheduler.generation_rows  # rows of each decode step
        assert rows[0] == (3 if wait_ms else 1)  # without the window the first request starts alone
    finally:
        svc.stop()


def test_timeout_cancels_the_program(tiny_engine, small_index):
    from fastgate.scheduler import CancelledError

    svc = _service(tiny_engine, small_index, timeout_s=0.5).start()
    try:
        # ~650 decode steps of 16 rows: seconds on any CPU, far past the timeout (8 samples of 4 x 32 tokens, the
        # earlier load, finished within 0.5 s on a fast 2-core EPYC and the test then failed)
        f = svc.submit("capital of Kyrgyzstan", "seakr", {"samples": 16, "step_tokens": 64, "max_steps": 8,
                                                          "delta": -1e9, "answer_tokens": 128})
        with pytest.raises(CancelledError):
            f.result(timeout=60)
        deadline = time.time() + 30
        while svc.live_programs and time.time() < deadline:
            time.sleep(0.05)
        assert svc.live_programs == 0 and svc.scheduler.idle and svc.metrics.cancelled == 1
        assert svc.submit("Who wrote Hamlet?", "never").result(timeout=60)["answer"] is not None  # still serving
    finally:
        svc.stop()


def test_a_result_that_fails_to_become_a_record_fails_its_request_only(tiny_engine, small_index, monkeypatch):
    """Building a finished request's record raises: that request fails with the error (its client is not left
    waiting for the timeout), the others in the same ticks are answered, and the service goes on."""
    import fastgate.serving.runtime as runtime_module

    real = runtime_module.result_record

    def record(result, *args, **kwargs):
        if result.question == QUESTIONS[1]:
            raise ValueError("cannot make a record of this")
        return real(result, *args, **kwargs)

    monkeypatch.setattr(runtime_module, "result_record", record)
    svc = _service(tiny_engine, small_index).start()
    try:
        futures = [svc.submit(q) for q in QUESTIONS[:3]]
        with pytest.raises(ValueError, match="cannot make a record"):
            futures[1].result(timeout=60)
        assert [f.result(timeout=60)["question"] for f in (futures[0], futures[2])] == [QUESTIONS[0], QUESTIONS[2]]
        assert svc.metrics.failed == 1 and svc.live_programs == 0
        assert svc.submit(QUESTIONS[3]).result(timeout=60)["answer"] is not None
    finally:
        svc.stop()


def test_overload_and_stop(tiny_engine, small_index):
    svc = _service(tiny_engine, small_index, max_queue=2)
    svc._method(svc._request(None, None))
    svc._thread = threading.Thread(target=lambda: None)  # "running" but not consuming: the queue fills up
    svc._thread.start()
    svc._thread.join()
    svc._thread = type("Alive", (), {"is_alive": lambda self: True, "join": lambda self: None})()
    a, b = svc.submit(QUESTIONS[0]), svc.submit(QUESTIONS[1])
    with pytest.raises(OverloadedError) as err:
        svc.submit(QUESTIONS[2])
    assert err.value.retry_after_s >= 1 and svc.metrics.rejected_total == 1
    svc.stop(drain=False)
    for f in (a, b):  # accepted requests are never lost silently: they fail with a reason
        with pytest.raises(FastgateError, match="the service stopped before answering"):
            f.result(timeout=5)


def test_a_request_accepted_as_the_service_stops_is_answered_or_failed(tiny_engine, small_index):
    """submit checked "running", then stop() drained the queue, then submit put its request there: nobody read it and
    its future never resolved. The check and the put are one step now, which stop() waits for."""
    svc = _service(tiny_engine, small_index).start()
    real = svc._queue.put_nowait

    def slow_put(job):  # widen the window between submit's check and its put
        time.sleep(0.5)
        real(job)

    svc._queue.put_nowait = slow_put
    with ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(svc.submit, QUESTIONS[0])
        time.sleep(0.1)
        svc.stop(drain=True)
        future = submitted.result(timeout=30)
    assert future.result(timeout=10)["answer"] is not None  # drained: answered
    with pytest.raises(FastgateError, match="the service is not running"):
        svc.submit(QUESTIONS[1])
    assert svc.kv_used_bytes == 0 and svc.queue_depth == 0


def test_a_method_that_fails_to_build_fails_its_request_and_is_counted(tiny_engine, small_index, monkeypatch):
    svc = _service(tiny_engine, small_index).start()
    try:
        def broken(request):
            raise RuntimeError("checkpoint unreadable")

        monkeypatch.setattr(svc, "_method", broken)
        with pytest.raises(RuntimeError, match="unreadable"):
            svc.submit(QUESTIONS[0]).result(timeout=30)
        assert svc.metrics.failed == 1  # it was in no metric
    finally:
        svc.stop()


def test_a_tick_out_of_memory_fails_its_requests_with_a_reason_and_the_service_serves_on(tiny_engine, small_index):
    import torch

    from fastgate.errors import OutOfMemory

    svc = _service(tiny_engine, small_index).start()
    try:
        sched = svc.scheduler
        real = sched.step

        def oom():
            sched.step = real  # once
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        sched.step = oom
        with pytest.raises(OutOfMemory, match=r"ran out of memory answering 1 request\(s\)"):
            svc.submit(QUESTIONS[0]).result(timeout=30)
        assert svc.submit(QUESTIONS[1]).result(timeout=30)["answer"] is not None
    finally:
        svc.stop()


def test_a_loop_out_of_memory_fails_its_requests_with_a_reason_and_lets_its_memory_go(tiny_engine, small_index,
                                                                                     monkeypatch):
    """One decode loop's step runs out of memory (on a GPU: a bucket's graph, a store's growth): its requests fail
    with the out-of-memory error a server answers 503 with (it was the raw error: a 500), the loop's rows and store
    go at once (not when the collector breaks the scheduler's cycles), and the service serves on."""
    import torch

    from fastgate.engine.packed import PackedLoop
    from fastgate.errors import OutOfMemory

    real_step, real_drop, armed, dropped = PackedLoop.step, PackedLoop.drop, [], []

    def step(self, *args, **kwargs):
        if armed:
            armed.clear()  # once
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(self, *args, **kwargs)

    def drop(self):
        real_drop(self)
        dropped.append((self.size, self.store.rows_cap, self.kv_bytes))

    monkeypatch.setattr(PackedLoop, "step", step)
    monkeypatch.setattr(PackedLoop, "drop", drop)
    svc = _service(tiny_engine, small_index).start()
    try:
        armed.append(True)  # after the warm-up
        with pytest.raises(OutOfMemory, match="ran out of memory answering this request") as caught:
            svc.submit(QUESTIONS[0]).result(timeout=30)
        assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
        assert dropped == [(0, 0, 0)]  # no rows, no store left
        try:  # fastgate's own errors stay what they are, also when raised while handling an allocation failure
            try:
                raise torch.OutOfMemoryError("CUDA out of memory")
            except torch.OutOfMemoryError:
                raise InputError("the question is empty") from None
        except InputError as exc:
            from fastgate.scheduler.task import Task

            task = Task(None, "Who?")
            svc.scheduler.finish(task, error=exc)
            assert task.error is exc
        assert svc.submit(QUESTIONS[1]).result(timeout=30)["answer"] is not None
    finally:
        svc.stop()


def test_stop_without_draining_frees_the_kv_cache(tiny_engine, small_index):
    svc = _service(tiny_engine, small_index).start()
    futures = [svc.submit(q, method="seakr", params={"samples": 4, "max_steps": 4}) for q in QUESTIONS[:2]]
    deadline = time.time() + 30
    while svc.kv_used_bytes == 0 and time.time() < deadline:
        time.sleep(0.01)
    svc.stop(drain=False)
    for f in futures:
        with pytest.raises(FastgateError, match="the service stopped before answering"):
            f.result(timeout=10)
    assert svc.kv_used_bytes == 0 and svc.live_programs == 0


def test_a_cancelled_queued_request_leaves_the_queue_at_once(tiny_engine, small_index):
    """Requests given up while queued behind a long one (max_live=1) held their places until the worker reached
    them: a queue full of them refused the next request with 503, and its Retry-After counted them. They leave the
    queue when cancelled."""
    svc = _service(tiny_engine, small_index, max_live=1, max_queue=2, no_warmup=True).start()
    try:
        # seconds of decode steps on any CPU (see test_timeout_cancels_the_program)
        slow = svc.submit("capital of Kyrgyzstan", "seakr", {"samples": 16, "step_tokens": 64, "max_steps": 8,
                                                             "delta": -1e9, "answer_tokens": 128})
        deadline = time.time() + 30
        while not svc.live_programs and time.time() < deadline:
            time.sleep(0.01)
        assert svc.live_programs == 1  # the others queue behind it
        given_up = [svc.submit(q, "never") for q in QUESTIONS[:2]]
        assert svc.queue_depth == 2
        for f in given_up:
            svc.cancel(f)
            svc.cancel(f)  # twice (a timeout, then the client gone): counted once
        assert all(f.cancelled() for f in given_up) and svc.queue_depth == 0
        assert svc.metrics.cancelled == svc.metrics.failed == 2  # counted (a queued one was not: 5 timeouts read 4)
        waiting = [svc.submit(q, "never") for q in QUESTIONS[2:4]]  # accepted: their places are free
        assert svc.queue_depth == 2
        with pytest.raises(OverloadedError, match="2 requests queued"):  # the queue is full of live requests only
            svc.submit(QUESTIONS[4], "never")
        assert svc.metrics.rejected_total == 1 and not slow.done()
        svc.cancel(slow)
        assert all(f.result(timeout=60)["answer"] is not None for f in waiting)
    finally:
        svc.stop()


def test_the_tick_total_counts_a_scheduler_at_a_stopped_one_s_address_as_new(monkeypatch):
    """After a stop and a start the new scheduler may take the old one's address (CPython reuses freed memory): told
    apart by id(), its 5 ticks replaced the 165 counted (ticks_total 170 -> 5) and its generation calls went uncounted.
    The reuse is made certain here: every object the module asks id() of has the same one."""
    import fastgate.serving.service as service_module
    from fastgate.serving.service import _Metrics

    monkeypatch.setattr(service_module, "id", lambda obj: 1, raising=False)

    class Sched:
        def __init__(self, ticks: int, calls: int) -> None:
            self.ticks, self.generation_calls = ticks, calls
            self.generation_rows, self.generation_methods = [1] * calls, [("never",)] * calls

    m = _Metrics()
    old = Sched(165, 165)
    m.ticks(old)
    del old  # freed: the next Sched usually takes its address
    m.ticks(Sched(5, 5))
    assert m.ticks_total == 170 and m.generation_calls == 170


def test_the_tick_total_never_goes_back_after_a_failed_tick(tiny_engine, small_index):
    """A failed tick puts a new scheduler in, which counts its ticks from zero: the exported total took its count
    and went back (165 -> 5). The totals add the new scheduler's counts to the old one's."""
    svc = _service(tiny_engine, small_index, no_warmup=True).start()
    seen, watching = [], threading.Event()

    def watch():  # the totals as a scrape would read them, all along
        while not watching.is_set():
            seen.append((svc.metrics.ticks_total, svc.metrics.generation_calls))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for q in QUESTIONS[:3]:
            svc.submit(q, "never").result(timeout=60)
        sched = svc.scheduler
        real = sched.step

        def boom():
            sched.step = real  # once
            raise RuntimeError("injected tick failure")

        sched.step = boom
        with pytest.raises(RuntimeError, match="injected tick failure"):
            svc.submit(QUESTIONS[3], "never").result(timeout=60)
        svc.submit(QUESTIONS[4], "never", max_tokens=1).result(timeout=60)  # a few ticks of the new scheduler
        assert svc.scheduler is not sched and 0 < svc.scheduler.ticks < sched.ticks
        deadline = time.time() + 10  # the worker takes a tick's counts once the tick is over
        while svc.metrics.ticks_total != sched.ticks + svc.scheduler.ticks and time.time() < deadline:
            time.sleep(0.01)
        assert svc.metrics.ticks_total == sched.ticks + svc.scheduler.ticks
        assert svc.metrics.generation_calls == sched.generation_calls + svc.scheduler.generation_calls
    finally:
        watching.set()
        watcher.join()
        svc.stop()
    for total in (0, 1):  # neither ever went back
        assert all(a[total] <= b[total] for a, b in zip(seen, seen[1:])) and seen[-1][total] > seen[0][total]


# ---------------------------------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def server(service):
    from fastgate.entrypoints.http import create_app
    from fastgate.testing import serve_in_thread

    app = create_app(service, timeout_s=60)
    with serve_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}", app


def test_http_concurrent_answers_match_the_cli_records(server, service):
    url, _ = server
    with ThreadPoolExecutor(8) as pool, httpx.Client(timeout=60) as client:
        responses = list(pool.map(lambda q: client.post(f"{url}/v1/answer", json={"question": q}), QUESTIONS * 2))
    assert [r.status_code for r in responses] == [200] * len(QUESTIONS) * 2
    direct = service._method(service._request(None, None)).answer_batch(QUESTIONS)
    for r, d in zip(responses, direct * 2):
        body = r.json()
        assert body["answer"] == d.answer and body["question"] == d.question
        assert set(body) == set(d.to_dict()) | {"model", "retriever", "engine", "dtype", "weights"}
        assert body["engine"] == "local" and body["dtype"] == "float32" and body["weights"]  # as ask --json does


def test_http_refuses_a_body_over_the_limit_unread_and_keeps_serving(server):
    url, _ = server
    big = {"question": "x" * (1 << 20)}  # 1 MiB of question: over ServiceConfig.max_body_bytes with its JSON

    def chunked():  # no Content-Length: counted as it arrives, refused at the first chunk past the limit
        for _ in range(64):
            yield b" " * (1 << 16)

    with httpx.Client(timeout=60) as client:
        declared = client.post(f"{url}/v1/answer", json=big)
        streamed = client.post(f"{url}/v1/answer", content=chunked(), headers={"Content-Type": "application/json"})
        openai = client.post(f"{url}/v1/chat/completions",
                             json={"model": "fastgate-dtr", "messages": [{"role": "user", "content": big["question"]}]})
        after = client.post(f"{url}/v1/answer", json={"question": "What is the capital of France?"})
    for r in (declared, streamed):
        assert r.status_code == 413 and "at most 1,048,576 bytes" in r.json()["error"]
    assert openai.status_code == 413 and openai.json()["error"]["code"] == "body_too_large"
    assert after.status_code == 200 and after.json()["answer"]


@pytest.mark.parametrize("payload,status,message", [
    (b"not json", 422, "JSON"),
    (b'{"question": "\xc9\xff"}', 422, "not JSON in UTF-8"),  # a body FastAPI cannot decode at all
    ({}, 422, "question"),
    ({"question": "x" * 500_000}, 422, "question"),
    ({"question": 7}, 422, "question"),
    ({"question": "ok?", "method": 3}, 422, "method"),
    ({"question": "ok?", "method": "magic"}, 422, "unknown method 'magic'"),
    ({"question": "ok?", "method": ""}, 422, "unknown method"),
    ({"question": "ok?", "params": {"tau": "high"}}, 422, "expects float"),
    ({"question": "ok?", "params": [1]}, 422, "params"),
    ({"question": "ok?", "max_tokens": -1}, 422, "max_tokens"),
    ({"question": "ok?", "surprise": 1}, 422, "surprise"),
    ({"question": "  \n "}, 422, "empty"),
    # valid JSON, a lone surrogate: pydantic's string check refuses it here (check_text: the service's own test)
    (b'{"question": "Capital \\ud800 of France?"}', 422, "valid string"),
    ({"question": "ok?", "method": "never", "params": {"max_answer_tokens": "300"}}, 422, "limit of 256 tokens"),
    ({"question": "ok?", "method": "never", "params": {"max_answer_tokens": 400}}, 422, "limit of 256 tokens"),
    ({"question": "ok?", "method": "seakr", "params": {"answer_tokens": 300}}, 422, "answer_tokens=300"),
])
def test_http_bad_requests(server, payload, status, message):
    url, _ = server
    kwargs = {"content": payload, "headers": {"content-type": "application/json"}} if isinstance(payload, bytes) \
        else {"json": payload}
    r = httpx.post(f"{url}/v1/answer", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    assert message.lower() in r.json()["error"].lower()


def test_http_health_metrics_schema(server):
    url, _ = server
    health = httpx.get(f"{url}/healthz").json()
    assert health["status"] == "ok" and health["kv_budget_mb"] > 0 and health["kv_used_mb"] >= 0
    assert health["layout"] == "packed"  # the tiny Llama runs packed passes (fastgate.engine.packed)
    assert health["dtype"] == "float32"  # the weights' dtype, chosen when the model loaded
    assert health["device"] == "cpu" and health["device_reserved_mb"] is None  # CUDA's allocator: a GPU's only
    httpx.post(f"{url}/v1/answer", json={"question": "Who wrote Hamlet?"}, timeout=60)
    assert httpx.get(f"{url}/healthz").json()["kv_used_mb"] == 0  # an idle loop holds no cache
    text = httpx.get(f"{url}/metrics").text
    for name in ("fastgate_requests_total{status=\"200\"}", "fastgate_request_latency_seconds_bucket",
                 "fastgate_generation_rows_bucket", "fastgate_answer_latency_seconds_bucket{le=\"0.05\",retrieved=",
                 "fastgate_live_programs", "fastgate_shared_generation_calls_total", "fastgate_retrieval_rate",
                 "fastgate_queue_depth", "fastgate_searches_total", "fastgate_rejected_total", "fastgate_failed_total"):
        assert name in text
    # the service's totals only grow: counters (they were gauges), under the names they had
    for name in ("fastgate_cancelled", "fastgate_answered", "fastgate_searches", "fastgate_scheduler_ticks"):
        assert f"# TYPE {name}_total counter" in text and f"\n{name}_total " in text
    schema = httpx.get(f"{url}/openapi.json").json()
    assert "/v1/answer" in schema["paths"] and json.dumps(schema)


def test_http_timeout_gives_504(tiny_engine, small_index):
    from fastapi.testclient import TestClient

    from fastgate.entrypoints.http import create_app

    svc = _service(tiny_engine, small_index)
    svc._method(svc._request(None, None))
    svc._thread = type("Alive", (), {"is_alive": lambda self: True, "join": lambda self: None})()  # never answers
    futures = []
    submit = svc.submit
    svc.submit = lambda *args, **kwargs: futures.append(submit(*args, **kwargs)) or futures[-1]
    with TestClient(create_app(svc, timeout_s=0.2)) as client:
        r = client.post("/v1/answer", json={"question": "Who wrote Hamlet?"})
    assert r.status_code == 504 and "not answered" in r.json()["error"]
    (future,) = futures
    assert future.cancelled() and svc.queue_depth == 0  # dropped, and out of the queue: it will not be run


def test_a_streamed_timeout_is_counted_once_and_healthz_says_503_once_stopped(tiny_engine, small_index):
    from fastapi.testclient import TestClient

    from fastgate.entrypoints.http import create_app

    svc = _service(tiny_engine, small_index)
    svc._method(svc._request(None, None))
    svc._thread = type("Alive", (), {"is_alive": lambda self: True, "join": lambda self: None})()  # never answers
    with TestClient(create_app(svc, timeout_s=0.3)) as client:
        body = {"model": "fastgate-dtr", "stream": True, "messages": [{"role": "user", "content": "Who?"}]}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"timeout"' in events[-2] and events[-1] == "data: [DONE]"
        metrics = client.get("/metrics").text
        assert 'status="504"} 1.0' in metrics and 'status="499"' not in metrics  # a timeout, not a client gone
        assert client.get("/healthz").status_code == 200
        svc._thread = type("Dead", (), {"is_alive": lambda self: False, "join": lambda self: None})()
        health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["status"] == "stopped"


def test_text_no_tokenizer_takes_is_refused_before_it_is_queued(service):
    """A lone surrogate (valid JSON, ``"\\ud800"``, but no UTF-8 encodes it) made the tokenizer raise TypeError
    inside the scheduler's batched call, which failed every request running with it."""
    from fastgate.config import GenerationConfig

    depth = service.queue_depth
    with pytest.raises(InputError, match="lone surrogate U[+]DC00 at character 4"):
        service.submit("Who \udc00 wrote Hamlet?")
    with pytest.raises(InputError, match="the prompt is not valid Unicode text"):
        service.submit_completion("Capital \ud800 of France?", GenerationConfig(max_new_tokens=4))
    assert service.queue_depth == depth and service.submit("Who wrote Hamlet?").result(timeout=60)["answer"]


class _Connected:
    """An HTTP request whose client stays connected."""

    async def is_disconnected(self) -> bool:
        return False


@pytest.mark.parametrize("request_", [None, _Connected()], ids=["no-request", "polling-the-client"])
def test_a_cancelled_handler_cancels_its_request(tiny_engine, small_index, request_):
    """A forced shutdown (uvicorn, at a second SIGINT) cancels the handlers waiting for answers: their requests ran
    on, and ``stop(drain=True)`` answered every one for nobody (57 s). A cancelled wait cancels its request, queued
    (out of the queue) or running (its program stops at the next tick), and raises on."""
    import asyncio

    from fastgate.entrypoints.http.common import wait_answer

    svc = _service(tiny_engine, small_index)
    svc._method(svc._request(None, None))
    svc._thread = type("Alive", (), {"is_alive": lambda self: True, "join": lambda self: None})()  # never answers
    queued, running = svc.submit(QUESTIONS[0]), svc.submit(QUESTIONS[1])
    running.set_running_or_notify_cancel()  # as the worker does when it starts a program

    async def cancel_waits():
        waits = [asyncio.create_task(wait_answer(svc, f, 60, request_)) for f in (queued, running)]
        await asyncio.sleep(0.05)
        for w in waits:
            w.cancel()
        for w in waits:
            with pytest.raises(asyncio.CancelledError):
                await w

    asyncio.run(cancel_waits())
    assert queued.cancelled() and svc.queue_depth == 1  # dropped; the running one's job is the worker's
    assert svc._cancel == [running]  # the worker cancels its program at the next tick


def test_service_metrics_stay_bounded_between_scrapes_and_the_export_counts_everything():
    """Nobody scraping /metrics, the service kept an entry per decode step and per answer. What the histograms
    observe is kept folded now, in a bounded size, and the export says what it said: every bucket, count and sum of
    the rows per step and of the latencies (bucket bounds and beyond the last included), over two scrapes."""
    import random
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from fastgate.entrypoints.http import metrics as http_metrics
    from fastgate.serving.service import LATENCY_BUCKETS_S, _Metrics

    assert LATENCY_BUCKETS_S == http_metrics._SECONDS  # the exporter's latency buckets
    rng = random.Random(0)
    m = _Metrics()
    sched = SimpleNamespace(ticks=0, generation_calls=0, generation_rows=[], generation_methods=[])
    exporter = http_metrics.HttpMetrics()
    rows, latencies = [], []

    def value(samples, name, **labels):
        (found,) = [s.value for s in samples if s.name == name and s.labels == labels]
        return found

    for _ in range(2):
        for _ in range(20_000):
            n = rng.randint(1, 8)
            sched.ticks += 1
            sched.generation_calls += 1
            sched.generation_rows.append(n)
            sched.generation_methods.append(frozenset({"never"}))
            m.ticks(sched)
            rows.append(n)
            retrieved = rng.random() < 0.5
            seconds = rng.choice((0.1, 1, 128, 300.0)) if rng.random() < 0.1 else rng.uniform(0.0, 150.0)
            m.finished(seconds, retrieved=retrieved)
            latencies.append((retrieved, seconds))
        assert len(m.generation_rows) <= 8 and len(m.latencies) <= 2 * (len(LATENCY_BUCKETS_S) + 1)
        text = exporter.render(SimpleNamespace(metrics=m, live_programs=0, queue_depth=0))
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        for name, values, labels in (
                ("fastgate_generation_rows", rows, {}),
                ("fastgate_answer_latency_seconds", [s for r, s in latencies if r], {"retrieved": "yes"}),
                ("fastgate_answer_latency_seconds", [s for r, s in latencies if not r], {"retrieved": "no"})):
            buckets = [s for s in samples if s.name == f"{name}_bucket"
                       and {k: v for k, v in s.labels.items() if k != "le"} == labels]
            assert len(buckets) > 8
            for b in buckets:
                assert b.value == sum(v <= float(b.labels["le"]) for v in values), (name, b.labels)
            assert value(samples, f"{name}_count", **labels) == len(values)
            assert value(samples, f"{name}_sum", **labels) == pytest.approx(sum(values), rel=1e-9)
        calls = value(samples, "fastgate_generation_calls_total")
        assert calls == value(samples, "fastgate_scheduler_ticks_total") == len(rows)
        assert value(samples, "fastgate_answered_total") == len(latencies)
        assert not m.generation_rows and not m.latencies  # drained


def test_a_client_that_goes_away_cancels_its_request(tiny_engine, small_index, caplog):
    """Not streamed either: the request is cancelled once the client is gone (its work stops at the next tick), and
    neither it nor a timed-out request leaves an error nobody read for asyncio to log."""
    import gc

    from fastgate.entrypoints.http import create_app
    from fastgate.testing import serve_in_thread

    svc = _service(tiny_engine, small_index, no_warmup=True).start()
    slow = {"question": "capital of Kyrgyzstan", "method": "seakr",
            "params": {"samples": 16, "step_tokens": 64, "max_steps": 8, "delta": -1e9, "answer_tokens": 128}}
    try:
        with serve_in_thread(create_app(svc, timeout_s=60)) as port, caplog.at_level("ERROR"):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"http://127.0.0.1:{port}/v1/answer", json=slow, timeout=1.0)  # gives up after 1 s
            deadline = time.time() + 30
            while (svc.live_programs or not svc.metrics.cancelled) and time.time() < deadline:
                time.sleep(0.05)
            assert svc.metrics.cancelled == 1 and svc.live_programs == 0 and svc.metrics.answered == 0
            text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            assert 'fastgate_requests_total{status="499"} 1.0' in text
        gc.collect()
        assert "never retrieved" not in caplog.text
    finally:
        svc.stop()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzzing_finds_no_server_error(server, mode):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    _, app = server
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    strategy = schema.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    seen = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=strategy)
    def fuzz(case):
        response = case.call()
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)

    fuzz()
    assert len(seen) >= 20


# ---------------------------------------------------------------------------------------------------- the error map
def _failing():
    from fastgate.errors import CheckpointError, FastgateError, OutOfMemory
    from fastgate.scheduler import CancelledError

    return {"overloaded": OverloadedError(3, retry_after_s=7), "input": InputError("bad question"),
            "memory": OutOfMemory("the server ran out of memory"),
            "checkpoint": CheckpointError("no such checkpoint"), "stopping": FastgateError("the service is stopping"),
            "cancelled": CancelledError("the request was cancelled"), "bug": RuntimeError("boom")}


@pytest.mark.parametrize("name,queued,native,openai,code", [
    ("overloaded", False, 503, 503, "overloaded"),
    ("input", False, 422, 400, "invalid_value"),
    ("input", True, 422, 400, "invalid_value"),
    ("checkpoint", False, 422, 400, "invalid_value"),
    ("checkpoint", True, 422, 400, "invalid_value"),
    ("stopping", False, 503, 503, "unavailable"),
    ("memory", True, 503, 503, "out_of_memory"),  # a 500 "internal error" before
    ("stopping", True, 500, 500, "internal_error"),  # a FastgateError while answering (e.g. the service stopped)
    ("cancelled", True, 504, 504, "timeout"),  # the service's own timeout
    ("bug", True, 500, 500, "internal_error"),
])
def test_one_error_map_for_native_and_openai(name, queued, native, openai, code):
    from fastgate.entrypoints.http.common import NotAnswered
    from fastgate.entrypoints.http.errors import ErrorMap

    counted = []
    errors = ErrorMap(service_timeout_s=120, count=counted.append)
    exc = _failing()[name]
    a, b = errors.error(exc, openai=False, queued=queued), errors.error(exc, openai=True, queued=queued)
    assert (a.status, b.status, a.code, b.code) == (native, openai, code, code)
    assert a.message == b.message
    if name == "cancelled":
        assert a.message == "not answered within 120 s"
    if name == "bug":
        assert a.message == "internal error: RuntimeError: boom"
    if native == 503:
        assert a.headers == {"Retry-After": "7" if name == "overloaded" else "5"}
    timeout = errors.error(NotAnswered(0.5), openai=True)
    assert (timeout.status, timeout.message, timeout.code) == (504, "not answered within 0.5 s", "timeout")
    assert counted == []  # counted when a response is written
    errors.native(exc, queued=queued)
    errors.openai(exc, queued=queued)
    assert counted == [native, openai]


@pytest.mark.parametrize("name", ["overloaded", "input", "checkpoint", "stopping", "cancelled", "bug"])
def test_http_errors_have_each_api_format(name):
    """Submitting fails, or the answer fails: the native body is {"error": message}, the OpenAI body has OpenAI's
    shape, with the same status as the map's."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from fastgate.entrypoints.http import create_app
    from fastgate.entrypoints.http.errors import ErrorMap
    from fastgate.serving.service import _Metrics

    exc = _failing()[name]
    errors = ErrorMap(120, lambda status: None)
    for queued in (False, True):
        if queued and name == "overloaded":
            continue

        def submit(*args, queued=queued, **kwargs):
            if not queued:
                raise exc
            future = Future()
            future.set_exception(exc)
            return future

        svc = SimpleNamespace(config=ServiceConfig(method="never"), submit=submit, cancel=lambda f: None,
                              model_name="tiny", runtime=SimpleNamespace(remote=None), metrics=_Metrics(),
                              live_programs=0, queue_depth=0)
        with TestClient(create_app(svc, timeout_s=5), raise_server_exceptions=False) as client:
            native = client.post("/v1/answer", json={"question": "Who wrote Hamlet?"})
            openai = client.post("/v1/chat/completions",
                                 json={"model": "fastgate", "messages": [{"role": "user", "content": "Who?"}]})
            metrics = client.get("/metrics").text
        want_native, want_openai = (errors.error(exc, openai=o, queued=queued) for o in (False, True))
        if name == "bug" and not queued:  # not a FastgateError: a bug while submitting is the framework's own 500
            assert native.status_code == openai.status_code == 500
            continue
        assert native.status_code == want_native.status, native.text
        assert native.json() == {"error": want_native.message}
        assert openai.status_code == want_openai.status, openai.text
        assert openai.json()["error"]["message"] == want_openai.message
        assert openai.json()["error"]["code"] == want_openai.code
        if want_native.status == 503:
            assert native.headers["Retry-After"] == openai.headers["Retry-After"] == want_native.headers["Retry-After"]
        assert f'fastgate_requests_total{{status="{want_native.status}"}}' in metrics


def test_openapi_schema_names_the_models_and_each_servers_limits():
    """The request models at module level, narrowed per server: the schema keeps their names and carries the
    server's limits (two apps with different limits in one process)."""
    from types import SimpleNamespace

    from fastgate.entrypoints.http import create_app, protocol

    small = create_app(SimpleNamespace(config=ServiceConfig(method="never", max_tokens_limit=64,
                                                            max_question_chars=100))).openapi()
    default = create_app(SimpleNamespace(config=ServiceConfig())).openapi()
    names = {"AnswerRequest", "AnswerResponse", "ChatChoice", "ChatCompletion", "ChatCompletionRequest",
             "ChatMessage", "Completion", "CompletionChoice", "CompletionRequest", "ErrorBody", "ErrorDetail",
             "ErrorResponse", "GateStepModel", "Message", "ModelCard", "ModelList", "Passage", "StreamOptions",
             "TextPart", "Usage"}
    for schema, (limit, chars, method) in ((small, (64, 100, "never")), (default, (256, 4000, "dtr"))):
        comps = schema["components"]["schemas"]
        assert names <= set(comps) and all(hasattr(protocol, n) for n in names)
        answer = comps["AnswerRequest"]["properties"]
        assert answer["question"]["maxLength"] == chars
        assert answer["max_tokens"]["anyOf"][0]["maximum"] == limit
        assert answer["method"]["description"].endswith(f"(default: {method})")
        chat = comps["ChatCompletionRequest"]["properties"]
        assert chat["max_completion_tokens"]["anyOf"][0]["maximum"] == limit
        assert chat["model"]["description"].endswith(f"({method})")
        assert comps["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == limit


def test_a_paused_pass_takes_in_the_requests_queued_since_it_began(tiny_engine, small_index, monkeypatch):
    """The service's scheduler pauses long passes (``--interject``, 8 by default) and, at a pause, moves the requests
    queued since the tick began into the scheduler, where they can start before the pass ends."""
    from fastgate.scheduler import Scheduler

    svc = _service(tiny_engine, small_index)
    assert svc.config.scheduler_config().interject == 8
    svc._scheduler = sched = svc._new_scheduler(Scheduler)  # the worker's scheduler, without its thread
    assert sched.admission.pause is not None and sched.feed is not None
    monkeypatch.setattr(AnswerService, "running", property(lambda self: True))  # its worker is this test
    future = svc.submit(QUESTIONS[1])
    assert svc.queue_depth == 1 and sched.live == 0
    sched.feed()
    assert svc.queue_depth == 0 and sched.live == 1
    while not future.done():
        sched.step()
    assert future.result(timeout=0)["answer"] == service_answer(svc, QUESTIONS[1])
    off = _service(tiny_engine, small_index, interject=0)
    assert off._new_scheduler(Scheduler).admission.pause is None


def test_a_request_given_up_during_a_paused_pass_is_cancelled_at_that_pause(tiny_engine, small_index, monkeypatch):
    """A client that goes away (or a request past its timeout) while a long pass is paused has its program cancelled
    at the pause, where the lane could otherwise run it on until the tick ends."""
    from fastgate.scheduler import CancelledError, Scheduler

    svc = _service(tiny_engine, small_index)
    svc._scheduler = sched = svc._new_scheduler(Scheduler)
    monkeypatch.setattr(AnswerService, "running", property(lambda self: True))
    future = svc.submit(QUESTIONS[1])
    sched.feed()  # a pause: the request starts
    (job,) = svc._running.values()
    assert not job.task.cancelled
    svc.cancel(future)  # running: the worker cancels its program
    sched.feed()  # the next pause
    assert job.task.cancelled
    while not job.task.done:
        sched.step()
    assert isinstance(job.task.error, CancelledError)
    with pytest.raises(CancelledError):
        future.result(timeout=0)


def service_answer(svc: AnswerService, question: str) -> str:
    return svc._method(svc._request(None, None)).answer_batch([question])[0].answer


def test_serve_on_a_busy_port_fails_before_the_model_loads():
    """A port another server holds is one clear error, found before the service starts (a model load takes seconds;
    uvicorn's own bind failure came after it, in its own words)."""
    import socket

    from fastgate.entrypoints.http.app import serve

    class Service:  # never started: the port is checked first
        started = False

        def start(self):
            self.started = True

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        service = Service()
        with pytest.raises(InputError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve(service, host="127.0.0.1", port=port)
        assert not service.started


def test_a_port_check_binds_as_the_server_would():
    """The port check tries every address the host names as asyncio binds them: IPv6 sockets IPv6 only (``::`` is
    free while only IPv4's wildcard is taken), ``""`` every interface; a port out of range is refused, not wrapped."""
    import socket

    from fastgate.entrypoints.http.app import _check_port

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for host in ("0.0.0.0", ""):
            with pytest.raises(InputError, match="Address already in use"):
                _check_port(host, port)
        if socket.has_ipv6:
            try:
                _check_port("::", port)
            except InputError as exc:  # a machine without IPv6 configured: nothing to show
                assert "in use" not in str(exc)
    with pytest.raises(InputError, match="between 0 and 65535"):
        _check_port("127.0.0.1", 70000)


def test_a_request_needing_more_rows_than_max_rows_is_refused_before_it_queues(tiny_engine, small_index):
    """A SeaKR request of more samples than --max-rows was queued and refused only when its generation reached the
    scheduler; a server whose own method needs more started, logged its warm-up's failure and refused every request."""
    svc = _service(tiny_engine, small_index, max_rows=4)
    with pytest.raises(InputError, match="method seakr decodes 8 sequences at once .* max_rows=4 \\(--max-rows\\)"):
        svc._request("seakr", {"samples": 8})
    assert svc._request("seakr", {"samples": 4}).method == "seakr"
    assert svc.queue_depth == 0
    runtime = Runtime("tiny", index=str(small_index), engine=tiny_engine)
    own = AnswerService(ServiceConfig(method="seakr", params=(("samples", 8),), index=str(small_index), max_rows=4,
                                      no_warmup=True), runtime)
    with pytest.raises(InputError, match="decodes 8 sequences at once"):
        own.start()
