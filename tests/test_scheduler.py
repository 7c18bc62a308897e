"""The step-program scheduler: a question's result is the same alone, in a batch and when it joins a running
scheduler beside programs of other methods; requests of one kind share one batched call; errors and cancellation
stay with their own program."""

from __future__ import annotations

import json

import pytest
import torch
from golden import FIXTURE, QUESTIONS, assert_same, cases, comparable, setups

from fastgate.config import GenerationConfig, TapSpec
from fastgate.errors import InputError
from fastgate.programs import All, Answer, Generate, Search
from fastgate.scheduler import CancelledError, Scheduler, Task

GOLDEN = json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return setups(tmp_path_factory.mktemp("sched"))


@pytest.fixture(scope="module")
def methods(world):
    from fastgate.methods import build_method

    engine, retrievers, ckpts = world
    return [build_method(name, engine, retrievers[r], params) for name, r, params in cases(ckpts)]


MODES = {"whole-prefill": {"continuous": True, "prefill_budget": None},  # the packed layout (the default)
         "chunked-prefill": {"continuous": True, "prefill_budget": 48},  # 4 chunks a 158-token prompt
         # 48 tokens a step with no row decoding, 16 while rows decode
         "decoding-chunks": {"continuous": True, "prefill_budget": 48, "decoding_prefill_budget": 16},
         "padded-whole-prefill": {"continuous": True, "prefill_budget": None, "layout": "padded"},
         "padded-chunked-prefill": {"continuous": True, "prefill_budget": 48, "layout": "padded"},
         "closed-calls": {"continuous": False}}


@pytest.mark.parametrize("mode", list(MODES))
def test_programs_admitted_at_staggered_ticks_beside_other_methods_equal_golden(world, methods, mode):
    engine = world[0]
    sched = Scheduler(engine, **MODES[mode])
    # interleaved methods; six of the eight questions keep the test within the suite's time
    pending = [(c, i) for i in range(6) for c in range(len(methods))]
    tasks = {}
    tick = 0
    while pending or not sched.idle:
        for _ in range(1 + tick % 7):  # a few new programs join at every tick, while others run
            if pending:
                c, i = pending.pop(0)
                tasks[(c, i)] = sched.submit(methods[c], QUESTIONS[i])
        sched.step()
        tick += 1
    assert max(len(m) for m in sched.generation_methods) >= 3  # programs of several methods shared engine calls
    for (c, i), task in tasks.items():
        assert task.error is None, task.error
        assert_same(comparable(task.result), GOLDEN[c]["results"][i], f"{GOLDEN[c]['method']} q{i} staggered")


@pytest.mark.parametrize("case", range(len(GOLDEN)), ids=[f"{g['method']}-{g['retriever']}" for g in GOLDEN])
def test_alone_equals_golden(case, methods):
    for i in (2, 6):
        got = comparable(methods[case].answer(QUESTIONS[i]))
        assert_same(got, GOLDEN[case]["results"][i], f"{GOLDEN[case]['method']} q{i} alone")


def test_timings_are_the_questions_own(methods):
    never, dtr = methods[0], methods[2]
    sched = Scheduler(never.engine)
    fast = sched.submit(never, QUESTIONS[0])
    slow = [sched.submit(dtr, q) for q in QUESTIONS]
    sched.run([fast, *slow])
    assert fast.finished < max(t.finished for t in slow)  # it did not wait for the batch's slowest question
    assert fast.result.timings["total_s"] < max(t.result.timings["total_s"] for t in slow)
    # every phase's key, 0.0 where it did not run (a reader's timings["retrieval_s"] of a `never` answer: KeyError)
    assert set(fast.result.timings) == {"generation_s", "retrieval_s", "gate_s", "total_s"}
    assert fast.result.timings["retrieval_s"] == fast.result.timings["gate_s"] == 0.0
    retrieved = [t.result for t in slow if t.result.retrieved]
    assert retrieved and all(r.timings["retrieval_s"] > 0 for r in retrieved)


@pytest.mark.parametrize("continuous", [True, False], ids=["decode-loop", "closed-calls"])
def test_requests_of_one_kind_share_one_call(world, continuous):
    engine, retrievers, _ = world
    calls = []
    bm25 = retrievers["bm25"]

    class Counting:
        def search_batch(self, queries, k):
            calls.append(len(queries))
            return bm25.search_batch(queries, k)

    counting = Counting()

    def program(q):
        (hits,) = yield Search(counting, (q,), 2)
        a, b = yield All(Generate(f"Q: {q}\nA:", GenerationConfig(max_new_tokens=3)),
                         Generate(f"Q: {q}\nA:", GenerationConfig(max_new_tokens=5, do_sample=True, top_k=5), k=2,
                                  seed=7))
        return Answer(a.sequences[0].text, hits), len(b.sequences)

    sched = Scheduler(engine, continuous=continuous)
    out = sched.evaluate(program(q) for q in QUESTIONS[:5])
    assert calls == [5]  # five programs, one search_batch
    if continuous:  # greedy and sampled rows joined the loop together and decoded in the same steps
        # (a packed loop's first step is the prompts' pass; their first tokens are fed in the next)
        assert sched.generation_rows[0] == 15
        assert len(sched.generation_rows) == sched.generation_calls <= 5 + (sched.layout == "packed")
    else:  # in one closed call
        assert sched.generation_calls == 1 and sched.generation_rows == [15]
    assert [n for _, n in out] == [2] * 5


