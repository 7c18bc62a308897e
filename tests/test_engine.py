"""The decode loop on a tiny random Llama: equivalence with HF generate, batching, sampling, taps."""

from __future__ import annotations

import pytest
import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.local import Engine, accumulate_taps
from fastgate.errors import BackendUnavailableError, InputError

PROMPTS = [
    "Q: What is the capital of France?\nA:",
    "Hi",
    "The quick brown fox jumps over",
    "Berlin is the capital of",
    "🙂 naïve café",
]


def hf_greedy(lm, prompt, n):
    enc = lm.tokenizer(prompt, return_tensors="pt")
    out = lm.model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=lm.tokenizer.pad_token_id)
    return out[0, enc["input_ids"].shape[1]:].tolist()


def test_greedy_equals_hf_generate_token_for_token(tiny, tiny_engine):
    cfg = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    batch = tiny_engine.generate(PROMPTS, cfg)
    for prompt, seq in zip(PROMPTS, batch.sequences):
        assert seq.token_ids == hf_greedy(tiny, prompt, 12)
        assert seq.finish_reason == "length"
        assert len(seq.token_logprobs) == 12


def test_batch_equals_single(tiny_engine):
    cfg = GenerationConfig(max_new_tokens=10, stop_at_eos=False)
    batch = tiny_engine.generate(PROMPTS, cfg)
    for prompt, seq in zip(PROMPTS, batch.sequences):
        single = tiny_engine.generate([prompt], cfg).sequences[0]
        assert single.token_ids == seq.token_ids
        assert single.token_logprobs == pytest.approx(seq.token_logprobs, abs=1e-4)


def test_token_logprobs_match_model_distribution(tiny, tiny_engine):
    seq = tiny_engine.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=6, stop_at_eos=False)).sequences[0]
    ids = tiny.tokenizer(PROMPTS[0])["input_ids"] + seq.token_ids
    logits = tiny.model(torch.tensor([ids])).logits[0].float()
    start = len(ids) - len(seq.token_ids)
    expected = [torch.log_softmax(logits[start - 1 + j], -1)[t].item() for j, t in enumerate(seq.token_ids)]
    assert seq.token_logprobs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("sampled", [False, True])
def test_top_logprobs_are_the_model_s_distribution_at_each_step(tiny, tiny_engine, sampled):
    """GenerationConfig.top_logprobs: each step's most likely tokens and their log-probs from the logits the token
    was chosen from (a row asking none, beside it, gets None and the same tokens as alone)."""
    cfg = GenerationConfig(max_new_tokens=6, do_sample=sampled, seed=5, top_logprobs=4, stop_at_eos=False)
    plain = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    out = tiny_engine.generate(PROMPTS[:2], [cfg, plain], [TapSpec()] * 2, [1, 1], [None, None])
    seq, other = out.sequences
    assert other.top_logprobs is None
    assert other.token_ids == tiny_engine.generate([PROMPTS[1]], plain).sequences[0].token_ids
    ids = tiny.tokenizer(PROMPTS[0])["input_ids"] + seq.token_ids
    logits = tiny.model(torch.tensor([ids])).logits[0].float()  # [P + T, V]
    start = len(ids) - len(seq.token_ids)
    assert len(seq.top_logprobs) == len(seq.token_ids)
    for j, (token, own, step) in enumerate(zip(seq.token_ids, seq.token_logprobs, seq.top_logprobs)):
        want = torch.log_softmax(logits[start - 1 + j], -1).topk(4)
        assert [i for i, _ in step] == want.indices.tolist()
        assert [v for _, v in step] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert [v for _, v in step] == sorted((v for _, v in step), reverse=True)
        if token in dict(step):  # the loop's own value for the chosen token, bit for bit
            assert dict(step)[token] == own
    if not sampled:
        assert [step[0][0] for step in seq.top_logprobs] == seq.token_ids


