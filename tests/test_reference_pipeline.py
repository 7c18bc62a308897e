"""The HF-generate reference pipeline of bench_e2e agrees with the engine and the fast ops (tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.eval.baseline import ReferenceEngine, ReferenceWordOps, seakr_eigenscore
from fastgate.ops import build_ops
from fastgate.ops.reference import eigenscore

PROMPTS = ["Q: Who wrote Hamlet?\nA:", "The quick brown", "Berlin is the capital of Germany; Tokyo"]


@pytest.fixture(scope="module")
def ref_engine(tiny):
    return ReferenceEngine(tiny)


@pytest.mark.parametrize("cfg,taps,k,seeds", [
    (GenerationConfig(max_new_tokens=12, stop=("\n", ".")), TapSpec(layers=(1, 3), eos_state=True, pre_answer=True),
     1, None),
    (GenerationConfig(max_new_tokens=10, do_sample=True, top_k=50, top_p=0.9, stop=(".",)), TapSpec(eos_state=True),
     3, [5, 6, 7]),
])
def test_reference_engine_matches_the_engine(tiny_engine, ref_engine, cfg, taps, k, seeds):
    a = tiny_engine.generate(PROMPTS, cfg, taps, k=k, seeds=seeds)
    b = ref_engine.generate(PROMPTS, cfg, taps, k=k, seeds=seeds)
    assert len(a.sequences) == len(b.sequences) == len(PROMPTS) * k
    for x, y in zip(a.sequences, b.sequences):
        assert (x.token_ids, x.text, x.answer_tokens, x.finish_reason, x.stop_string) == \
               (y.token_ids, y.text, y.answer_tokens, y.finish_reason, y.stop_string)
        np.testing.assert_allclose(x.token_logprobs, y.token_logprobs, atol=1e-4)
    for name in ("running_sum", "count", "pre_answer", "eos_state"):
        u, v = getattr(a, name), getattr(b, name)
        assert (u is None) == (v is None), name
        if u is not None:
            torch.testing.assert_close(u, v, atol=1e-4, rtol=1e-4)


def test_reference_prompt_states(tiny_engine, ref_engine):
    torch.testing.assert_close(tiny_engine.prompt_states(PROMPTS, 2), ref_engine.prompt_states(PROMPTS, 2),
                               atol=1e-4, rtol=1e-4)


def test_seakr_formulation_matches_eigenscore():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 7, 769, generator=g)
    valid = torch.ones(3, 7, dtype=torch.bool)
    valid[1, 2:] = False
    valid[2] = False
    ref = seakr_eigenscore(z, 1e-3, valid)
    ours = eigenscore(z, 1e-3, valid)
    torch.testing.assert_close(ref[:2], ours[:2], atol=1e-4, rtol=1e-4)
    assert torch.isinf(ref[2]) and torch.isinf(ours[2])


def test_reference_word_ops_match_the_fast_ops(tiny_engine):
    words_text = ["The", " capital", " of", " Burkina", " Faso", " is", " Ouaga", "dou", "gou", ",", " naïve",
                  " state", "-of", "-the", "-art", " 1889", ".", " it's", "\n"]
    ids = tiny_engine.tokenizer("".join(words_text))["input_ids"]
    pieces = tiny_engine.token_pieces(ids)
    lps = np.linspace(-3, -0.1, len(pieces))
    fast = build_ops("auto", "cpu").align_word_logprobs_batch([pieces], [lps])[0]
    ref = ReferenceWordOps().align_word_logprobs_batch([pieces], [lps])[0]
    assert fast[0] == ref[0] and fast[1] == ref[1]
    torch.testing.assert_close(fast[2], ref[2])
    rng = np.random.default_rng(0)
    q, p = (torch.from_numpy(v / np.linalg.norm(v)).float() for v in rng.normal(size=(2, 64)))
    docs = torch.from_numpy(rng.normal(size=(9, 64)))
    docs = (docs / docs.norm(dim=-1, keepdim=True)).float()
    for mode in ("angle", "sum"):
        torch.testing.assert_close(ReferenceWordOps().ais_scores(q, p, docs, mode),
                                   build_ops("auto", "cpu").ais_scores(q, p, docs, mode), atol=1e-5, rtol=1e-5)