def test_mixed_rows_equal_their_own_calls(tiny_engine):
    """Rows with different decoding settings, taps, sample counts and seeds in one engine call give what each gives
    alone (the scheduler relies on it)."""
    prompts = ["Q: Who wrote Hamlet?\nA:", "The capital of France is", "Q: largest planet?\nA:"]
    configs = [GenerationConfig(max_new_tokens=6, stop=("\n",)),
               GenerationConfig(max_new_tokens=9, do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
               GenerationConfig(max_new_tokens=4, do_sample=True, top_k=50)]
    taps = [TapSpec(layers=(2,)), TapSpec(eos_state=True), TapSpec(layers=(1, 3))]
    ks, seeds = [1, 3, 2], [None, 11, 12]
    mixed = tiny_engine.generate(prompts, configs, taps, ks, seeds)
    assert mixed.layers == (1, 2, 3) and len(mixed.sequences) == 6
    pos = 0
    for p, c, t, k, s in zip(prompts, configs, taps, ks, seeds):
        alone = tiny_engine.generate([p], c, t, k, [s])
        for j, seq in enumerate(alone.sequences):
            assert mixed.sequences[pos + j].token_ids == seq.token_ids
        for layer in t.layers:
            col = mixed.layers.index(layer)
            torch.testing.assert_close(mixed.running_sum[pos:pos + k, col], alone.running_sum[:, t.layers.index(layer)],
                                       rtol=1e-4, atol=1e-4)
        if t.eos_state:
            torch.testing.assert_close(mixed.eos_state[pos:pos + k], alone.eos_state, rtol=1e-4, atol=1e-4)
        pos += k
    with pytest.raises(InputError, match="different layers"):
        tiny_engine.generate(prompts[:2], None, [TapSpec(eos_state=True, mid_layer=1), TapSpec(eos_state=True)])


def test_a_failing_program_ends_only_itself(world):
    engine = world[0]

    def ok(q):
        out = yield Generate(f"Q: {q}\nA:", GenerationConfig(max_new_tokens=3))
        return out.sequences[0].text

    def bad_request(q):
        yield Generate("", GenerationConfig(max_new_tokens=3))  # an empty prompt: the engine refuses it
        return "unreachable"

    def raises(q):
        yield Generate(f"Q: {q}\nA:", GenerationConfig(max_new_tokens=3))
        raise RuntimeError("boom")

    sched = Scheduler(engine)
    def not_a_request(q):
        yield ["a list"]
        return "unreachable"

    tasks = [Task(None, "", program=ok("a")), Task(None, "", program=bad_request("b")),
             Task(None, "", program=raises("c")), Task(None, "", program=not_a_request("e")),
             Task(None, "", program=ok("d"))]
    sched._inbox.extend(tasks)
    sched.run(tasks)
    assert isinstance(tasks[0].result, str) and isinstance(tasks[4].result, str)
    assert isinstance(tasks[3].error, InputError) and "not a request" in str(tasks[3].error)
    assert isinstance(tasks[1].error, InputError) and "empty" in str(tasks[1].error)
    assert isinstance(tasks[2].error, RuntimeError)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_bad_tap_layer_or_a_cleanup_that_raises_ends_only_its_own_program(world, layout, caplog):
    """A tap layer the model lacks reached the decode loop, whose KeyError / IndexError failed every program sharing
    it; a cancelled program whose cleanup raised stopped the tick, the others kept their KV rows and never ended."""
    from fastgate.config import TapSpec
    from fastgate.scheduler import SchedulerConfig

    engine = world[0]

    def ok(q):
        out = yield Generate(f"Q: {q}\nA:", GenerationConfig(max_new_tokens=6, stop_at_eos=False))
        return out.sequences[0].text

    def bad_taps(q):
        yield Generate(f"Q: {q}\nA:", GenerationConfig(max_new_tokens=3), TapSpec(layers=(99,)))
        return "unreachable"

    def stubborn(q):
        try:
            yield Generate(f"Q: {q}\nA:", GenerationConfig(max_new_tokens=50, stop_at_eos=False))
        finally:
            raise RuntimeError("cleanup failed")

    sched = Scheduler(engine, SchedulerConfig(layout=layout, prefill_budget=512))
    tasks = [Task(None, "", program=ok("a")), Task(None, "", program=bad_taps("b")),
             Task(None, "", program=stubborn("c")), Task(None, "", program=ok("d"))]
    for t in tasks:
        sched._inbox.append(t)
    sched.step()
    sched.cancel(tasks[2])
    with caplog.at_level("WARNING"):
        sched.run(tasks)
    assert isinstance(tasks[0].result, str) and isinstance(tasks[3].result, str)
    assert isinstance(tasks[1].error, InputError) and "tap layer 99 out of range" in str(tasks[1].error)
    assert tasks[2].finished and "cleanup raised" in caplog.text
    assert sched.kv_bytes == 0 and sched.idle


def test_cancelled_program_stops_consuming_work(world):
    engine = world[0]
    steps = []

    def forever(q):
        while True:
            steps.append(q)
            yield Generate(f"Q: {q}\nA:", GenerationConfig(max_new_tokens=2))

    sched = Scheduler(engine)
    task = Task(None, "", program=forever("q"))
    sched._inbox.append(task)
    for _ in range(3):
        sched.step()
    sched.cancel(task)
    sched.step()
    assert task.done and isinstance(task.error, CancelledError)
    n = len(steps)
    assert not sched.step() and len(steps) == n  # nothing of it runs any more


@pytest.mark.parametrize(("admit_every", "budget"), [(1, None), (5, None), (1, 64)])
def test_a_generation_joining_mid_way_does_not_wait_for_the_running_one(world, admit_every, budget):
    engine = world[0]
    sched = Scheduler(engine, admit_every=admit_every, prefill_budget=budget)

    def gen(q, n):
        (out,) = (yield Generate(f"Q: {q}\nA:", GenerationConfig(max_new_tokens=n, stop_at_eos=False))).sequences
        return out.token_ids

    long = Task(None, "", program=gen(QUESTIONS[0], 40))
    sched._inbox.append(long)
    for _ in range(3):
        sched.step()
    short = Task(None, "", program=gen(QUESTIONS[1], 2))
    sched._inbox.append(short)
    ticks = 0
    while not short.done:
        sched.step()
        ticks += 1
    assert not long.done  # answered while the long one runs
    # joined at the admit_every-th step and decoded its 2 tokens with the long one (with a budget the short prompt
    # prefills within the budget of its first step); a packed pass ends a prefill, the next one feeds its first token
    assert ticks == admit_every + 1 + (sched.layout == "packed")
    sched.run([long])
    alone = [engine.generate([f"Q: {q}\nA:"], GenerationConfig(max_new_tokens=n, stop_at_eos=False)).sequences[0]
             for q, n in ((QUESTIONS[0], 40), (QUESTIONS[1], 2))]
    assert long.result == alone[0].token_ids and short.result == alone[1].token_ids


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("budget", [None, 16], ids=["whole-prefill", "chunked-prefill"])
def test_a_full_kv_budget_makes_generations_wait_and_memory_returns(world, budget, layout):
    """Six generations under a KV budget for about two rows: never more rows or bytes than it allows, each answer
    equals its generation alone, a generation that cannot fit even alone fails clearly, and the memory goes back."""
    from fastgate.engine.kv_cache import cell_bytes

    engine = world[0]
    cell = engine.kv.cell_bytes
    assert cell == cell_bytes(engine.model.config, next(engine.model.parameters()).dtype)
    cfg = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    prompts = [f"Q: {q}\nA:" for q in QUESTIONS[:6]]
    kv_budget = 2 * (max(engine.count_tokens(p) for p in prompts) + 6 + 2) * cell + cell
    assert engine.kv.row_columns(max(engine.count_tokens(p) for p in prompts), 6) * cell * 2 + cell == kv_budget

    def gen(prompt):
        (out,) = (yield Generate(prompt, cfg)).sequences
        return out.token_ids

    sched = Scheduler(engine, kv_budget=kv_budget, prefill_budget=budget, layout=layout)
    too_big = Task(None, "", program=gen("word " * 200))
    tasks = [Task(None, "", program=gen(p)) for p in prompts]
    sched._inbox.extend([tasks[0], too_big, *tasks[1:]])
    peak_rows = peak_bytes = 0
    while not all(t.done for t in tasks):
        sched.step()
        peak_rows = max(peak_rows, sum(loop.size for loop in sched.admission.loops.values()))
        peak_bytes = max(peak_bytes, sched.kv_bytes)
    assert 1 <= peak_rows <= 2  # the others waited for room
    assert 0 < peak_bytes <= kv_budget
    assert isinstance(too_big.error, InputError) and "KV cache" in str(too_big.error)
    assert [t.error for t in tasks] == [None] * 6
    assert [t.result for t in tasks] == [engine.generate([p], cfg).sequences[0].token_ids for p in prompts]
    assert sched.kv_bytes == 0 and sched.idle  # nothing is held after the burst


def test_a_store_that_must_grow_is_charged_what_it_holds_until_it_does(world):
    """A store of spare rows (5 x 200 for one row of 136 columns) and a generation joining that needs 202 columns:
    admission charged the growth's need (2 x 202) while the store kept its 1,000 cells for the prompt's chunked
    prefill, and the cells held went past the budget (1,100 of 1,001); it now charges the larger of the two. Answers
    are each generation's alone."""
    engine = world[0]
    cell = engine.kv.cell_bytes
    budget = 1001 * cell
    first, second = "x", "x" * 100
    assert (engine.count_tokens(first), engine.count_tokens(second)) == (1, 100)
    cfgs = [GenerationConfig(max_new_tokens=133, stop_at_eos=False), GenerationConfig(max_new_tokens=100,
                                                                                        stop_at_eos=False)]

    def gen(prompt, cfg):
        (out,) = (yield Generate(prompt, cfg)).sequences
        return out.token_ids

    sched = Scheduler(engine, kv_budget=budget, prefill_budget=16, layout="packed")
    tasks = [Task(None, "", program=gen(first, cfgs[0])), Task(None, "", program=gen(second, cfgs[1]))]
    sched._inbox.append(tasks[0])
    step = peak = 0
    while not all(t.done for t in tasks):
        if step == 3:
            sched._inbox.append(tasks[1])
        sched.step()
        step += 1
        peak = max(peak, sched.kv_bytes)
    assert tasks[1].error is None and 0 < peak <= budget
    assert [t.result for t in tasks] == [engine.generate([p], c).sequences[0].token_ids
                                         for p, c in zip((first, second), cfgs)]


def test_a_padded_loop_s_spare_and_a_chunked_prefill_stay_within_the_budget(world):
    """The padded layout: one row's cache grew to ~1,195 cells of spare within a 1,245-cell budget; a 250-token prompt
    joining was charged its final need while its chunked prefill ran beside that spare (1,435 cells held). Admission
    now charges what the rows' buffers hold and the prefills' own caches."""
    engine = world[0]
    budget = 1245 * engine.kv.cell_bytes
    arrivals = {3: ("x" * 174, 6), 8: ("x" * 250, 66), 15: ("x" * 6, 30)}

    def gen(prompt, cfg):
        (out,) = (yield Generate(prompt, cfg)).sequences
        return out.token_ids

    sched = Scheduler(engine, kv_budget=budget, prefill_budget=16, layout="padded")
    tasks, step, peak = {}, 0, 0
    while len(tasks) < len(arrivals) or not all(t.done for t in tasks.values()):
        if step in arrivals:
            prompt, new = arrivals[step]
            tasks[step] = Task(None, "", program=gen(prompt, GenerationConfig(max_new_tokens=new, stop_at_eos=False)))
            sched._inbox.append(tasks[step])
        sched.step()
        step += 1
        peak = max(peak, sched.kv_bytes)
    assert [t.error for t in tasks.values()] == [None] * 3 and 0 < peak <= budget
    assert [tasks[s].result for s in sorted(tasks)] == [
        engine.generate([p], GenerationConfig(max_new_tokens=n, stop_at_eos=False)).sequences[0].token_ids
        for p, n in (arrivals[s] for s in sorted(arrivals))]


def test_a_padded_loop_s_finished_rows_count_until_they_leave_its_buffers(world):
    """Fan-out rows under a tight budget (padded layout): a row that had finished still held its place in the buffers
    when a join merged into them, and admission counted only the unfinished rows (1,840 of 1,663 cells)."""
    engine = world[0]
    budget = 1663 * engine.kv.cell_bytes
    arrivals = [(0, 164, 31, 2), (1, 111, 90, 1), (15, 234, 135, 2), (15, 88, 81, 2)]

    def gen(prompt, cfg, k):
        return (yield Generate(prompt, cfg, k=k)).sequences

    sched = Scheduler(engine, kv_budget=budget, prefill_budget=None, layout="padded")
    tasks, step, peak = [], 0, 0
    while len(tasks) < len(arrivals) or not all(t.done for t in tasks):
        for at, n, new, k in arrivals:
            if at == step:
                cfg = GenerationConfig(max_new_tokens=new, stop_at_eos=False)
                tasks.append(Task(None, "", program=gen("x" * n, cfg, k)))
                sched._inbox.append(tasks[-1])
        sched.step()
        step += 1
        peak = max(peak, sched.kv_bytes)
    assert [t.error for t in tasks] == [None] * 4 and 0 < peak <= budget


def test_whole_prompts_batched_under_a_kv_budget_hold_no_more_cells_than_it_allows(world, monkeypatch):
    """Fresh prompts prefilled whole in one batched pass (CUDA's path, forced on a CPU) keep their padded batch as
    their buffers while the store grows for them: admission counts a queued prompt at up to WHOLE_PADDING its
    length, and the store's growth leaves room for the padded batch, so that the store, the batch and the prompts
    still queued stay within the budget at every join; each answer is its generation alone."""
    from fastgate.engine import packed

    engine = world[0]
    monkeypatch.setattr(engine.runner, "batch_prefill", True)
    cfg = GenerationConfig(max_new_tokens=4, stop_at_eos=False)
    # lengths apart by up to a third: batched whole (padding within WHOLE_PADDING), and padded
    prompts = [f"Q: {w}{' and ' + v if i % 2 else ''}?\nA:" for i, (w, v) in enumerate(
        (w, v) for w in ("red", "blue", "green") for v in ("cats and dogs", "mice"))]
    longest = max(engine.count_tokens(p) for p in prompts)
    cell = engine.kv.cell_bytes
    sched = Scheduler(engine, kv_budget=3 * engine.kv.row_columns(longest, 4) * cell + 2 * longest * cell,
                      prefill_budget=None, layout="packed")
    max_cells = sched.admission._max_cells
    joins = []
    original = packed.PackedLoop._enter_batch

    def measured(self, ending, logits, pre, kv):
        original(self, ending, logits, pre, kv)
        held = kv[0][0].shape[0] * kv[0][0].shape[2]  # the padded batch, alive until the pass ends
        joins.append(self.store.rows_cap * self.store.cols_cap + held + sum(len(j.ids) for j in self.prefilling))

    monkeypatch.setattr(packed.PackedLoop, "_enter_batch", measured)

    def gen(prompt):
        (out,) = (yield Generate(prompt, cfg)).sequences
        return out.token_ids

    tasks = [Task(None, "", program=gen(p)) for p in prompts]
    sched._inbox.extend(tasks)
    while not all(t.done for t in tasks):
        sched.step()
    assert joins, "no pass of whole prompts was batched"
    assert max(joins) <= max_cells
    monkeypatch.setattr(engine.runner, "batch_prefill", False)
    assert [t.error for t in tasks] == [None] * len(tasks)
    assert [t.result for t in tasks] == [engine.generate([p], cfg).sequences[0].token_ids for p in prompts]


def test_a_sliding_window_model_runs_padded_closed_calls_and_answers_as_alone():
    """Gemma-3's sliding-window layers cannot take rows into a running loop: the scheduler chooses closed calls
    (and refuses a packed layout clearly), and each generation equals its own."""
    from fastgate.engine.local import Engine
    from fastgate.engine.packed import packable
    from fastgate.testing import tiny_gemma3

    engine = Engine(tiny_gemma3())
    assert not packable(engine)
    with pytest.raises(InputError, match="cannot run packed"):
        Scheduler(engine, layout="packed")
    with pytest.raises(InputError, match="layout must be"):
        Scheduler(engine, layout="sideways")
    sched = Scheduler(engine)
    assert sched.layout == "padded" and not sched.continuous
    cfg = GenerationConfig(max_new_tokens=12, stop_at_eos=False)  # past the window of 8

    def gen(q):
        (out,) = (yield Generate(f"Q: {q}\nA:", cfg)).sequences
        return out.token_ids

    tasks = [Task(None, "", program=gen(q)) for q in QUESTIONS[:3]]
    sched.run([sched._inbox.append(t) or t for t in tasks])
    assert [t.result for t in tasks] == [engine.generate([f"Q: {q}\nA:"], cfg).sequences[0].token_ids
                                         for q in QUESTIONS[:3]]


@pytest.mark.parametrize("order", ["program", "arrival"])
def test_prefill_order_puts_the_oldest_requests_prompt_first(world, order):
    engine = world[0]
    with pytest.raises(InputError, match="prefill_order must be"):
        Scheduler(engine, prefill_order="sideways")
    sched = Scheduler(engine, admit_every=1, prefill_budget=4, layout="packed", prefill_order=order)  # queued
    cfg = GenerationConfig(max_new_tokens=2, stop_at_eos=False)

    def gate_then_rag(q):  # a short generation, then a long prompt (a gate, then its RAG answer)
        yield Generate(q, cfg)
        (out,) = (yield Generate("omega " * 30 + q, cfg)).sequences
        return out.token_ids

    def one(q):  # no prefix shared with the other prompt: the prefix cache does not skip the queue
        (out,) = (yield Generate("alpha " * 30 + q, cfg)).sequences
        return out.token_ids

    old = Task(None, "", program=gate_then_rag("Hi"))
    sched._inbox.append(old)
    sched.step()
    new = Task(None, "", program=one(QUESTIONS[1]))  # its long prompt is queued before the old one's second
    sched._inbox.append(new)
    sched.step()
    assert [job.ticket.owner[0] for job in sched.admission.loops[engine.n_layers // 2].prefilling] == [new]
    (loop,) = sched.admission.loops.values()
    for _ in range(20):
        if len(loop.prefilling) == 2:
            break
        sched.step()
    queued = [job.ticket.owner[0] for job in loop.prefilling]
    assert queued == ([old, new] if order == "program" else [new, old])
    sched.run([old, new])
    assert old.error is None and new.error is None


def test_a_step_prefills_the_decoding_budget_while_rows_decode(world):
    """``decoding_prefill_budget``: the smaller chunk only while some row decodes, the whole budget otherwise; it never
    raises the budget, and bad values are refused."""
    from fastgate.engine.packed import PackedLoop

    engine = world[0]
    sched = Scheduler(engine, continuous=True, prefill_budget=48, decoding_prefill_budget=16)
    admission = sched.admission
    loop = PackedLoop(engine.runner, mid=engine.n_layers // 2)
    assert admission.step_budget(loop) == 48  # nothing decoding
    cfg = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    loop.admit([("Q: Who wrote Hamlet?\nA:", cfg, TapSpec(), 1, None)])
    while not loop.rows:
        loop.step(prefill_budget=admission.step_budget(loop))
    assert admission.step_budget(loop) == 16  # a row decodes
    assert Scheduler(engine, prefill_budget=8, decoding_prefill_budget=16).admission.step_budget(loop) == 8
    assert Scheduler(engine, prefill_budget=48).admission.step_budget(loop) == 48
    with pytest.raises(InputError, match="decoding_prefill_budget"):
        Scheduler(engine, prefill_budget=48, decoding_prefill_budget=-1)
    with pytest.raises(InputError, match="needs a prefill_budget"):
        Scheduler(engine, prefill_budget=0, decoding_prefill_budget=16)


def test_the_decode_step_passes_the_decoding_budget_to_the_loop(world, monkeypatch):
    """The scheduler's steps ask the loop for ``decoding_prefill_budget`` tokens while rows decode."""
    from fastgate.engine.packed import PackedLoop

    engine = world[0]
    asked = []
    original = PackedLoop.step

    def recording(self, prefill_budget=None):
        asked.append((prefill_budget, any(not row.final for row in self.rows)))
        return original(self, prefill_budget)

    monkeypatch.setattr(PackedLoop, "step", recording)
    sched = Scheduler(engine, continuous=True, prefill_budget=48, decoding_prefill_budget=16)
    cfg = GenerationConfig(max_new_tokens=6, stop_at_eos=False)

    def ask(prompt):
        yield Generate(prompt, cfg)
        return "done"

    tasks = [Task(None, "", program=ask(p)) for p in ("Who wrote Hamlet? " * 6, "Capital of France? " * 6)]
    sched._inbox.extend(tasks)
    sched.run(tasks)
    assert all(t.result == "done" for t in tasks)
    assert asked and all(budget == (16 if decoding else 48) for budget, decoding in asked)
    assert any(decoding for _, decoding in asked)


def _gen_program(prompt: str, n: int):
    (out,) = (yield Generate(prompt, GenerationConfig(max_new_tokens=n, stop_at_eos=False))).sequences
    return out.token_ids


@pytest.mark.parametrize(("interject", "long_new"), [(8, 4), (8, 40), (1, 4)])
def test_a_short_generation_arriving_during_a_long_pass_runs_inside_it(world, interject, long_new):
    """A request submitted while a pass prefills a long prompt (here: at the pass's first pause) is started, and its
    short generation runs to its end in the lane, before the pass ends; its tokens and the long one's are their alone
    tokens. With more live programs than ``interject`` it waits for the next tick as before."""
    engine = world[0]
    assert engine.runner.fused is not None  # the pause lives in the fused forward
    sched = Scheduler(engine, prefill_budget=512, express_prefill=64, interject=interject)
    long_prompt = "Q: " + " ".join(f"word{i}" for i in range(120)) + "\nA:"
    assert engine.count_tokens(long_prompt) >= 128  # a pass that pauses (PAUSE_TOKENS)
    short_prompt = f"Q: {QUESTIONS[1]}\nA:"
    fed, pauses = [], []

    def feed():  # the server's queue: one request arrives during the long prompt's pass
        pauses.append(sched.admission.loops and next(iter(sched.admission.loops.values())).busy)
        if not fed:
            fed.append(sched.submit(None, "", program=_gen_program(short_prompt, 3)))

    sched.feed = feed
    long = sched.submit(None, "", program=_gen_program(long_prompt, long_new))
    sched.step()  # the long prompt's pass
    assert fed and len(pauses) >= engine.n_layers - 1  # every layer boundary of the pass paused
    short = fed[0]
    if interject == 1:  # two programs live: no interjection
        assert not short.done and sched.admission.lane is None
    else:
        assert short.done and not long.done and short.error is None
        assert sched.admission.lane is not None and not sched.admission.lane.busy
    sched.run([long, short])
    alone = [engine.generate([p], GenerationConfig(max_new_tokens=n, stop_at_eos=False)).sequences[0].token_ids
             for p, n in ((long_prompt, long_new), (short_prompt, 3))]
    assert long.result == alone[0] and short.result == alone[1]
    assert not sched.admission.busy and sched.idle


def test_interject_off_never_pauses_a_pass(world):
    engine = world[0]
    sched = Scheduler(engine, prefill_budget=512)
    assert sched.config.interject == 0 and sched.admission.pause is None
    called = []
    sched.feed = lambda: called.append(1)
    long = sched.submit(None, "", program=_gen_program("Q: " + " ".join(f"w{i}" for i in range(150)) + "\nA:", 2))
    sched.run([long])
    assert not called and long.error is None
    with pytest.raises(InputError, match="interject must be >= 0"):
        Scheduler(engine, interject=-1)


def test_the_lane_keeps_within_the_kv_budget(world):
    """A short generation arriving during a pass joins the lane only if the KV budget holds it beside what the loops
    hold; here the long generation takes the whole budget, so it waits, and is answered after as alone."""
    engine = world[0]
    long_prompt = "Q: " + " ".join(f"word{i}" for i in range(120)) + "\nA:"
    adm = Scheduler(engine).admission
    ask = (adm.kv.prompt_tokens(engine.count_tokens(long_prompt), 4), 1, 4)
    budget = adm._empty_loop.cells_after([ask]) * adm._cell  # bytes: the long generation alone
    sched = Scheduler(engine, prefill_budget=512, express_prefill=64, interject=8, kv_budget=budget)
    short_prompt = f"Q: {QUESTIONS[1]}\nA:"
    fed = []
    sched.feed = lambda: fed or fed.append(sched.submit(None, "", program=_gen_program(short_prompt, 3)))
    long = sched.submit(None, "", program=_gen_program(long_prompt, 4))
    sched.step()
    short = fed[0]
    assert not short.done and not sched.admission.lane_busy  # no room: it waits for the long one's rows
    sched.run([long, short])
    alone = [engine.generate([p], GenerationConfig(max_new_tokens=n, stop_at_eos=False)).sequences[0].token_ids
             for p, n in ((long_prompt, 4), (short_prompt, 3))]
    assert long.result == alone[0] and short.result == alone[1]


def test_an_interjected_program_cancelled_mid_pass_ends_at_the_next_pause(world, monkeypatch):
    """A program started at a pause and cancelled before its generation ends (here the lane gets no time at a pause,
    so its rows wait) ends at the next pause with CancelledError, and its lane rows stop at that pause (only the
    lane's: the main loops are inside the paused pass), not at the next tick; the long one is untouched."""
    import fastgate.scheduler.driver as driver

    monkeypatch.setattr(driver, "_INTERJECT_S", 0.0)  # the lane joins at a pause, steps only at ticks
    engine = world[0]
    sched = Scheduler(engine, prefill_budget=512, express_prefill=64, interject=8)
    long_prompt = "Q: " + " ".join(f"word{i}" for i in range(120)) + "\nA:"
    calls, lane_at = [], []

    def feed():
        calls.append(1)
        lane_at.append(sched.admission.lane_busy)
        if len(calls) == 1:
            calls.append(sched.submit(None, "", program=_gen_program(f"Q: {QUESTIONS[1]}\nA:", 3)))
        elif len(calls) == 3:
            sched.cancel(calls[1])

    sched.feed = feed
    long = sched.submit(None, "", program=_gen_program(long_prompt, 4))
    sched.step()
    short = calls[1]
    assert short.done and isinstance(short.error, CancelledError)
    assert lane_at[1] and not any(lane_at[2:]), lane_at  # in the lane at the second pause, gone from the third
    sched.run([long])
    assert long.result == engine.generate([long_prompt], GenerationConfig(max_new_tokens=4, stop_at_eos=False)
                                          ).sequences[0].token_ids
    assert not sched.admission.busy


class _ResultFails:
    """A method whose result cannot be built for one question (its program runs as the real method's)."""

    def __init__(self, method, question: str) -> None:
        self._method, self._question = method, question

    def __getattr__(self, name):
        return getattr(self._method, name)

    def result(self, question, *args, **kwargs):
        if question == self._question:
            raise ValueError("this result cannot be built")
        return self._method.result(question, *args, **kwargs)


def test_a_result_that_cannot_be_built_or_a_raising_on_done_ends_only_its_own_question(methods, caplog):
    """Building a program's result is the program's: when it raises, that question ends with the error and the
    others are answered. A caller's ``on_done`` that raises is logged; the scheduler and the other programs go on."""
    never = methods[0]
    broken = _ResultFails(never, QUESTIONS[1])
    sched = Scheduler(never.engine)
    told = []

    def raising(task):
        told.append(task)
        raise RuntimeError("the caller's callback failed")

    tasks = [sched.submit(broken, q, on_done=raising if i == 2 else told.append) for i, q in enumerate(QUESTIONS[:4])]
    with caplog.at_level("ERROR", logger="fastgate.scheduler.driver"):
        sched.run(tasks)
    assert isinstance(tasks[1].error, ValueError) and tasks[1].result is None
    for i in (0, 2, 3):
        assert tasks[i].error is None and tasks[i].result.answer == never.answer(QUESTIONS[i]).answer
    assert {id(t) for t in told} == {id(t) for t in tasks}  # every on_done was called once the program ended
    assert "on_done" in caplog.text and "the caller's callback failed" in caplog.text
    assert sched.idle


def test_a_paused_pass_is_not_charged_the_time_of_its_pauses(world, monkeypatch):
    """The time a long pass spends paused (the interjected programs' lane steps, here a clock that jumps 100 s during
    the first pause) is not counted in its rows' ``generation_s``."""
    import time as real_time

    import fastgate.scheduler.admission as admission

    jump = [0.0]

    class Clock:  # admission's clock only: the driver's lane deadline keeps the real one
        @staticmethod
        def perf_counter():
            return real_time.perf_counter() + jump[0]

    monkeypatch.setattr(admission, "time", Clock)
    engine = world[0]
    sched = Scheduler(engine, prefill_budget=512, express_prefill=64, interject=8)
    long_prompt = "Q: " + " ".join(f"word{i}" for i in range(120)) + "\nA:"
    sched.feed = lambda: jump.__setitem__(0, 100.0)
    long = sched.submit(None, "", program=_gen_program(long_prompt, 2))
    sched.step()  # the long prompt's pass, which pauses between its layers
    assert jump[0] == 100.0 and sched.admission.paused_s >= 100.0
    sched.run([long])
    assert long.error is None
    assert 0.0 < long.trace.timings["generation_s"] < 100.0  # without the pause's time taken out: >= 100


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_cancelled_generation_frees_its_cache_without_another_step(world, layout):
    """A generation cancelled mid-decode (its request timed out, its client went away) ends at the next tick, and
    the loop's cache goes with it then: a server left with no live program takes no further step, and an idle loop
    holds no cache."""
    engine = world[0]
    sched = Scheduler(engine, layout=layout)
    task = sched.submit(None, "", program=_gen_program(f"Q: {QUESTIONS[1]}\nA:", 40))
    for _ in range(3):
        sched.step()
    assert not task.done and sched.admission.kv_bytes > 0
    sched.cancel(task)
    sched.step()
    assert isinstance(task.error, CancelledError) and sched.idle
    assert sched.admission.kv_bytes == 0 and not sched.admission.busy
    again = sched.submit(None, "", program=_gen_program(f"Q: {QUESTIONS[1]}\nA:", 3))  # the loop still serves
    sched.run([again])
    assert again.result == engine.generate([f"Q: {QUESTIONS[1]}\nA:"], GenerationConfig(
        max_new_tokens=3, stop_at_eos=False)).sequences[0].token_ids


def test_answer_checks_the_questions_as_answer_batch_does(tiny_engine):
    """A string was answered as its characters, an empty question as an empty prompt, None raised AttributeError."""
    from fastgate.methods import build_method

    method = build_method("never", tiny_engine)
    sched = Scheduler(tiny_engine)
    for questions, message in [("ab", "not a string"), ([""], "empty"), ([None], "must be a string"),
                               ([], "no questions")]:
        with pytest.raises(InputError, match=message):
            sched.answer(method, questions)
    assert sched.idle and sched.answer(method, ["  Who wrote Hamlet? "])[0].question == "Who wrote Hamlet?"


@pytest.mark.parametrize("continuous", [True, False], ids=["decode-loop", "closed-calls"])
def test_a_generation_of_more_rows_than_max_rows_is_refused_and_the_others_run(world, continuous):
    """In a bounded scheduler (a KV budget: the service's) ``max_rows`` bounds the sequences decoding at once, one
    large request too: a generation of 16 samples joining an empty loop was taken whole (16 rows a step under
    ``max_rows=4``; a request's SeaKR samples may be 1024). It ends with the InputError of a generation that cannot
    fit the KV budget alone (422 over HTTP), naming both counts; the generations within the bound run beside it, as
    alone, and no step holds more rows than the bound. An unbounded scheduler (the library's batch runs, whose caller
    chose the samples) runs it alone."""
    engine = world[0]
    sched = Scheduler(engine, max_rows=4, continuous=continuous, kv_budget=1 << 30)
    cfg = GenerationConfig(max_new_tokens=4, do_sample=True, stop_at_eos=False)

    def gen(k):
        out = yield Generate(f"Q: {QUESTIONS[0]}\nA:", cfg, k=k, seed=1)
        return [s.token_ids for s in out.sequences]

    big, full, small = (sched.submit(None, "", program=gen(k)) for k in (16, 4, 2))
    sched.run([big, full, small])
    assert isinstance(big.error, InputError) and big.result is None
    assert "16 rows" in str(big.error) and "max_rows=4" in str(big.error)
    assert full.error is None and small.error is None
    assert [len(full.result), len(small.result)] == [4, 2]
    alone = engine.generate([f"Q: {QUESTIONS[0]}\nA:"], cfg, k=4, seeds=[1]).sequences
    assert full.result == [s.token_ids for s in alone]
    assert max(sched.generation_rows) <= 4 and sched.idle
    unbounded = Scheduler(engine, max_rows=4, continuous=continuous)
    big = unbounded.submit(None, "", program=gen(16))
    unbounded.run([big])
    assert big.error is None and len(big.result) == 16


def _answer_program(prompt: str, n: int):
    (out,) = (yield Generate(prompt, GenerationConfig(max_new_tokens=n, stop_at_eos=False), answer=True)).sequences
    return out.text


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_streamed_answer_keeps_no_state_once_delivered_or_cancelled(world, layout):
    """A streamed answer's entry (its ticket, task and the client's listener) goes when the generation is delivered,
    or stopped by a cancellation, not at the next decode step of some loop: an idle server has none, and it held
    them until the next request."""
    engine = world[0]
    sched = Scheduler(engine, layout=layout)
    events = []
    task = sched.submit(None, "", listener=events.append, program=_answer_program(f"Q: {QUESTIONS[1]}\nA:", 6))
    sched.step()
    assert sched.admission._streams  # streaming while it decodes
    sched.run([task])
    assert task.error is None and events[-1] == {"event": "answer", "text": task.result, "stop": [], "done": True}
    assert sched.idle and sched.admission._streams == {}
    cancelled = sched.submit(None, "", listener=events.append,
                             program=_answer_program(f"Q: {QUESTIONS[2]}\nA:", 40))
    for _ in range(3):
        sched.step()
    assert sched.admission._streams
    sched.cancel(cancelled)
    sched.step()
    assert isinstance(cancelled.error, CancelledError) and sched.idle and sched.admission._streams == {}