def test_top_logprobs_is_checked():
    with pytest.raises(InputError, match="top_logprobs must be between 0 and 20"):
        GenerationConfig(top_logprobs=21)
    with pytest.raises(InputError, match="top_logprobs must be an integer"):
        GenerationConfig(top_logprobs=2.5)


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_engine):
    cfg = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.0, top_k=50, top_p=0.9, seed=123,
                           stop_at_eos=False)
    a = tiny_engine.generate(PROMPTS[:2], cfg, k=4)
    b = tiny_engine.generate(PROMPTS[:2], cfg, k=4)
    assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
    assert len(a.sequences) == 8
    other = tiny_engine.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=12, do_sample=True, seed=7,
                                                               stop_at_eos=False), k=4)
    assert [s.token_ids for s in other.sequences] != [s.token_ids for s in a.sequences]
    assert len({tuple(s.token_ids) for s in a.sequences[:4]}) > 1  # the k samples differ
    # a seed past torch's 64 bits (accepted by the config) failed inside torch ("Overflow"); taken modulo 2**63
    big = tiny_engine.generate(PROMPTS[:1], GenerationConfig(max_new_tokens=4, do_sample=True, seed=2**70 + 7,
                                                             stop_at_eos=False))
    same = tiny_engine.generate(PROMPTS[:1], GenerationConfig(max_new_tokens=4, do_sample=True,
                                                              seed=(2**70 + 7) % 2**63, stop_at_eos=False))
    assert big.sequences[0].token_ids == same.sequences[0].token_ids


def test_k_samples_share_prefill_greedy_equal_single(tiny_engine):
    cfg = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    batch = tiny_engine.generate(PROMPTS[:2], cfg, k=3)
    singles = [tiny_engine.generate([p], cfg).sequences[0].token_ids for p in PROMPTS[:2]]
    assert [s.token_ids for s in batch.sequences] == [singles[0]] * 3 + [singles[1]] * 3


def test_a_vanishing_temperature_decodes_greedily_beside_other_rows(tiny_engine):
    """temperature=1e-45 (the server takes 0 < t <= 2) divided the logits to inf: the sampler's error failed every
    request decoding in the same loop. Below 1e-5 a temperature decodes greedily (vLLM's rule)."""
    greedy = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    tiny_t = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1e-45, seed=3, stop_at_eos=False)
    assert not tiny_t.do_sample
    assert GenerationConfig(do_sample=True, temperature=1e-5).do_sample  # the threshold itself still samples
    out = tiny_engine.generate(PROMPTS[:2], [greedy, tiny_t], [TapSpec()] * 2, [1, 1], [None, None])
    singles = [tiny_engine.generate([p], greedy).sequences[0].token_ids for p in PROMPTS[:2]]
    assert [s.token_ids for s in out.sequences] == singles


def test_stop_strings_cut_text_and_answer_tokens(tiny, tiny_engine):
    free = tiny_engine.generate([PROMPTS[2]], GenerationConfig(max_new_tokens=12, stop_at_eos=False)).sequences[0]
    text = free.text
    stop = text[3:5]
    assert stop.strip(), "pick a visible stop string"
    cut = tiny_engine.generate([PROMPTS[2]], GenerationConfig(max_new_tokens=12, stop=(stop,), stop_at_eos=False))
    seq = cut.sequences[0]
    assert seq.finish_reason == "stop"
    assert seq.text == text[: text.find(stop)]
    assert seq.token_ids == free.token_ids[: len(seq.token_ids)]
    assert tiny.tokenizer.decode(seq.token_ids[: seq.answer_tokens]).startswith(seq.text)
    assert seq.answer_tokens <= len(seq.token_ids)


def _with_eos_after(tiny, prompt, position):
    """Make the tiny model emit EOS at greedy step `position` by copying that token's output row to EOS."""
    ref = hf_greedy(tiny, prompt, position + 1)
    target = ref[position]
    assert target not in ref[:position], "pick a prompt whose target token does not occur earlier"
    head = tiny.model.lm_head.weight
    saved = head[tiny.tokenizer.eos_token_id].clone()
    with torch.no_grad():
        head[tiny.tokenizer.eos_token_id] = head[target] * 1.001
    return saved, ref[:position]


def test_eos_stops_and_hf_generate_agrees(tiny, tiny_engine):
    prompt = PROMPTS[3]
    saved, before = _with_eos_after(tiny, prompt, 3)
    try:
        seq = tiny_engine.generate([prompt], GenerationConfig(max_new_tokens=10)).sequences[0]
        assert seq.finish_reason == "eos"
        assert seq.token_ids == [*before, tiny.tokenizer.eos_token_id]
        assert seq.answer_tokens == 3
        assert hf_greedy(tiny, prompt, 10)[:4] == seq.token_ids
    finally:
        with torch.no_grad():
            tiny.model.lm_head.weight[tiny.tokenizer.eos_token_id] = saved


