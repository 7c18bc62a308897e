"""The decode loop on a tiny random Llama: rows joining a running loop and leaving it give what they give alone."""

from __future__ import annotations

import pytest
import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.decode import DecodeLoop, mergeable
from fastgate.engine.packed import PackedLoop, packable

G = GenerationConfig
CASES = [  # (prompt, config, taps, k, seed): lengths, stops, sampling and taps all differ
    ("Q: What is the capital of France?\nA:", G(max_new_tokens=12, stop_at_eos=False), TapSpec(layers=(1,)), 1, None),
    ("Hi", G(max_new_tokens=3, stop_at_eos=False), TapSpec(), 1, None),
    ("The quick brown fox jumps over", G(max_new_tokens=9, do_sample=True, temperature=0.8, top_k=20),
     TapSpec(layers=(0, 2), eos_state=True), 2, 7),
    ("Berlin is the capital of", G(max_new_tokens=5, stop=(" ",)), TapSpec(pre_answer=True, eos_state=True), 1, None),
    ("🙂 naïve café", G(max_new_tokens=16, do_sample=True, top_p=0.9), TapSpec(layers=(2,)), 3, 11),
]


def _alone(engine, spec):
    prompt, cfg, taps, k, seed = spec
    return engine.generate([prompt], [cfg], [taps], [k], [seed])


