"""The static decode step (fastgate.engine.static_step) on the tiny random Llama: traced whole (fullgraph), once per
bucket,
never reading the device from the host, and giving the eager packed pass's greedy tokens, taps and states."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from test_decode import _same  # the loops' comparison: tokens, text, log-probs within 1e-4, taps
from torch.utils._python_dispatch import TorchDispatchMode

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.model_runner import ModelRunner
from fastgate.engine.packed import PackedLoop
from fastgate.engine.static_step import (
    CDF_BLOCK,
    TOP_K_MAX,
    StaticStep,
    StepConfig,
    batch_bucket,
    cdf_count,
    choose,
    covers,
    uniform,
    width_bucket,
)
from fastgate.errors import InputError

G = GenerationConfig
GREEDY = [  # (prompt, config, taps, k, seed): lengths, stops and taps differ
    ("Q: What is the capital of France?\nA:", G(max_new_tokens=12, stop_at_eos=False), TapSpec(layers=(1,)), 1, None),
    ("Hi", G(max_new_tokens=3, stop_at_eos=False), TapSpec(), 1, None),
    ("The quick brown fox jumps over", G(max_new_tokens=9, stop_at_eos=False),
     TapSpec(layers=(0, 1, 2), eos_state=True), 2, None),
    ("Berlin is the capital of", G(max_new_tokens=5, stop=(" ",)), TapSpec(pre_answer=True, eos_state=True), 1, None),
]
SAMPLED = [
    ("🙂 naïve café", G(max_new_tokens=10, do_sample=True, top_k=20, top_p=0.9, temperature=0.7),
     TapSpec(layers=(2,)), 3, 11),
    ("Once upon a time", G(max_new_tokens=7, do_sample=True), TapSpec(), 2, 5),  # top-k 0: the whole vocabulary
]


class _Counting:
    """A torch.compile backend that counts the graphs it is given (every compile and recompile) and runs them as
    traced (no code generation: the suite stays fast; tracing is what fullgraph and the guards are about)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _run(runner, specs, joins=(), steps_between=2):
    """Admit ``specs``, then after ``steps_between`` steps each block of ``joins``; run to the end."""
    loop = PackedLoop(runner, mid=runner.n_layers // 2)
    results = {}

    def step():
        for t in loop.step():
            results[t.owner] = t.result

    loop.add(specs, owners=list(range(len(specs))))
    n = len(specs)
    for block in joins:
        for _ in range(steps_between):
            step()
        loop.add(block, owners=list(range(n, n + len(block))))
        n += len(block)
    while loop.busy:
        step()
    return results, loop


@pytest.fixture(scope="module")
def tiny():
    """Two layers: tracing costs seconds a layer, and two are enough for the taps (layers 0, 1, 2) and a mid layer."""
    from fastgate.testing import tiny_model

    return tiny_model(n_layers=2)


@pytest.fixture(scope="module")
def counting():
    return _Counting()


@pytest.fixture(scope="module")
def compiled_runner(tiny, counting):
    return ModelRunner(tiny, step=StepConfig("compiled", backend=counting))


def test_buckets_and_config():
    assert [batch_bucket(m) for m in (1, 2, 3, 5, 17, 64, 65, 128, 129)] == [1, 2, 4, 8, 32, 64, 128, 128, 256]
    assert [width_bucket(w) for w in (1, 64, 65, 600, 1024, 1025)] == [64, 64, 128, 1024, 1024, 2048]
    with pytest.raises(InputError, match="auto, eager or compiled"):
        StepConfig("fast")
    assert not ModelRunner.__init__.__defaults__[-1] == "compiled"  # auto by default
    assert covers(G()) and covers(G(do_sample=True)) and covers(G(do_sample=True, top_k=TOP_K_MAX))
    assert not covers(G(do_sample=True, top_k=TOP_K_MAX + 1)) and not covers(G(do_sample=True, top_p=0.5))


_CACHE_PROBE = """
import os, sys
if sys.argv[1] == "dynamo-first":  # as when transformers or another library imported it before fastgate
    import torch._dynamo
from fastgate.engine.model_runner import ModelRunner
from fastgate.engine.static_step import StepConfig
from fastgate.testing import tiny_model
from torch._inductor.runtime.cache_dir_utils import cache_dir

runner = ModelRunner(tiny_model(n_layers=1), step=StepConfig("compiled"))
step = runner.static_step(0)
print(cache_dir(), step.cache_dir, sep="\\n")
"""


@pytest.mark.parametrize("order", ["fastgate-first", "dynamo-first"])
def test_compiled_kernels_are_cached_under_fastgate_home_unless_the_user_chose(tmp_path, order):
    """In a fresh interpreter (importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to torch's /tmp default, which
    fastgate took for the user's choice): the compiled step's kernels go to ``$FASTGATE_HOME/compile``, where inductor
    looks them up (its ``cache_dir()``); a directory the user set stays theirs."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["FASTGATE_HOME"] = str(tmp_path / "home")
    run = [sys.executable, "-c", _CACHE_PROBE, order]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300, check=True).stdout.split()
    assert out == [str(tmp_path / "home" / "compile")] * 2
    if order == "fastgate-first":  # (a user's directory, set before torch._dynamo set its own: the other order's case)
        return
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300, check=True).stdout.split()
    assert out == [str(tmp_path / "mine")] * 2


def test_auto_is_eager_on_cpu(tiny):
    runner = ModelRunner(tiny)
    assert not runner.compiled and runner.static_step(2) is None
    assert PackedLoop(runner, mid=2).static is None


def test_greedy_rows_equal_the_eager_packed_pass(tiny, compiled_runner):
    """Rows joining and leaving a loop run by the static step give the eager pass's tokens, log-probs, running sums,
    counts, pre-answer and EOS states; most steps ran in the static step."""
    eager, _ = _run(ModelRunner(tiny, step="eager"), GREEDY[:2], joins=[GREEDY[2:]])
    got, loop = _run(compiled_runner, GREEDY[:2], joins=[GREEDY[2:]])
    assert sorted(got) == sorted(eager) == [0, 1, 2, 3]
    for i in eager:
        _same(got[i], eager[i])
    assert loop.static_steps >= 10 and loop.static.compiled and not loop.static.eager_buckets  # all traced
    assert not loop.rows and not loop.busy


@pytest.mark.parametrize("sampled", [False, True])
def test_rows_asking_top_logprobs_draw_as_without_them(tiny, compiled_runner, sampled):
    """A row that wants each step's top log-probs makes the passes it is in eager (the alternatives are read from
    their logits) and is drawn as the static step draws it: the same tokens as without them (a seeded sampled row was
    drawn by the eager loop's sampler, other tokens), the eager runner's alternatives."""
    def asking(top):
        cfg = G(max_new_tokens=6, do_sample=sampled, top_k=20, top_logprobs=top, stop_at_eos=False)
        return [("The capital of France is", cfg, TapSpec(), 1, 7)]

    plain, _ = _run(compiled_runner, GREEDY[:2] + asking(0))
    got, loop = _run(compiled_runner, GREEDY[:2] + asking(3))
    assert [got[i].sequences[0].token_ids for i in got] == [plain[i].sequences[0].token_ids for i in plain]
    seq = got[2].sequences[0]
    assert len(seq.top_logprobs) == 6 and got[0].sequences[0].top_logprobs is None
    assert all(dict(step).get(t, lp) == lp for t, lp, step in zip(seq.token_ids, seq.token_logprobs, seq.top_logprobs))
    if not sampled:  # the eager runner's alternatives (a sampled row's draw is the static step's, not the eager loop's)
        eager, _ = _run(ModelRunner(tiny, step="eager"), GREEDY[:2] + asking(3))
        assert seq.top_logprobs == eager[2].sequences[0].top_logprobs
    assert loop.static_steps == 0 or all(not r.cfg.top_logprobs for r in loop.rows)


def test_sampled_rows_are_reproducible_and_independent_of_the_batch(tiny, compiled_runner):
    """A sampled row draws from its own seed and token index: the same tokens alone or beside other rows, greedy or
    sampled, whichever pass (static step or eager, with a prompt chunk in it) made its logits; the taps still equal
    the eager loop's where the tokens are the same."""
    alone = {i: _run(compiled_runner, [spec])[0][0] for i, spec in enumerate(SAMPLED)}
    mixed, _ = _run(compiled_runner, GREEDY[:2] + SAMPLED[:1], joins=[SAMPLED[1:]])
    for i in range(len(SAMPLED)):
        got = mixed[2 + i]
        assert [s.token_ids for s in got.sequences] == [s.token_ids for s in alone[i].sequences]
        assert len({tuple(s.token_ids) for s in got.sequences}) > 1  # the k samples differ
    again, _ = _run(compiled_runner, GREEDY[:2] + SAMPLED[:1], joins=[SAMPLED[1:]])
    for i in mixed:
        assert [s.token_ids for s in again[i].sequences] == [s.token_ids for s in mixed[i].sequences]
    eager, _ = _run(ModelRunner(tiny, step="eager"), GREEDY[:2])
    for i in (0, 1):
        _same(mixed[i], eager[i])


def test_fifty_steps_recompile_nothing_inside_a_bucket(tiny, counting, compiled_runner):
    """50 steps with rows joining and finishing, greedy and sampled side by side: a step in a (batch, width) bucket
    the loop has run before traces nothing; on a CPU (symbolic sizes) a new bucket seldom does either."""
    loop = PackedLoop(compiled_runner, mid=compiled_runner.n_layers // 2)
    cfgs = [G(max_new_tokens=n, stop_at_eos=False) for n in (5, 8, 11)] + [
        G(max_new_tokens=6, do_sample=True, top_k=10, stop_at_eos=False),
        G(max_new_tokens=9, do_sample=True, temperature=0.5, stop_at_eos=False)]
    loop.add([(f"prompt {i} " * (1 + i % 3), cfgs[i % 5], TapSpec(layers=(1,)), 1, i) for i in range(3)])
    loop.step()  # the first bucket is traced here
    graphs, before = counting.graphs, counting.graphs
    seen = set(loop.static.buckets)
    for step in range(50):
        if loop.size < 3:  # keep three or four rows: the batch bucket stays 4
            loop.add([(f"join {step} " * (1 + step % 4), cfgs[step % 5], TapSpec(eos_state=step % 2 == 0), 1,
                       step)])
        buckets = set(loop.static.buckets)
        loop.step()
        if set(loop.static.buckets) == buckets:
            assert counting.graphs == graphs, f"step {step}: a bucket run before was traced again"
        graphs = counting.graphs
        seen |= set(loop.static.buckets)
    assert (4, 64) in seen and loop.static_steps >= 40
    assert counting.graphs - before <= len(seen)


@pytest.mark.parametrize(("hidden", "batches"), [(64, (2, 4, 8)), (48, (4, 8, 16))])
def test_a_first_bucket_equal_to_another_size_does_not_pin_the_graph_to_it(tiny, hidden, batches):
    """A CPU graph traced first at 2 rows of a model with 2 KV heads (the tiny model; qwen2.5-0.5b; 8 rows for
    Llama-3-8B), or at 4 rows beside the step's 4 rows of sampling settings (and 12 columns against a head of 12),
    serves the next buckets too, as any first bucket does (dynamo unified the equal sizes and compiled again: 2 and 3
    graphs)."""
    from fastgate.testing import tiny_model

    lm = tiny if hidden == 64 else tiny_model(n_layers=2, hidden=hidden)
    assert lm.model.config.num_key_value_heads == 2
    torch._dynamo.reset()  # as a fresh process traces: no sizes an earlier test's traces marked dynamic
    counting = _Counting()
    loop = PackedLoop(ModelRunner(lm, step=StepConfig("compiled", backend=counting)), mid=1)
    cfg = G(max_new_tokens=3, stop_at_eos=False)
    for n in batches:  # the rows finish together: no batch-1 step (batch 1 is a graph of its own)
        loop.add([(f"Question {i}?", cfg, TapSpec(), 1, None) for i in range(n)])
        while loop.busy:
            loop.step()
    assert {b for b, _ in loop.static.buckets} == set(batches)
    assert counting.graphs == 1


@pytest.mark.parametrize(("sizes", "graphs"), [("auto", 1), ("symbolic", 1), ("bucket", 3)])
def test_the_step_s_sizes_say_how_many_graphs_its_buckets_trace(tiny, sizes, graphs):
    """``StepConfig.sizes``: symbolic sizes (auto's) trace one graph for the buckets of 2, 4 and 8 rows; sizes
    fixed per bucket one each, with the same tokens; a bad value is an InputError at construction."""
    torch._dynamo.reset()
    counting = _Counting()
    runner = ModelRunner(tiny, step=StepConfig("compiled", backend=counting, sizes=sizes))
    loop = PackedLoop(runner, mid=1)
    cfg = G(max_new_tokens=3, stop_at_eos=False)
    eager = PackedLoop(ModelRunner(tiny, step="eager"), mid=1)
    for n in (2, 4, 8):  # the rows finish together: no batch-1 step
        specs = [(f"Question {i}?", cfg, TapSpec(), 1, None) for i in range(n)]
        for lp in (loop, eager):
            lp.add(specs)
        got, want = [], []
        while loop.busy:
            got += [s.token_ids for t in loop.step() for s in t.result.sequences]
        while eager.busy:
            want += [s.token_ids for t in eager.step() for s in t.result.sequences]
        assert got == want
    assert loop.static.symbolic == (sizes != "bucket") and loop.static_steps > 0
    assert counting.graphs == graphs
    with pytest.raises(InputError, match="sizes must be auto, bucket, symbolic, got 'dynamic'"):
        StepConfig("compiled", sizes="dynamic")


def test_a_bucket_past_the_kv_budget_steps_eagerly_without_regrowing_the_store(tiny):
    """Three rows (a bucket of 4) under a budget that holds them but not 4 rows at a bucket's width: the rows step
    eagerly in the store as the join made it. Growing it for the bucket anyway cut its width to the rows' need, past
    the budget, and moved every row again at each new column (12 moves, 220 cells of a 178-cell budget). With room
    for the bucket the step runs compiled."""
    cfg = G(max_new_tokens=30, stop_at_eos=False)
    specs = [(f"Question number {i} is asked here?", cfg, TapSpec(), 1, None) for i in range(3)]
    rows, _ = ModelRunner(tiny, step="eager").encode([s[0] for s in specs], [30] * 3)
    final = max(len(r) for r in rows) + 30

    def run(step, max_cells):
        loop = PackedLoop(ModelRunner(tiny, step=step), mid=1, max_cells=max_cells)
        loop.add(specs)
        tokens, held, moves, ptr = [], [], 0, loop.store.keys[0].data_ptr()
        while loop.busy:
            tokens += [s.token_ids for t in loop.step() for s in t.result.sequences]
            if loop.store.keys:
                moves += loop.store.keys[0].data_ptr() != ptr
                ptr = loop.store.keys[0].data_ptr()
                held.append(loop.store.rows_cap * loop.store.cols_cap)
        return tokens, max(held), moves, loop.static_steps

    tight = 3 * final + 10  # the three rows, not four at 64 columns
    want, _, _, _ = run("eager", tight)
    tokens, held, moves, static = run(StepConfig("compiled", backend="eager"), tight)
    assert tokens == want and held <= tight and moves == 0 and static == 0
    tokens, held, _, static = run(StepConfig("compiled", backend="eager"), 4 * 64)
    assert tokens == want and held <= 4 * 64 and static > 0


def test_aot_traced_step_equals_eager_and_traces_whole(tiny):
    """Traced through AOTAutograd (functionalized in-place writes to the store and the tap buffers, as inductor
    receives them), with fullgraph=True: the same greedy tokens and taps as the eager pass."""
    eager, _ = _run(ModelRunner(tiny, step="eager"), GREEDY[2:3])
    got, loop = _run(ModelRunner(tiny, step=StepConfig("compiled", backend="aot_eager")), GREEDY[2:3])
    for i in eager:
        _same(got[i], eager[i])
    assert loop.static_steps > 0 and loop.static.compiled


@pytest.mark.parametrize("sizes", ["bucket", "symbolic"])
def test_a_bucket_whose_compile_fails_runs_eagerly_and_the_others_stay_compiled(tiny, sizes):
    """The first graph the backend is given fails (as inductor's CUDA codegen did at 16 rows): that bucket runs the
    eager step, with one warning naming it; the tokens are the eager pass's throughout. With sizes per bucket the
    next bucket compiles; with symbolic sizes the later buckets of the failed graph (more than one row) run eagerly
    without compiling it again, while batch 1's own graph compiles."""
    calls = []

    def flaky(gm, example_inputs):
        calls.append(len(example_inputs))
        if len(calls) == 1:
            raise RuntimeError("codegen failed")
        return gm.forward

    torch._dynamo.reset()
    eager, _ = _run(ModelRunner(tiny, step="eager"), GREEDY[:2], joins=[GREEDY[2:3]])
    alone, _ = _run(ModelRunner(tiny, step="eager"), GREEDY[:1])
    runner = ModelRunner(tiny, step=StepConfig("compiled", backend=flaky, sizes=sizes))
    with pytest.warns(RuntimeWarning, match="that bucket's steps run eagerly") as caught:
        got, loop = _run(runner, GREEDY[:2], joins=[GREEDY[2:3]])
        got_alone, _ = _run(runner, GREEDY[:1])  # one row: batch 1's bucket (a graph of its own when symbolic)
    for i in eager:
        _same(got[i], eager[i])
    _same(got_alone[0], alone[0])
    static = loop.static
    rows = {b for b, _ in static.buckets}
    assert rows >= {1, 2, 4}, rows  # two rows, three after the join, then one alone: both graphs of symbolic sizes
    assert static.compiled and sum("run eagerly" in str(w.message) for w in caught) == 1
    if sizes == "bucket":
        assert len(static.eager_buckets) == 1 and static.eager_buckets < static.buckets  # one bucket fell back
        assert len(calls) >= 2  # the others compiled after it
    else:
        assert static.eager_buckets == {k for k in static.buckets if k[0] > 1}  # the failed graph's buckets
        assert len(calls) == 2  # the failed graph once, batch 1's graph once: no compile again per bucket


def test_an_allocation_failure_while_a_bucket_compiles_is_not_taken_for_a_compiler_failure(tiny):
    """A bucket's first call that runs out of memory (torch.compile reports it as a BackendCompilerFailed raised from
    the allocator's error) reaches the caller, which frees memory or fails the rows: no second compile, no bucket
    pinned eager, no warning; the next call compiles it."""
    from fastgate.errors import out_of_memory

    calls = []

    def short_of_memory(gm, example_inputs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError()  # torch.compile holds it in a BackendCompilerFailed (inner_exception, no __cause__)
        if len(calls) == 2:
            raise RuntimeError("codegen failed")  # then a real compiler failure at the same bucket's next first call
        return gm.forward

    torch._dynamo.reset()
    runner = ModelRunner(tiny, step=StepConfig("compiled", backend=short_of_memory))
    cfg = G(max_new_tokens=4, stop_at_eos=False)
    specs = [(f"Question {i}?", cfg, TapSpec(), 1, None) for i in range(2)]
    loop = PackedLoop(runner, mid=1)
    loop.add(specs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compile-failure warning would raise here instead of the allocation error
        with pytest.raises(Exception) as caught:
            while loop.busy:
                loop.step()
    assert out_of_memory(caught.value) and len(calls) == 1 and not loop.static.eager_buckets
    assert not loop.static.buckets  # its next call is a first call again
    want, _ = _run(ModelRunner(tiny, step="eager"), specs)
    with pytest.warns(RuntimeWarning, match="that bucket's steps run eagerly"):  # the compiler's failure falls back
        got, _ = _run(runner, specs)
    for i in want:
        _same(got[i], want[i])
    assert not out_of_memory(RuntimeError("codegen failed")) and out_of_memory(MemoryError())
    wrapped = RuntimeError("backend failed")
    wrapped.__cause__ = RuntimeError("DefaultCPUAllocator: can't allocate memory")
    assert out_of_memory(wrapped)
    held = RuntimeError("backend failed")
    held.inner_exception = MemoryError()  # torch._dynamo.exc.BackendCompilerFailed's way
    assert out_of_memory(held)


_HOST_READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "tolist"}


class _NoHostReads(TorchDispatchMode):
    """Fails on every op that reads a tensor's value back to the host (or copies it off a non-CPU device)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            raise AssertionError(f"host read inside the step: {func}")
        out = func(*args, **(kwargs or {}))
        if name in ("_to_copy", "copy_") and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            src = args[1] if name == "copy_" else args[0]
            if isinstance(src, torch.Tensor) and src.device.type != "cpu":
                raise AssertionError(f"device-to-host copy inside the step: {func}")
        return out


def test_the_step_never_reads_the_device_from_the_host(tiny):
    """The step's function, run eagerly under a dispatch mode that rejects ``item`` / ``_local_scalar_dense`` /
    ``nonzero`` and device-to-host copies, completes (and the mode does catch such a read)."""
    runner = ModelRunner(tiny, step=StepConfig("compiled", backend="eager"))
    calls = []

    class Checked(StaticStep):
        def __call__(self, *args):
            with _NoHostReads():
                calls.append(1)
                return super().__call__(*args)

    loop = PackedLoop(runner, mid=runner.n_layers // 2)
    loop.static = Checked(runner, runner.n_layers // 2, compiled=False)
    loop.add(GREEDY[:1] + SAMPLED[:1])
    while loop.busy:
        loop.step()
    assert len(calls) >= 5
    with pytest.raises(AssertionError, match="host read"), _NoHostReads():
        torch.ones(2).sum().item()


def test_choose_is_argmax_when_greedy_and_draws_within_top_k():
    torch.manual_seed(0)
    logits = torch.randn(5, 97)  # a prime vocabulary
    n = logits.shape[0]
    key = torch.arange(n, dtype=torch.long) * 7919
    draw = torch.full((n,), 3, dtype=torch.long)
    greedy, lp = choose(logits, torch.zeros(n, dtype=torch.bool), torch.ones(n), torch.zeros(n, dtype=torch.long),
                        torch.ones(n), key, draw)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, greedy[:, None])[:, 0])
    top3 = logits.topk(3, dim=-1).indices
    for d in range(40):  # every draw of a top-k 3 row is one of its three best tokens
        tok, _ = choose(logits, torch.ones(n, dtype=torch.bool), torch.ones(n), torch.full((n,), 3), torch.ones(n),
                        key, torch.full((n,), d))
        assert all(tok[r] in top3[r] for r in range(n))
    # one row alone draws what it draws in the batch
    alone, _ = choose(logits[2:3], torch.ones(1, dtype=torch.bool), torch.ones(1), torch.full((1,), 3), torch.ones(1),
                      key[2:3], draw[2:3])
    batch, _ = choose(logits, torch.ones(n, dtype=torch.bool), torch.ones(n), torch.full((n,), 3), torch.ones(n),
                      key, draw)
    assert alone[0] == batch[2]


def test_choose_draws_follow_the_distribution():
    """Over many keys, the frequency of each token of a 4-token distribution (whole vocabulary; and top-p 0.75,
    which drops the least likely) is its probability within 3 standard errors."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.10])
    n = 4000
    logits = probs.log().expand(n, -1).contiguous()
    key = torch.arange(n, dtype=torch.long)
    ones = torch.ones(n)
    tok, _ = choose(logits, torch.ones(n, dtype=torch.bool), ones, torch.zeros(n, dtype=torch.long), ones, key,
                    torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(tok, minlength=4).float() / n
    se = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() < 3 * se + 1e-3).all(), freq
    tok, _ = choose(logits, torch.ones(n, dtype=torch.bool), ones, torch.full((n,), 4), torch.full((n,), 0.8), key,
                    torch.zeros(n, dtype=torch.long))
    kept = probs[:3] / probs[:3].sum()
    freq = torch.bincount(tok, minlength=4).float() / n
    assert freq[3] == 0 and ((freq[:3] - kept).abs() < 3 * (kept * (1 - kept) / n).sqrt() + 1e-3).all(), freq


@pytest.mark.parametrize("v", [1, 7, CDF_BLOCK - 1, CDF_BLOCK, CDF_BLOCK + 1, 769, 49152])
def test_cdf_count_is_the_flat_cumsum_count(v):
    """The blocked inverse cdf counts what one cumsum over the vocabulary counts, for widths around the block and
    SmolLM2's 49,152: float64, u at 0, random, and halfway between two neighbouring cdf values (where only a wrong
    block offset, not rounding, could move the count)."""
    torch.manual_seed(v)
    probs = torch.rand(6, v, dtype=torch.float64).softmax(-1)  # [6, V]
    flat = probs.cumsum(-1)  # [6, V]
    u = torch.rand(6, 1, dtype=torch.float64) * 0.999
    u[0, 0] = 0.0
    for r, k in ((1, CDF_BLOCK), (2, v // 2), (3, v - 1)):  # a block's first token, the middle, the last
        if 0 < k < v:
            u[r, 0] = (flat[r, k - 1] + flat[r, k]) / 2
    assert torch.equal(cdf_count(probs, u), (flat <= u).sum(-1))
    sliced = torch.rand(6, 2 * v, dtype=torch.float64).softmax(-1)[:, ::2]  # non-contiguous rows
    assert torch.equal(cdf_count(sliced, u), (sliced.cumsum(-1) <= u).sum(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b", [1, 16, 64])
def test_choose_compiles_with_inductor_at_serving_shapes(b):
    """On a GPU: :func:`choose` compiled by inductor over a 49,152-token vocabulary (SmolLM2's) at the batch buckets
    that serve gives the eager tokens. One cumsum over the vocabulary failed to generate code at batch 16 and 64
    (torch 2.11), which sent those buckets of the compiled step to eager."""
    torch.manual_seed(b)
    logits = torch.randn(b, 49152, device="cuda") * 3  # [B, V]
    rows = torch.arange(b, device="cuda")
    args = (rows % 2 == 1, torch.full((b,), 0.7, device="cuda"), torch.where(rows % 4 == 3, 0, 50),
            torch.full((b,), 0.9, device="cuda"), rows * 7919 + 1, torch.full((b,), 3, device="cuda"))
    want = choose(logits, *args)
    got = torch.compile(choose, fullgraph=True, dynamic=False)(logits, *args)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


def test_uniform_is_deterministic_and_in_range():
    key = torch.arange(10_000, dtype=torch.long)
    u = uniform(key, torch.full_like(key, 5))
    assert torch.equal(u, uniform(key, torch.full_like(key, 5)))
    assert float(u.min()) >= 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02
    assert not torch.equal(u, uniform(key, torch.full_like(key, 6)))


def test_runtime_and_service_name_the_step(tiny):
    from fastgate.engine.local import Engine
    from fastgate.serving.runtime import Runtime
    from fastgate.serving.service import AnswerService as Service
    from fastgate.serving.service import ServiceConfig

    with pytest.raises(InputError, match="auto, eager or compiled"):
        Runtime("tiny", step="fast")
    assert Service(ServiceConfig(step="compiled"), runtime=Runtime(step="compiled")).step_name == "compiled"
    assert Service(ServiceConfig(), runtime=Runtime(device="cpu")).step_name == "eager"  # auto on a CPU
    engine = Engine(tiny, step=StepConfig("compiled", backend="eager"))
    assert Service(ServiceConfig(), runtime=Runtime(engine=engine)).step_name == "compiled"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sizes", ["auto", "bucket"])
def test_cuda_graph_step_gives_the_eager_greedy_tokens(sizes):
    """On a GPU: the step compiled by inductor with CUDA graphs (the default there; with symbolic sizes, auto's, two
    compiles and a graph captured per bucket; with fixed sizes a compile per bucket) gives the eager pass's greedy
    tokens and, within bf16-free float32 tolerance, its taps."""
    from fastgate.testing import tiny_model

    lm = tiny_model(n_layers=2)
    lm.model.to("cuda")
    eager, _ = _run(ModelRunner(lm, step="eager"), GREEDY)
    from torch._dynamo.utils import counters

    runner = ModelRunner(lm, step=StepConfig(sizes=sizes))  # auto: compiled on CUDA
    assert runner.compiled
    graphs = counters["stats"]["unique_graphs"]
    got, loop = _run(runner, GREEDY)
    for i in eager:
        _same(got[i], eager[i])
    static = loop.static
    assert loop.static_steps > 0 and static.compiled and static.cuda_graphs and not static.eager_buckets
    assert len(static._graphs) == len(static.buckets)  # a CUDA graph captured per bucket either way
    compiled = counters["stats"]["unique_graphs"] - graphs
    if sizes == "auto":  # symbolic sizes: two graphs at most (batch 1 is specialised), however many buckets ran
        assert static.symbolic and compiled <= 2 < len(static.buckets), (compiled, static.buckets)
    else:  # a graph per bucket
        assert not static.symbolic and compiled >= len(static.buckets) > 2, (compiled, static.buckets)