def _manual_states(tiny, prompt, token_ids):
    """hidden_states of prompt + token_ids from one full forward pass (the taps' definition)."""
    ids = tiny.tokenizer(prompt)["input_ids"]
    out = tiny.model(torch.tensor([ids + token_ids]), output_hidden_states=True)
    return len(ids), out.hidden_states


@pytest.mark.parametrize("stop_at_eos", [False, True])
def test_taps_equal_manual_hidden_states(tiny, tiny_engine, stop_at_eos):
    layers = (0, 2, tiny.n_layers)
    taps = TapSpec(layers=layers, pre_answer=True, eos_state=True)
    cfg = GenerationConfig(max_new_tokens=7, stop_at_eos=stop_at_eos)
    batch = tiny_engine.generate(PROMPTS, cfg, taps)
    mid = tiny.n_layers // 2
    eos = tiny.tokenizer.eos_token_id
    for i, (prompt, seq) in enumerate(zip(PROMPTS, batch.sequences)):
        counted = [t for t in seq.token_ids if t != eos]
        forced = seq.token_ids if seq.token_ids[-1] == eos else [*seq.token_ids, eos]
        n_prompt, hs = _manual_states(tiny, prompt, forced)
        for j, layer in enumerate(layers):
            expected = hs[layer][0, n_prompt : n_prompt + len(counted)].sum(0)
            torch.testing.assert_close(batch.running_sum[i, j], expected, atol=1e-4, rtol=1e-4)
        assert batch.count[i].item() == len(counted)
        torch.testing.assert_close(batch.pre_answer[i], hs[mid][0, n_prompt - 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batch.eos_state[i], hs[mid][0, n_prompt + len(forced) - 1], atol=1e-4, rtol=1e-4)


def test_taps_finished_sequences_stop_accumulating(tiny, tiny_engine):
    prompt = PROMPTS[3]
    saved, before = _with_eos_after(tiny, prompt, 2)
    try:
        batch = tiny_engine.generate([prompt, PROMPTS[0]], GenerationConfig(max_new_tokens=9),
                                     TapSpec(layers=(1,), eos_state=True))
        short = batch.sequences[0]
        assert short.finish_reason == "eos" and len(short.token_ids) == 3
        n_prompt, hs = _manual_states(tiny, prompt, short.token_ids)
        torch.testing.assert_close(batch.running_sum[0, 0], hs[1][0, n_prompt : n_prompt + 2].sum(0), atol=1e-4,
                                   rtol=1e-4)
        assert batch.count[0].item() == 2
        torch.testing.assert_close(batch.eos_state[0], hs[tiny.n_layers // 2][0, n_prompt + 2], atol=1e-4, rtol=1e-4)
    finally:
        with torch.no_grad():
            tiny.model.lm_head.weight[tiny.tokenizer.eos_token_id] = saved


def test_no_taps_captures_nothing_and_hooks_are_removed(tiny_engine):
    layers = tiny_engine.model.model.layers
    before = [len(layer._forward_hooks) for layer in layers]
    batch = tiny_engine.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=3))
    assert batch.running_sum is None and batch.pre_answer is None and batch.eos_state is None
    tiny_engine.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=3), TapSpec(layers=(1, 2), eos_state=True))
    assert [len(layer._forward_hooks) for layer in layers] == before


def test_forwards_count_the_flush_passes_that_taps_need(tiny_engine):
    cfg = GenerationConfig(max_new_tokens=5, stop_at_eos=False)
    prompts = ["Q: a?\nA:", "Q: b?\nA:"]
    plain = tiny_engine.generate(prompts, cfg)
    sums = tiny_engine.generate(prompts, cfg, TapSpec(layers=(1, 2)))
    eos = tiny_engine.generate(prompts, cfg, TapSpec(layers=(1, 2), eos_state=True))
    assert plain.steps == sums.steps == eos.steps == 5
    # the 5th token is never fed without taps; the running sums feed it once; the EOS state feeds an EOS after it
    assert (plain.forwards, sums.forwards, eos.forwards) == (4, 5, 6)