def _same(got, want):
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in want.sequences]
    assert [s.text for s in got.sequences] == [s.text for s in want.sequences]
    assert [s.finish_reason for s in got.sequences] == [s.finish_reason for s in want.sequences]
    for a, b in zip(got.sequences, want.sequences):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
    assert got.layers == want.layers
    for name in ("running_sum", "count", "pre_answer", "eos_state"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _loop(kind, engine):
    """A padded (:class:`DecodeLoop`) or packed (:class:`PackedLoop`) loop: every test holds for both layouts."""
    cls = DecodeLoop if kind == "padded" else PackedLoop
    return cls(engine, mid=engine.n_layers // 2)


LAYOUTS = pytest.mark.parametrize("kind", ["padded", "packed"])


@LAYOUTS
def test_rows_joining_mid_way_equal_their_generation_alone(tiny_engine, kind):
    assert mergeable(tiny_engine) and packable(tiny_engine)
    loop = _loop(kind, tiny_engine)
    results = {}

    def run(steps):
        for _ in range(steps):
            for t in loop.step():
                results[t.owner] = t.result

    loop.add(CASES[:2], owners=[0, 1])
    run(2)
    loop.add(CASES[2:3], owners=[2])  # joins rows two steps in, with a longer prompt
    run(4)
    assert 1 in results  # the 3-token row finished and left while the others run
    loop.add(CASES[3:], owners=[3, 4])
    while loop.busy:
        run(1)
    assert sorted(results) == [0, 1, 2, 3, 4]
    for i, spec in enumerate(CASES):
        _same(results[i], _alone(tiny_engine, spec))
    assert not loop.rows and loop.mask is None  # everything left: nothing is held


@LAYOUTS
@pytest.mark.parametrize("budget", [1, 7, 40])
def test_chunked_prefill_between_steps_equals_generation_alone(tiny_engine, budget, kind):
    """Prompts admitted for a chunked prefill (a few columns per step, beside running rows) give what they give
    alone, whatever the budget; the running rows keep decoding while they prefill."""
    loop = _loop(kind, tiny_engine)
    results = {}

    def run(steps):
        for _ in range(steps):
            for t in loop.step(prefill_budget=budget):
                results[t.owner] = t.result

    loop.admit(CASES[:2], owners=[0, 1])
    run(3)
    loop.admit(CASES[2:], owners=[2, 3, 4])
    first = loop.rows[0] if loop.rows else None
    decoded = len(first.tokens) if first is not None else 0
    run(2)
    assert first is None or first.final or len(first.tokens) > decoded  # decoding went on
    while loop.busy:
        run(1)
    assert sorted(results) == [0, 1, 2, 3, 4]
    for i, spec in enumerate(CASES):
        _same(results[i], _alone(tiny_engine, spec))
    assert not loop.rows and not loop.prefilling


def test_chunked_prefill_respects_the_budget_and_runs_the_shortest_first(tiny_engine):
    loop = DecodeLoop(tiny_engine, mid=tiny_engine.n_layers // 2)
    cfg = G(max_new_tokens=2, stop_at_eos=False)
    (long,) = loop.admit([("word " * 40, cfg, TapSpec(), 1, None)], owners=["long"])
    (short,) = loop.admit([("Hi there", cfg, TapSpec(), 1, None)], owners=["short"])
    assert loop.size == 2 and loop.busy
    assert loop._prefill_some(8) == 8  # the short prompt whole (fewer tokens left), then 8 - its length of the long
    assert short.rows and not long.rows  # the short one joined; the long one is still prefilling
    assert loop.prefilling[0].done == 8 - short.rows[0].prompt_len
    loop.cancel(long)
    while loop.busy:
        loop.step(prefill_budget=8)
    assert short.result is not None and long.result is None and not loop.prefilling


def test_packed_prefill_runs_the_lowest_priority_key_first_then_arrival(tiny_engine):
    loop = PackedLoop(tiny_engine, mid=tiny_engine.n_layers // 2)
    cfg = G(max_new_tokens=2, stop_at_eos=False)
    specs = {w: (f"{w} " * 12, cfg, TapSpec(), 1, None) for w in ("one", "two", "three", "four")}  # no shared prefix
    first, second = loop.admit([specs["one"], specs["two"]], owners=["first", "second"], priority=[5.0, 5.0])
    (older,) = loop.admit([specs["three"]], owners=["older"], priority=[1.0])  # asked last, by an older request
    (plain,) = loop.admit([specs["four"]], owners=["plain"])  # no key: 0.0, before all of them
    assert [job.ticket.owner for job in loop.prefilling] == ["plain", "older", "first", "second"]
    n = len(loop.prefilling[0].ids)
    loop.step(prefill_budget=n + 3)  # plain whole, then 3 tokens of the older request's prompt
    assert plain.rows and not older.rows and loop.prefilling[0].ticket is older and loop.prefilling[0].done == 3
    with pytest.raises(ValueError, match="2 keys for 1 prompts"):
        loop.admit([specs["one"]], priority=[1.0, 2.0])
    while loop.busy:
        loop.step(prefill_budget=n + 3)
    for ticket, word in ((first, "one"), (second, "two"), (older, "three"), (plain, "four")):
        _same(ticket.result, _alone(tiny_engine, specs[word]))


@pytest.mark.parametrize("express", [0, 8])
def test_packed_express_prefill_takes_short_prompts_first_within_half_the_budget(tiny_engine, express):
    loop = PackedLoop(tiny_engine, mid=tiny_engine.n_layers // 2, express_prefill=express)
    cfg = G(max_new_tokens=2, stop_at_eos=False)
    long_spec, short_spec = ("word " * 40, cfg, TapSpec(), 1, None), ("Hi there", cfg, TapSpec(), 1, None)
    (long,) = loop.admit([long_spec], owners=["long"], priority=[1.0])
    (short,) = loop.admit([short_spec], owners=["short"], priority=[2.0])  # a newer request's
    (other,) = loop.admit([("Hey you", cfg, TapSpec(), 1, None)], owners=["other"], priority=[3.0])
    n = len(loop.prefilling[1].ids)
    assert n <= express or not express
    assert [job.ticket.owner for job in loop._prefill_order(None)] == ["long", "short", "other"]  # whole: queue order
    budget = 2 * n + 1  # half of it holds one short prompt, not two
    loop.step(prefill_budget=budget)
    if express:  # the short prompt whole first, then the long one; the third short one waits (half the budget)
        assert short.rows and not long.rows and not other.rows
        assert next(job for job in loop.prefilling if job.ticket is long).done == budget - n
    else:  # the queue's order: the long prompt takes the whole budget
        assert not short.rows and not long.rows and loop.prefilling[0].done == budget
    while loop.busy:
        loop.step(prefill_budget=budget)
    _same(short.result, _alone(tiny_engine, short_spec))
    _same(long.result, _alone(tiny_engine, long_spec))


def test_express_prefill_counts_a_queued_prompt_after_its_cached_prefix(tiny):
    """A closed-book question after the cached few-shot block is a few tokens of work, not its whole length: it
    goes express before it starts (its cached prefix looked up, nothing computed), so a cheap request's prompt
    does not wait behind an older request's long one."""
    from fastgate.engine.local import Engine
    from fastgate.prompts import closed_book_prompt

    eng = Engine(tiny, prefix_cache=8)
    few = eng.cache_prefix(closed_book_prompt("x").rsplit("Q:", 1)[0])
    loop = PackedLoop(eng, mid=eng.n_layers // 2, express_prefill=16)
    cfg = G(max_new_tokens=2, stop_at_eos=False)
    long_spec = ("word " * 40, cfg, TapSpec(), 1, None)
    short_spec = (closed_book_prompt("Who wrote Hamlet?"), cfg, TapSpec(), 1, None)
    (long,) = loop.admit([long_spec], owners=["long"], priority=[1.0])
    (short,) = loop.admit([short_spec], owners=["short"], priority=[2.0])  # a newer request's
    job = next(j for j in loop.prefilling if j.ticket is short)
    assert len(job.ids) > 16 and job.left == len(job.ids) - few <= 16 and not job.started
    assert eng.runner.cached_prefix_len(job.ids) == few and eng.runner.cached_prefix_len(job.ids[:few]) == 0
    budget = 2 * job.left + 1
    job.cached = 0  # as if admitted before the block was cached: the queue looks it up again when it orders a pass
    assert job.left == len(job.ids)
    loop.step(prefill_budget=budget)
    assert short.rows and not long.rows  # express: whole in the first step, the long prompt after it
    while loop.busy:
        loop.step(prefill_budget=budget)
    _same(short.result, _alone(eng, short_spec))
    _same(long.result, _alone(eng, long_spec))


def test_packed_store_grows_once_for_the_prompts_already_queued(tiny_engine):
    """Six prompts queued at once join a few a step: the store's first growth makes room for all of them (it grew
    again at the sixth row: 5, then 9 rows), and every answer is its alone answer."""
    loop = PackedLoop(tiny_engine, mid=tiny_engine.n_layers // 2)
    cfg = G(max_new_tokens=40, stop_at_eos=False)  # every row still decoding when the last one joins
    specs = [(f"prompt number {i} " + "word " * (3 + 2 * i), cfg, TapSpec(), 1, None) for i in range(6)]
    tickets = loop.admit(specs)
    caps = []  # the store's row capacity after each step that left rows in it
    while loop.busy:
        loop.step(prefill_budget=24)  # a prompt or two ends a step
        if loop.store.rows_cap and (not caps or caps[-1] != loop.store.rows_cap):
            caps.append(loop.store.rows_cap)
    assert len(caps) == 1 and caps[0] >= 6, caps
    for ticket, spec in zip(tickets, specs):
        _same(ticket.result, _alone(tiny_engine, spec))


def test_express_prefill_is_a_count_of_tokens():
    from fastgate.errors import InputError
    from fastgate.scheduler import SchedulerConfig

    assert SchedulerConfig().express_prefill == 0
    with pytest.raises(InputError, match="express_prefill must be >= 0"):
        SchedulerConfig(express_prefill=-1)


def test_finished_rows_leave_and_padding_columns_are_trimmed(tiny_engine):
    loop = DecodeLoop(tiny_engine, mid=tiny_engine.n_layers // 2)
    long = ("Q: What is the capital of France?\nA:", G(max_new_tokens=30, stop_at_eos=False), TapSpec(), 1, None)
    short = [(f"word {i} " * 12, G(max_new_tokens=2, stop_at_eos=False), TapSpec(), 1, None) for i in range(3)]
    loop.add([long, *short])
    width0 = loop.mask.shape[1]
    for _ in range(4):
        loop.step()
    assert len(loop.rows) == 1  # the three short rows left together
    assert loop.mask.shape[1] < width0  # the long prompts' columns were padding for the row left
    assert loop.cache.layers[0].keys.shape[2] == loop.mask.shape[1]
    while loop.busy:
        loop.step()


@LAYOUTS
def test_a_cancelled_ticket_leaves_and_the_others_are_unchanged(tiny_engine, kind):
    loop = _loop(kind, tiny_engine)
    tickets = loop.add(CASES[:3], owners=[0, 1, 2])
    loop.step()
    loop.cancel(tickets[0])
    done = {}
    while loop.busy:
        done.update({t.owner: t.result for t in loop.step()})
    assert sorted(done) == [1, 2] and tickets[0].result is None
    for i in (1, 2):
        _same(done[i], _alone(tiny_engine, CASES[i]))


def test_growing_layer_appends_in_place_and_equals_dynamic_layer():
    from transformers.cache_utils import DynamicLayer

    from fastgate.engine.kv_cache import GrowingLayer

    grow, plain = GrowingLayer.cls()(), DynamicLayer()
    g = torch.Generator().manual_seed(0)
    for n in (7, 1, 1, 3, 1):  # a prefill, then decode steps, one multi-token append
        k, v = torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)
        got, want = grow.update(k, v), plain.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ptr = grow.keys.data_ptr()
    grow.update(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
    assert grow.keys.data_ptr() == ptr  # appended in place: the buffer did not move
    grow.batch_select_indices(torch.tensor([1]))  # replaced from outside: the next append moves to a new buffer
    plain.update(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
    plain.batch_select_indices(torch.tensor([1]))
    k = torch.ones(1, 3, 1, 4)
    assert torch.equal(grow.update(k, k)[0], plain.update(k, k)[0])


def test_growing_layer_joins_rows_in_place_and_selects():
    from fastgate.engine.kv_cache import GrowingLayer

    layer = GrowingLayer.cls()()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 2, 9, 4, generator=g)
    layer.update(a, a + 1)
    ptr = layer.keys.data_ptr()
    b = torch.randn(2, 2, 5, 4, generator=g)  # narrower: left-padded to our 9 columns
    layer.join(b, b + 1)
    want = torch.cat([a, torch.nn.functional.pad(b, (0, 0, 4, 0))])
    assert torch.equal(layer.keys, want) and torch.equal(layer.values, torch.cat([a + 1, torch.nn.functional.pad(
        b + 1, (0, 0, 4, 0))]))
    assert layer.keys.data_ptr() == ptr  # the rows fitted: nothing moved
    c = torch.randn(1, 2, 12, 4, generator=g)  # wider: everything moves once, right-aligned
    layer.join(c, c)
    assert torch.equal(layer.keys, torch.cat([torch.nn.functional.pad(want, (0, 0, 3, 0)), c]))
    layer.select(torch.tensor([5, 0]), first=3)  # rows: a (3), b (2), c
    assert torch.equal(layer.keys, torch.stack([c[0, :, 3:], want[0]]))
    step = torch.randn(2, 2, 1, 4, generator=g)
    assert torch.equal(layer.update(step, step)[0][:, :, -1:], step)


def test_a_packed_pass_equals_each_sequence_alone(tiny_engine):
    """The packed attention (fastgate.engine.packed) against HF's own forward of each sequence: decode rows of 1, 7 and
    13
    tokens beside a prompt prefilled in two chunks (columns 0-4, then 5-10), in one pass each time."""
    from fastgate.engine.packed import PackedPlan, PrefillSeg, SlotStore, packed_forward

    model = tiny_engine.model
    cfg = model.config
    hkv, hd, n_layers = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 7, 13, 11)]
    nxt = torch.randint(5, cfg.vocab_size, (3,), generator=gen).tolist()

    def buffers(n):
        return [(torch.zeros(1, hkv, n, hd), torch.zeros(1, hkv, n, hd)) for _ in range(n_layers)]

    with torch.inference_mode():
        alone = [model(input_ids=torch.tensor([s])).logits[0, -1] for s in
                 [seqs[0] + nxt[:1], seqs[1] + nxt[1:2], seqs[2] + nxt[2:], seqs[3]]]
        kv = [buffers(len(s)) for s in seqs]
        segs, ids, pos, off = [], [], [], 0
        for s, b, n in zip(seqs, kv, (1, 7, 13, 5)):  # pass 1: three prompts whole, the fourth's first 5 tokens
            segs.append(PrefillSeg(off, n, 0, b))
            ids += s[:n]
            pos += range(n)
            off += n
        packed_forward(model, torch.tensor(ids), torch.tensor(pos), PackedPlan(None, 0, None, 0, None, segs),
                       torch.tensor([0]))
        store = SlotStore(n_layers, hkv, hd, torch.float32, "cpu")
        store.reserve(3, 20, 0, 0)
        for r in range(3):
            store.write_rows(r, kv[r], len(seqs[r]), 1)
        lens = torch.tensor([1, 7, 13])
        width = 14
        plan = PackedPlan(store, 3, lens, width, (torch.arange(width)[None, :] <= lens[:, None])[:, None, None, :],
                          [PrefillSeg(3, 6, 5, kv[3])], torch.arange(3))
        got = packed_forward(model, torch.tensor(nxt + seqs[3][5:]), torch.cat([lens, torch.arange(5, 11)]), plan,
                             torch.tensor([0, 1, 2, 8]))  # [4, V]
    for i in range(4):
        torch.testing.assert_close(got[i], alone[i].float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget", [None, 20])
def test_fresh_prompts_batched_in_one_attention_call_equal_generation_alone(tiny_engine, budget, monkeypatch):
    """The packed pass's fresh prompt chunks as one padded causal call a layer (``ModelRunner.batch_prefill``, on by
    default on CUDA; forced here on a CPU): every prompt gives what it gives alone, whole (one pass of five prompts)
    or 20 tokens a pass (a pass of fresh prompts batched; one holding a chunk that starts mid-prompt, one call a
    chunk)."""
    from fastgate.engine import packed

    built = []
    original = packed.SegBatch.of.__func__

    def counting(cls, segs, device, whole=False):
        small = len(segs) * max(seg.n for seg in segs) <= packed.WHOLE_PADDING * sum(seg.n for seg in segs)
        built.append((len(segs), whole, small))
        return original(cls, segs, device, whole)

    monkeypatch.setattr(packed.SegBatch, "of", classmethod(counting))
    monkeypatch.setattr(tiny_engine.runner, "batch_prefill", True)
    loop = _loop("packed", tiny_engine)
    results = {}
    loop.admit(CASES, owners=list(range(len(CASES))))
    while loop.busy:
        for t in loop.step(prefill_budget=budget):
            results[t.owner] = t.result
    assert built and max(n for n, _, _ in built) > 1  # the batched call ran, over more than one prompt
    # whole prompts (no budget) padded little: their padded keys / values joined the store straight
    # (PackedLoop._enter_batch); these five are far apart in length, so their own buffers
    assert all(whole == (budget is None and small) for _, whole, small in built)
    assert not any(whole for _, whole, _ in built)
    monkeypatch.setattr(tiny_engine.runner, "batch_prefill", False)
    for i, spec in enumerate(CASES):
        _same(results[i], _alone(tiny_engine, spec))


@pytest.mark.parametrize("lengths", ["equal", "near"])
def test_equal_prompts_batched_as_views_join_with_rows_decoding(tiny_engine, monkeypatch, lengths):
    """Whole prompts of one length packed back to back (``SegBatch.base``: the padded batch is a view of the pass,
    no gather), or of lengths a token apart (gathered, padded a little: still their only buffers), after rows already
    decoding in the same pass, one of them forked: each gives what it gives alone."""
    from fastgate.engine import packed

    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "theta", "kappa"]
    by_len: dict[int, list[str]] = {}
    for a in words:
        for b in words:
            prompt = f"{a} {b} and"
            by_len.setdefault(tiny_engine.count_tokens(prompt), []).append(prompt)
    common = max(by_len, key=lambda n: len(by_len[n]))
    same = by_len[common][:3] if lengths == "equal" else by_len[common][:2] + by_len[common + 1][:1]
    assert len(same) == 3
    cases = [CASES[0], CASES[1]] + [(p, G(max_new_tokens=4 + i, stop_at_eos=False), TapSpec(layers=(1,)), 1 + (i == 1),
                                     None) for i, p in enumerate(same)]
    built = []
    original = packed.SegBatch.of.__func__

    def recording(cls, segs, device, whole=False):
        sb = original(cls, segs, device, whole)
        built.append((len(segs), sb.base is not None, whole))
        return sb

    monkeypatch.setattr(packed.SegBatch, "of", classmethod(recording))
    monkeypatch.setattr(tiny_engine.runner, "batch_prefill", True)
    loop = _loop("packed", tiny_engine)
    results = {}
    loop.admit(cases[:2], owners=[0, 1])
    for t in loop.step():  # the first two prompts prefilled (not one length: gathered), their rows decoding
        results[t.owner] = t.result
    loop.admit(cases[2:], owners=[2, 3, 4])
    while loop.busy:
        for t in loop.step():
            results[t.owner] = t.result
    assert (3, lengths == "equal", True) in built  # the three prompts, whole: views when of one length
    monkeypatch.setattr(tiny_engine.runner, "batch_prefill", False)
    assert sorted(results) == [0, 1, 2, 3, 4]
    for i, spec in enumerate(cases):
        _same(results[i], _alone(tiny_engine, spec))


def test_prompts_ending_in_one_pass_grow_the_store_once(tiny_engine, monkeypatch):
    """Many prompts that end in the same packed pass (each with its own buffers: not batched) join a store grown
    once for all of them, not at each join (each growth copies every row so far); each still gives what it gives
    alone, forks and rows already decoding included."""
    from fastgate.engine.packed import SlotStore

    growths = []
    original = SlotStore.reserve

    def counting(self, rows, cols, used_rows, used_cols, max_cells=None, expect_rows=0):
        before = (self.rows_cap, self.cols_cap)
        original(self, rows, cols, used_rows, used_cols, max_cells, expect_rows)
        if (self.rows_cap, self.cols_cap) != before:
            growths.append((before, (self.rows_cap, self.cols_cap)))

    monkeypatch.setattr(SlotStore, "reserve", counting)
    monkeypatch.setattr(tiny_engine.runner, "batch_prefill", False)
    loop = _loop("packed", tiny_engine)
    results = {}
    loop.admit(CASES[:1], owners=[0])
    for t in loop.step():  # one row decoding before the others join
        results[t.owner] = t.result
    growths.clear()
    short = G(max_new_tokens=5, stop_at_eos=False)
    cases = CASES[1:] + [(f"Q: question number {i} here?\nA:", short, TapSpec(), 1 + i % 2, None) for i in range(12)]
    loop.admit(cases, owners=list(range(1, len(cases) + 1)))
    for t in loop.step():  # every prompt prefilled in this one pass, then joined
        results[t.owner] = t.result
    assert len(growths) == 1, growths
    assert growths[0][1][0] >= 1 + sum(c[3] for c in cases)
    while loop.busy:
        for t in loop.step():
            results[t.owner] = t.result
    for i, spec in enumerate([CASES[0], *cases]):
        _same(results[i], _alone(tiny_engine, spec))


@LAYOUTS
def test_a_row_without_stop_strings_is_decoded_to_text_once_when_it_ends(tiny_engine, kind, monkeypatch):
    """No stop string to look for: the row's tokens become text once, when it ends, not every step; its text is the
    decode of its tokens as before, and a row with a stop string is still cut at it."""
    tokenizer = tiny_engine.tokenizer
    calls = []
    real = type(tokenizer).decode

    def counted(self, ids, **kwargs):
        calls.append(len(ids))
        return real(self, ids, **kwargs)

    monkeypatch.setattr(type(tokenizer), "decode", counted)
    loop = _loop(kind, tiny_engine)
    cfg = G(max_new_tokens=12, stop_at_eos=False)
    (ticket,) = loop.add([("Q: What is the capital of France?\nA:", cfg, TapSpec(), 1, None)])
    while loop.busy:
        loop.step()
    seq = ticket.result.sequences[0]
    assert len(seq.token_ids) == 12 and seq.finish_reason == "length"
    assert calls == [12]  # one decode, of the whole answer (every step decoded the answer so far before)
    assert seq.text == real(tokenizer, seq.token_ids, skip_special_tokens=True)
    calls.clear()
    spec = ("Berlin is the capital of", G(max_new_tokens=5, stop=(" ",)), TapSpec(), 1, None)
    (stopped,) = loop.add([spec])
    while loop.busy:
        loop.step()
    assert calls  # a stop string is looked for after every token
    _same(stopped.result, _alone(tiny_engine, spec))


@pytest.mark.parametrize("rows, cols", [(2, 5), (9, 5), (2, 400), (9, 400)])
def test_store_growth_keeps_the_used_cells_and_zeros_the_rest(rows, cols):
    """A store that grows (rows, columns or both) keeps its used rows' used columns and holds zeros everywhere else
    (cells past a row's length get attention weight 0: they must be finite), bitwise for every layer."""
    from fastgate.engine.packed import SlotStore

    store = SlotStore(2, 3, 4, torch.bfloat16, "cpu")
    store.reserve(3, 6, 0, 0)
    assert all(torch.count_nonzero(t) == 0 for t in store.keys + store.values)  # a new store: zeros
    gen = torch.Generator().manual_seed(0)
    for t in store.keys + store.values:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))  # every cell non-zero, the unused ones included
    old_k = [k.clone() for k in store.keys]
    old_v = [v.clone() for v in store.values]
    store.reserve(rows, cols, 2, 5)  # 2 rows x 5 columns in use
    assert store.rows_cap >= rows and store.cols_cap >= cols
    for new, old in zip(store.keys + store.values, old_k + old_v):
        assert torch.equal(new[:2, :, :5], old[:2, :, :5])
        rest = new.clone()
        rest[:2, :, :5] = 0
        grew = new.shape != old.shape
        assert not grew or torch.count_nonzero(rest) == 0


def test_packed_store_spare_leaves_room_for_what_other_loops_hold(tiny_engine):
    """Under a KV budget shared by several loops (the scheduler's main loops and its lane), a store that grows for
    prompts ending together keeps its spare within what the others leave (``held_elsewhere``); answers unchanged."""
    cfg = G(max_new_tokens=8, stop_at_eos=False)
    specs = [(f"prompt {i} " + "word " * 6, cfg, TapSpec(), 1, None) for i in range(3)]
    cells = {}
    for elsewhere in (0, 200):
        loop = PackedLoop(tiny_engine, mid=tiny_engine.n_layers // 2, max_cells=600)
        loop.held_elsewhere = lambda e=elsewhere: e
        tickets = loop.admit(specs)
        loop.step()  # whole prompts: the three end in one pass and join together
        cells[elsewhere] = loop.store.rows_cap * loop.store.cols_cap
        while loop.busy:
            loop.step()
        for ticket, spec in zip(tickets, specs):
            _same(ticket.result, _alone(tiny_engine, spec))
    assert cells[200] <= 600 - 200 < cells[0] <= 600, cells


def test_a_store_s_spare_columns_do_not_keep_out_a_row_the_budget_holds(tiny_engine):
    """A running row's store holds spare columns (its width + 64 or a quarter); a second generation that fits the
    budget beside the first at their own widths joins: the growth trims the spare. Charging the spare kept it out, so
    under a tight budget generations ran one at a time. Answers unchanged."""
    cfg = G(max_new_tokens=40, stop_at_eos=False)
    specs = [(f"prompt {i} " + "word " * 8, cfg, TapSpec(), 1, None) for i in range(2)]
    n = tiny_engine.count_tokens(specs[0][0])
    need = tiny_engine.kv.row_columns(tiny_engine.kv.prompt_tokens(n, 40), 40)
    max_cells = 2 * need + 2 * n  # both rows at their widths, and a prefill buffer
    loop = PackedLoop(tiny_engine, mid=tiny_engine.n_layers // 2, max_cells=max_cells)
    first = loop.admit(specs[:1])
    loop.step()
    assert loop.size == 1 and loop.store.rows_cap * loop.store.cols_cap + n <= max_cells
    assert loop.store.cols_cap > need  # the spare is there
    assert loop.cells_after([(tiny_engine.kv.prompt_tokens(n, 40), 1, 40)]) <= max_cells
    second = loop.admit(specs[1:])
    loop.step()
    assert loop.size == 2 and loop.store.rows_cap * loop.store.cols_cap <= max_cells
    while loop.busy:
        loop.step()
    for ticket, spec in zip(first + second, specs):
        _same(ticket.result, _alone(tiny_engine, spec))


def test_a_cancelled_prefill_gives_its_share_of_the_budget_back(tiny_engine):
    """A queued prefill bounds the running loop's spare by what its cache may take; cancelled before it ran and dropped
    (drop_ended), the loop's spare is its whole budget again, and the running rows' answer is unchanged."""
    cfg = G(max_new_tokens=6, stop_at_eos=False)
    running = ("a short prompt", cfg, TapSpec(), 1, None)
    loop = DecodeLoop(tiny_engine, mid=tiny_engine.n_layers // 2, max_cells=3000)
    (ticket,) = loop.admit([running])
    loop.step()  # prefilled whole, its row decoding
    bounds = lambda: {layer.max_cells for layer in loop.cache.layers if hasattr(layer, "max_cells")}  # noqa: E731
    assert bounds() == {3000}
    (late,) = loop.admit([("a long prompt " + "word " * 60, cfg, TapSpec(), 1, None)])
    assert max(bounds()) < 3000
    late.cancelled = True
    loop.drop_ended()
    assert not loop.prefilling and bounds() == {3000}
    while loop.busy:
        loop.step()
    _same(ticket.result, _alone(tiny_engine, running))


def test_a_store_grows_layer_by_layer(monkeypatch):
    """A growth copies each layer's rows into its new buffers and drops the old ones before the next layer's are
    made: it holds the new store and one old layer's buffers, not both stores whole (the KV budget counts one).
    The rows' values move unchanged; an allocation that fails midway leaves an empty store, not layers of two
    shapes, and says so to a growth that would copy rows from it; lists kept by another (the C++ decode stack) hold
    no old buffer after a growth, a failed one or a release."""
    import weakref

    from fastgate.engine import packed
    from fastgate.engine.packed import SlotStore

    layers = 6
    store = SlotStore(layers, 2, 4, torch.float32, "cpu")
    store.reserve(3, 10, 0, 0)
    for buf in (*store.keys, *store.values):
        buf.normal_()
    before = [(k[:3, :, :10].clone(), v[:3, :, :10].clone()) for k, v in zip(store.keys, store.values)]
    old = [weakref.ref(t) for t in (*store.keys, *store.values)]
    old_lists = (store.keys, store.values)
    alive, empty = [], torch.empty

    def counting_empty(*args, **kwargs):
        alive.append(sum(r() is not None for r in old))
        return empty(*args, **kwargs)

    monkeypatch.setattr(packed.torch, "empty", counting_empty)
    store.reserve(8, 300, 3, 10)
    monkeypatch.setattr(packed.torch, "empty", empty)
    # one old layer (its keys and values) fewer at each new layer's buffers (all twelve or six alive before)
    assert alive == [2 * layers - 2 * (i // 2) for i in range(2 * layers)]
    assert store.rows_cap >= 8 and store.cols_cap >= 300
    # new lists (the C++ decode stack keeps the buffers' pointers while the lists stay the same objects), the old
    # ones emptied (whoever keeps them holds no old buffer)
    assert store.keys is not old_lists[0] and store.values is not old_lists[1]
    assert all(t is None for t in (*old_lists[0], *old_lists[1]))
    for (k, v), layer_k, layer_v in zip(before, store.keys, store.values):
        assert torch.equal(layer_k[:3, :, :10], k) and torch.equal(layer_v[:3, :, :10], v)
        assert not layer_k[:3, :, 10:].any() and not layer_k[3:].any()
        assert not layer_v[:3, :, 10:].any() and not layer_v[3:].any()

    made = []

    def failing_empty(*args, **kwargs):
        if len(made) == 3:
            raise MemoryError("no room")
        made.append(1)
        return empty(*args, **kwargs)

    monkeypatch.setattr(packed.torch, "empty", failing_empty)
    kept = (store.keys, store.values)  # as the C++ decode stack keeps the last lists it bound
    with pytest.raises(MemoryError):
        store.reserve(64, 2000, 8, 300)
    assert store.keys == [] and store.values == [] and store.rows_cap == store.cols_cap == 0
    assert kept == ([], [])  # no old buffer held through them
    monkeypatch.setattr(packed.torch, "empty", empty)
    with pytest.raises(RuntimeError, match="lost its buffers"):  # rows to copy from a store that has none
        store.reserve(64, 2000, 8, 300)
    store.reserve(4, 16, 0, 0)  # nothing to copy: a store again
    kept = (store.keys, store.values)
    store.reserve(9, 40, 0, 0)  # a growth with nothing to copy lets the old buffers go before making the new
    assert kept == ([], []) and len(store.keys) == layers and store.rows_cap >= 9
    kept = (store.keys, store.values)
    store.release()
    assert kept == ([], []) and store.keys == [] and store.rows_cap == 0