def test_accumulate_taps_reference():
    rs = torch.zeros(3, 2, 5)
    states = torch.randn(3, 2, 5)
    accumulate_taps(rs, states, torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(rs[0], states[0])
    assert rs[1].abs().sum() == 0


def test_prompt_truncation_is_reported(tiny, tiny_engine):
    long_prompt = "capital " * 800  # > 512-token context of the tiny model
    seq = tiny_engine.generate([long_prompt, "Hi"], GenerationConfig(max_new_tokens=4)).sequences
    assert seq[0].truncated and not seq[1].truncated
    assert seq[0].prompt_tokens <= tiny.max_context - 4


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": "5"}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),  # generated 3 tokens, or failed to slice a prompt
    ({"do_sample": True, "temperature": float("nan")}, "temperature must be a finite number"),  # failed in the sampler
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"stop": None}, "stop must be a tuple of strings"),
    ({"stop": ("\n", 1)}, "stop must be a tuple of strings"),
    ({"do_sample": 1}, "do_sample must be True or False"),
])
def test_generation_config_refuses_values_of_the_wrong_type(kwargs, message):
    with pytest.raises(InputError, match=message):
        GenerationConfig(**kwargs)


def test_generation_config_takes_one_stop_string_and_numpy_integers(tiny_engine):
    import numpy as np

    assert GenerationConfig(stop="Paris").stop == ("Paris",)  # one stop string, not one per character ("P", ...)
    assert GenerationConfig(stop=["a", "b"]).stop == ("a", "b")
    cfg = GenerationConfig(max_new_tokens=np.int64(3), top_k=np.int32(2), seed=np.int64(1))
    assert (cfg.max_new_tokens, cfg.top_k, cfg.seed) == (3, 2, 1) and type(cfg.max_new_tokens) is int
    seq = tiny_engine.generate(["Q: What is the capital"], GenerationConfig(max_new_tokens=4, stop="Paris",
                                                                           stop_at_eos=False)).sequences[0]
    assert seq.stop_string in (None, "Paris")
    assert len(tiny_engine.generate(["Hi"], cfg, k=np.int64(2)).sequences) == 2


@pytest.mark.parametrize("kwargs,message", [
    ({"prompts": [None]}, "prompts must be strings, got NoneType"),
    ({"prompts": ["Hi", b"abc"]}, "prompts must be strings, got bytes"),
    ({"prompts": ["Hi"], "seeds": 5}, "seeds must be one integer"),
    ({"prompts": ["Hi"], "seeds": ["a"]}, "seed must be an integer"),
    ({"prompts": ["Hi"], "k": True}, "k must be an integer"),
    ({"prompts": ["Hi"], "k": [1.5]}, "k must be an integer"),
])
def test_generate_refuses_arguments_of_the_wrong_type(tiny_engine, kwargs, message):
    with pytest.raises(InputError, match=message):
        tiny_engine.generate(**kwargs)


def test_bad_arguments(tiny_engine):
    with pytest.raises(InputError):
        tiny_engine.generate([], GenerationConfig())
    with pytest.raises(InputError):
        tiny_engine.generate(["x"], GenerationConfig(), TapSpec(layers=(99,)))
    with pytest.raises(InputError):
        tiny_engine.generate(["x"], k=0)
    with pytest.raises(InputError, match="empty"):
        tiny_engine.generate(["Hi", ""])
    with pytest.raises(InputError):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(InputError):
        GenerationConfig(top_p=0.0)
    with pytest.raises(InputError):
        Engine(tiny_engine.lm, backend="cuda-magic")
    if not torch.cuda.is_available():
        import os

        saved = os.environ.pop("TRITON_INTERPRET", None)
        try:
            with pytest.raises(BackendUnavailableError):
                Engine(tiny_engine.lm, backend="triton")
        finally:
            if saved is not None:
                os.environ["TRITON_INTERPRET"] = saved


# ---------------------------------------------------------------- additions for the methods (issue 3)
def test_prompt_states_equal_pre_answer_and_full_forward(tiny_engine):
    prompts = ["Q: short?\nA:", "Q: a much longer question about the capital of somewhere?\nA:", "x"]
    states = tiny_engine.prompt_states(prompts, layer=2, batch_size=2)  # [3, d], two prefill groups
    batch = tiny_engine.generate(prompts, GenerationConfig(max_new_tokens=1), taps=TapSpec(pre_answer=True,
                                                                                          mid_layer=2))
    torch.testing.assert_close(states, batch.pre_answer, rtol=1e-4, atol=1e-5)
    for i, p in enumerate(prompts):
        ids = torch.tensor([tiny_engine.tokenizer(p)["input_ids"]])
        hs = tiny_engine.model(input_ids=ids, output_hidden_states=True).hidden_states[2][0, -1]
        torch.testing.assert_close(states[i], hs.float(), rtol=1e-4, atol=1e-5)


def test_per_prompt_seeds_make_samples_independent_of_the_batch(tiny_engine):
    cfg = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, top_k=50)
    alone = tiny_engine.generate(["Q: b?\nA:"], cfg, k=3, seeds=[11])
    mixed = tiny_engine.generate(["Q: a?\nA:", "Q: b?\nA:"], cfg, k=3, seeds=[5, 11])
    assert [s.token_ids for s in alone.sequences] == [s.token_ids for s in mixed.sequences[3:]]
    assert len({tuple(s.token_ids) for s in alone.sequences}) > 1  # k samples differ from each other
    with pytest.raises(InputError, match="seeds"):
        tiny_engine.generate(["a", "b"], cfg, seeds=[1])


def test_stop_string_is_reported(tiny_engine):
    out = tiny_engine.generate(["Q: x?\nA:"], GenerationConfig(max_new_tokens=40))
    text = tiny_engine.tokenizer.decode(out.sequences[0].token_ids, skip_special_tokens=True)
    stop = next((c for c in text[2:] if c.strip()), None)  # some character the model produces after the start
    if stop is None:
        pytest.skip("the tiny model produced only whitespace")
    s = tiny_engine.generate(["Q: x?\nA:"], GenerationConfig(max_new_tokens=40, stop=(stop,))).sequences[0]
    assert s.finish_reason == "stop" and s.stop_string == stop and stop not in s.text


def test_token_pieces_round_trip(tiny_engine):
    for text in ["Hello world", " café — 日本語", "a\nb"]:
        ids = tiny_engine.tokenizer(text)["input_ids"]
        pieces = tiny_engine.token_pieces(ids)
        assert len(pieces) == len(ids)
        assert b"".join(pieces).decode("utf-8") == tiny_engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert tiny_engine.token_pieces([tiny_engine.eos_id]) == [b""]


def test_prefix_cache_gives_the_same_generation(tiny):
    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.local import Engine
    from fastgate.prompts import FEW_SHOT_QA

    prompts = [f"{FEW_SHOT_QA}Q: {q}\nA:" for q in ("Who wrote Hamlet?", "capital of France", "Berlin is the capital")]
    plain, cached = Engine(tiny, prefix_cache=0), Engine(tiny, prefix_cache=8)
    cfg = GenerationConfig(max_new_tokens=8, stop=("\n",))
    taps = TapSpec(layers=(1, 4), pre_answer=True, eos_state=True)
    for batch in (prompts, prompts[1:2]):  # a batch finds its common prefix; then a single prompt reuses it
        a, b = plain.generate(batch, cfg, taps), cached.generate(batch, cfg, taps)
        for x, y in zip(a.sequences, b.sequences):
            assert (x.token_ids, x.text, x.prompt_tokens) == (y.token_ids, y.text, y.prompt_tokens)
            torch.testing.assert_close(torch.tensor(x.token_logprobs), torch.tensor(y.token_logprobs), atol=1e-4,
                                       rtol=0)
        for name in ("running_sum", "pre_answer", "eos_state"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-4, rtol=1e-4)
    assert plain.prefix_hits == 0 and cached.prefix_hits == 4
    # an explicitly cached prefix is used by a lone prompt; a prompt equal to the prefix keeps a token of its own
    fresh = Engine(tiny, prefix_cache=8)
    assert fresh.cache_prefix(FEW_SHOT_QA) > 8
    fresh.generate(prompts[:1], cfg)
    assert fresh.prefix_hits == 1
    fresh.generate([FEW_SHOT_QA], cfg)
    assert fresh.prefix_hits == 1
    with pytest.raises(InputError, match="prefix_cache"):
        Engine(tiny, prefix_cache=-1)


def test_a_batch_prefix_is_computed_only_where_it_pays(tiny):
    from fastgate.config import GenerationConfig
    from fastgate.engine.local import Engine
    from fastgate.engine.model_runner import NEW_PREFIX_TOKENS
    from fastgate.prompts import FEW_SHOT_QA

    eng = Engine(tiny, prefix_cache=8)
    runner = eng.runner
    few = runner.encode([FEW_SHOT_QA], [1])[0][0]
    eng.cache_prefix(FEW_SHOT_QA)
    cfg = GenerationConfig(max_new_tokens=2)
    # a few tokens past the cached block: a forward of the whole prefix would cost more than the rows save
    short = [f"{FEW_SHOT_QA}Q: What is the capital of {c}?\nA:" for c in ("France", "Peru", "Chad")]
    rows = runner.encode(short, [2] * 3)[0]
    assert runner.shared_prefix(rows) == tuple(few)
    eng.generate(short, cfg)
    assert runner.cached_prefixes() == [tuple(few)]
    # a long block the rows share and nothing cached covers: computed once, found by every row
    block = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
    long = [f"{block} {c}" for c in ("one", "two", "three")]
    rows = runner.encode(long, [2] * 3)[0]
    got = runner.shared_prefix(rows)
    assert got is not None and len(rows) * len(got) >= 2 * (len(got) + NEW_PREFIX_TOKENS)
    assert got in runner.cached_prefixes()
    # ... and never for two rows (2 (p - 0) < 2 (p + 32)), however much they share
    fresh = Engine(tiny, prefix_cache=8).runner
    assert fresh.shared_prefix(fresh.encode(long[:2], [2, 2])[0]) is None and not fresh.cached_prefixes()


def test_found_prefixes_never_evict_pinned_ones_and_stay_bounded(tiny, monkeypatch):
    """Bursts of prompts sharing prefixes filled the prefix cache's 16 places, held their keys and values outside any
    budget and evicted the methods' few-shot blocks: found prefixes are now bounded in number, bytes and length and
    never evict a pinned (cache_prefix) one."""
    import fastgate.engine.model_runner as mr
    from fastgate.engine.kv_cache import KVGeometry
    from fastgate.engine.local import Engine
    from fastgate.prompts import FEW_SHOT_QA

    monkeypatch.setattr(mr, "FOUND_PREFIX_TOKENS", 40)
    eng = Engine(tiny, prefix_cache=8, prefill_chunk=40)
    runner = eng.runner
    eng.cache_prefix(FEW_SHOT_QA)
    few = tuple(runner.encode([FEW_SHOT_QA], [1])[0][0])
    for i in range(mr.FOUND_PREFIXES + 5):  # more shared blocks than the found prefixes' places
        block = " ".join([f"block {i} of the quick brown fox jumps over the lazy dog"] * 8)
        rows = runner.encode([f"{block} {c}" for c in ("one", "two", "three", "four")], [2] * 4)[0]
        got = runner.shared_prefix(rows)
        assert got is not None and len(got) <= 40  # at most a prefill chunk: one pass outside the budget
    assert few in runner.cached_prefixes()  # pinned: still there
    assert len(runner.cached_prefixes()) == 1 + mr.FOUND_PREFIXES
    cell = KVGeometry.of(tiny.model.config, runner.dtype).cell_bytes
    monkeypatch.setattr(mr, "FOUND_PREFIX_BYTES", 3 * 40 * cell)  # room for three found prefixes of 40 tokens
    block = " ".join(["one more block the rows share"] * 10)
    runner.shared_prefix(runner.encode([f"{block} {c}" for c in ("a", "b", "c", "d")], [2] * 4)[0])
    assert few in runner.cached_prefixes() and len(runner.cached_prefixes()) == 1 + 3


@pytest.mark.parametrize("prefix", [0, 8])
def test_chunked_prefill_gives_the_same_generation(tiny, prefix):
    from fastgate.prompts import FEW_SHOT_QA

    questions = ["Who wrote Hamlet?", "capital of France", "Berlin is the capital of Germany; Tokyo is the capital of"
                 " Japan. Which is larger?", "x", "The quick brown fox jumps over the lazy dog. It's a pangram!"]
    prompts = [f"{FEW_SHOT_QA}Q: {q}\nA:" for q in questions]
    whole = Engine(tiny, prefix_cache=prefix, prefill_chunk=0)
    chunked = Engine(tiny, prefix_cache=prefix, prefill_chunk=40)
    assert chunked.runner.prefill_chunks([30, 5, 12, 11, 40]) == [[4], [0], [2, 3, 1]]
    cfg = GenerationConfig(max_new_tokens=10, stop=("\n",))
    taps = TapSpec(layers=(1, 3), eos_state=True)
    for k, sample in ((1, False), (2, True)):
        c = GenerationConfig(max_new_tokens=10, stop=("\n",), do_sample=sample, top_k=20)
        seeds = [1, 2, 3, 4, 5] if sample else None
        a, b = whole.generate(prompts, c if sample else cfg, taps, k=k, seeds=seeds), \
            chunked.generate(prompts, c if sample else cfg, taps, k=k, seeds=seeds)
        assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
        assert [s.prompt_tokens for s in a.sequences] == [s.prompt_tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences):
            torch.testing.assert_close(torch.tensor(x.token_logprobs), torch.tensor(y.token_logprobs), atol=1e-4,
                                       rtol=0)
        for name in ("running_sum", "eos_state"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-4, rtol=1e-4)
    # the pre-answer tap is read from one forward over all rows
    pa = whole.generate(prompts, cfg, TapSpec(pre_answer=True)).pre_answer
    pb = chunked.generate(prompts, cfg, TapSpec(pre_answer=True)).pre_answer
    torch.testing.assert_close(pa, pb, atol=1e-4, rtol=1e-4)
    with pytest.raises(InputError, match="prefill_chunk"):
        Engine(tiny, prefill_chunk=-1)


@pytest.mark.parametrize("top_k,top_p,temperature", [(50, 0.9, 1.0), (5, 0.5, 0.7), (1, 0.9, 1.0), (50, 1.0, 1.0),
                                                     (0, 0.9, 1.0), (384, 0.3, 1.3)])
def test_sampling_filters_match_hf_processors(top_k, top_p, temperature):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from fastgate.engine.decode import process_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 384, generator=g) * 3
    logits[3, :60] = logits[3, 0]  # ties at the k-th value: the full-sort path
    cfg = GenerationConfig(do_sample=True, top_k=top_k, top_p=top_p, temperature=temperature)
    expect = logits.clone()
    if temperature != 1.0:
        expect = TemperatureLogitsWarper(temperature)(None, expect)
    if top_k:
        expect = TopKLogitsWarper(top_k)(None, expect)
    if top_p < 1.0:
        expect = TopPLogitsWarper(top_p)(None, expect)
    got = process_logits(logits, cfg)
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    torch.testing.assert_close(got[~torch.isinf(got)], expect[~torch.isinf(expect)])


def test_prompt_states_with_prefix_cache_and_chunks(tiny):
    from fastgate.prompts import FEW_SHOT_QA

    prompts = [f"{FEW_SHOT_QA}Q: {q}\nA:" for q in ("Who wrote Hamlet?", "x", "Berlin is the capital of Germany")]
    plain = Engine(tiny, prefix_cache=0, prefill_chunk=0).prompt_states(prompts, 2)
    fast = Engine(tiny, prefix_cache=8, prefill_chunk=40)
    torch.testing.assert_close(fast.prompt_states(prompts, 2, batch_size=2), plain, atol=1e-4, rtol=1e-4)
    assert fast.prefix_hits == 3


@pytest.mark.parametrize("sampled", [False, True])
def test_finished_rows_leave_the_batch_and_nothing_changes(tiny_engine, monkeypatch, sampled):
    """Rows that finish early are dropped from the KV cache (half at a time); every row's tokens, log-probs and taps
    still equal its generation alone."""
    from fastgate.engine.decode import DecodeLoop

    selects = []
    real = DecodeLoop._select
    monkeypatch.setattr(DecodeLoop, "_select", lambda self, keep: (selects.append(len(keep)), real(self, keep))[1])
    lengths = [1, 2, 3, 14, 2]  # one long answer among short ones: the batch shrinks 5 -> 2 -> 1
    cfgs = [GenerationConfig(max_new_tokens=m, stop_at_eos=False, do_sample=sampled, temperature=0.9)
            for m in lengths]
    taps = TapSpec(layers=(0, 2), eos_state=True, pre_answer=True)
    seeds = [11, 12, 13, 14, 15] if sampled else None
    batch = tiny_engine.generate(PROMPTS, cfgs, taps, seeds=seeds)
    assert [n for n in selects if n] == [2, 1]
    for i, prompt in enumerate(PROMPTS):
        alone = tiny_engine.generate([prompt], [cfgs[i]], [taps], seeds=[seeds[i]] if sampled else None)
        seq, one = batch.sequences[i], alone.sequences[0]
        assert seq.token_ids == one.token_ids and len(seq.token_ids) == lengths[i]
        assert seq.token_logprobs == pytest.approx(one.token_logprobs, abs=1e-4)
        torch.testing.assert_close(batch.running_sum[i], alone.running_sum[0], atol=1e-4, rtol=1e-4)
        assert batch.count[i].item() == alone.count[0].item() == lengths[i]
        torch.testing.assert_close(batch.eos_state[i], alone.eos_state[0], atol=1e-4, rtol=1e-4)


def test_prompts_tokenised_in_one_call_as_one_by_one(tiny_engine):
    """``ModelRunner.encode`` tokenises a batch in one tokenizer call: the same ids as one prompt at a time (unicode,
    whitespace, special-looking text), an empty prompt refused by its index, an empty batch empty."""
    from fastgate.errors import InputError

    runner = tiny_engine.runner
    prompts = ["Who wrote Hamlet?", "🙂 naïve café  \n\t x", "<|endoftext|> plain", "a" * 300, " leading space"]
    rows, cut = runner.encode(prompts, 4)
    assert rows == [runner.tokenizer(p)["input_ids"] for p in prompts] and cut == [False] * len(prompts)
    assert runner.encode([], 4) == ([], [])
    with pytest.raises(InputError, match="prompt 1 is empty"):
        runner.encode(["Hi", ""], 4)


@pytest.mark.parametrize("kwargs,message", [
    ({"layers": "12"}, "sequence of layer indices"),  # a bare TypeError at generate
    ({"layers": (1.5,)}, "tap layer must be an integer"),
    ({"layers": (-1,)}, "tap layers must be >= 0"),
    ({"pre_answer": "no"}, "pre_answer must be True or False"),  # truthy: the state was captured
    ({"mid_layer": -7}, "mid_layer must be >= 0"),
])
def test_tap_spec_refuses_values_of_the_wrong_type(kwargs, message):
    with pytest.raises(InputError, match=message):
        TapSpec(**kwargs)
    assert TapSpec(layers=[2, 3]).layers == (2, 3)  # a list is kept as the tuple it is hashed as


def test_library_entry_points_give_the_projects_errors(tiny):
    """A config built directly is typed as make_config types it (tau=nan: a gate that never fired, silently); an
    unknown name with a config, parameters that are no mapping, an unknown forward, a model name for a loaded model:
    fastgate's errors, not a KeyError / AttributeError / ValueError."""
    from fastgate.errors import UnknownNameError
    from fastgate.methods import build_method, make_config
    from fastgate.methods.base import MethodConfig
    from fastgate.methods.dtr import DtrConfig
    from fastgate.methods.seakr import SeakrConfig

    with pytest.raises(InputError, match="tau must be a number"):
        DtrConfig(tau=float("nan"))
    with pytest.raises(InputError, match="alpha must be a number"):
        SeakrConfig(alpha=float("nan"))
    for bad in ({"k": 2.5}, {"k": True}, {"max_answer_tokens": None}):
        with pytest.raises(InputError, match="expects int"):
            MethodConfig(**bad)
    assert DtrConfig(tau="0.5", k="2") == DtrConfig(tau=0.5, k=2)  # strings parsed as make_config parses them
    import numpy as np

    assert DtrConfig(tau=np.float32(0.5), k=np.int64(2)) == DtrConfig(tau=0.5, k=2)  # numpy's scalars: a user's
    with pytest.raises(InputError, match="expects int"):
        MethodConfig(k=np.bool_(True))
    with pytest.raises(UnknownNameError, match="unknown method 'nope'"):
        build_method("nope", None, None, config=DtrConfig())
    with pytest.raises(InputError, match="a mapping"):
        make_config("dtr", ["tau"])
    with pytest.raises(UnknownNameError, match="forward"):
        Engine(tiny, forward="bogus")
    with pytest.raises(InputError, match="loaded model"):
        Engine("smollm2-135m")
    for name, value in (("head_columns", "a"), ("prefill_chunk", "a"), ("prefix_cache", 2.5)):
        with pytest.raises(InputError, match=f"{name} must be an integer"):
            Engine(tiny, **{name: value})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_service_names_the_cuda_device_and_its_allocator_s_memory():
    """What /healthz says on a GPU (``device``, ``device_reserved_mb``), without the HTTP layer or an index: this
    module runs in the GPU suite, where fastapi and tantivy are not installed."""
    from fastgate.engine.local import Engine
    from fastgate.serving.runtime import Runtime
    from fastgate.serving.service import AnswerService, ServiceConfig
    from fastgate.testing import tiny_model

    lm = tiny_model()
    lm.model.to("cuda")
    svc = AnswerService(ServiceConfig(method="never"), Runtime("tiny", engine=Engine(lm, step="eager")))
    assert svc.device_name == f"cuda:{torch.cuda.current_device()}" and svc.device_reserved_bytes > 0
