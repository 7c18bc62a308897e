"""C++ extension vs pure-Python reference: identical results on awkward inputs, and known answers."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch

from fastgate.errors import BackendUnavailableError, InputError, ShapeError
from fastgate.ops import build_ops, ext_available, registry
from fastgate.ops.reference import answer_nll

PY = build_ops("python", "cpu")
BACKENDS = [PY]
if ext_available():
    BACKENDS.append(build_ops("ext", "cpu"))


def both(fn_name, *args, **kwargs):
    """Run an op on every backend and assert they agree (same shape and dtype; the same bits here, where both backends
    accumulate in float64 and round once to float32, within 1e-6 where another CPU's float64 sums or libm straddle a
    float32 rounding boundary); return the python result."""
    results = [getattr(b, fn_name)(*args, **kwargs) for b in BACKENDS]
    for r in results[1:]:
        if isinstance(r, torch.Tensor):
            assert r.shape == results[0].shape and r.dtype == results[0].dtype, (r.shape, r.dtype, results[0].shape)
            assert torch.equal(r, results[0]) or torch.allclose(r, results[0], rtol=0, atol=1e-6), \
                (r - results[0]).abs().max()
        else:
            assert r == results[0]
    return results[0]


def test_ext_is_built_in_ci(monkeypatch):
    # make test builds the extension; a missing build would silently test only the fallback. Outside CI an install
    # with FASTGATE_SKIP_EXT=1 (or a tree run from PYTHONPATH, as bench/gpu_suite.sh runs it) has none by choice
    if not ext_available() and not os.environ.get("CI"):
        pytest.skip("the C++ extension is not built (and this is not CI, where it must be)")
    monkeypatch.delenv("FASTGATE_BACKEND", raising=False)
    assert ext_available(), "fastgate._C is not importable: the C++ extension did not build"
    assert build_ops("auto", "cpu").cpu_backend == "ext"


ALIGN_CASES = [
    ([], ([], [])),
    (["Hello"], (["Hello"], [0])),
    ([" ", "..."], ([], [-1, -1])),
    (["Hel", "lo", " wor", "ld", "!"], (["Hello", "world"], [0, 0, 1, 1, -1])),
    ([" don", "'t", " state", "-of", "-the", "-art"], (["don't", "state-of-the-art"], [0, 0, 1, 1, 1, 1])),
    (["'", "quoted", "'", " --", "x"], (["quoted", "x"], [-1, 0, -1, -1, 1])),
    (["a", "--", "b"], (["a", "b"], [0, -1, 1])),
    (["naïve", " café", " Zürich", " 東京", " ١٢٣"], (["naïve", "café", "Zürich", "東京", "١٢٣"], [0, 1, 2, 3, 4])),
    (["it", "'", "s"], (["it's"], [0, 0, 0])),
    (["end-", " start"], (["end", "start"], [0, 1])),
    # a token whose first word character continues the previous word belongs to that word
    (["Hi", " there you", " go"], (["Hi", "there", "you", "go"], [0, 1, 3])),
]


@pytest.mark.parametrize("pieces,expected", ALIGN_CASES)
def test_align_words_str(pieces, expected):
    assert both("align_words", pieces) == expected


def test_align_words_bytes_emoji_split_across_pieces():
    emoji = "🙂".encode()  # 4 bytes
    pieces = [b"ok", b" " + emoji[:2], emoji[2:] + b" go"]
    words, ids = both("align_words", pieces)
    assert words == ["ok", "go"]
    assert ids == [0, -1, 1]


def test_align_words_bytes_multibyte_letter_split():
    pieces = [b"caf", "é".encode()[:1], "é".encode()[1:] + b" ok"]
    words, ids = both("align_words", pieces)
    assert words == ["café", "ok"]
    assert ids == [0, 0, 1]  # the piece holding é's first byte owns it


def test_align_words_invalid_utf8_does_not_swallow_valid_chars():
    pieces = [b"ab\xe2\x82", b"cd", b"\xff", b"e\xc3"]
    words, ids = both("align_words", pieces)
    assert words == ["ab", "cd", "e"]
    assert ids == [0, 1, -1, 2]


def test_align_words_bytes_matches_str_on_valid_text():
    rng = random.Random(0)
    text = "The naïve café's owner — Zürich-based — paid 1,889€; 東京 🙂 don't-stop!"
    data = text.encode()
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), 12))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        words, _ = both("align_words", pieces)
        assert words == PY.align_words([text])[0]


def test_align_words_random_fuzz():
    rng = random.Random(1)
    alphabet = ["a", "Z", "é", "'", "-", " ", ".", "9", "🙂", "東", "\u0301", "_", "ß", "Ⅻ"]
    for _ in range(300):
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 8))]
        both("align_words", pieces)
        raw = [bytes(rng.randrange(256) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 6))]
        both("align_words", raw)


def test_align_words_rejects_mixed_and_bad_types():
    for backend in BACKENDS:
        with pytest.raises(TypeError):
            backend.align_words(["a", b"b"])
        with pytest.raises(TypeError):
            backend.align_words(["a", 3])


def test_word_logprobs_geometric_mean():
    lp = torch.tensor([math.log(0.9), math.log(0.5), math.log(0.7), -1.0])
    out = both("word_logprobs", lp, [0, 0, -1, 1])
    assert out.dtype == torch.float32 and out.shape == (2,)
    assert math.exp(out[0]) == pytest.approx(math.sqrt(0.45), rel=1e-6)
    assert out[1].item() == pytest.approx(-1.0)


def test_word_logprobs_edge_cases():
    assert both("word_logprobs", torch.zeros(0), []).shape == (0,)
    assert both("word_logprobs", torch.tensor([-0.5]), [0]).tolist() == [-0.5]
    out = both("word_logprobs", torch.tensor([-0.5, -0.25]), [-1, 2], n_words=4)
    assert out.tolist() == [0.0, 0.0, -0.25, 0.0]  # tokenless words get 0
    for backend in BACKENDS:
        with pytest.raises(ShapeError):
            backend.word_logprobs(torch.zeros(3), [0, 1])
        with pytest.raises(ShapeError):
            backend.word_logprobs(torch.zeros(1), [5], n_words=2)


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


# d crosses the C++ kernel's 32-float step (31, 32, 33) and its 1024-float block (1023, 1025, 2081)
@pytest.mark.parametrize("n,d", [(1, 1), (1, 7), (3, 31), (3, 32), (3, 33), (13, 384), (5, 769), (2, 1023), (2, 1025),
                                 (2, 2081)])
@pytest.mark.parametrize("mode", ["angle", "sum", "adaptive"])
def test_ais_scores_parity_and_formula(n, d, mode):
    rng = np.random.default_rng(n * 1000 + d)
    q, p = _unit(rng.normal(size=d)).astype(np.float32), _unit(rng.normal(size=d)).astype(np.float32)
    docs = _unit(rng.normal(size=(n, d))).astype(np.float32)
    out = both("ais_scores", torch.from_numpy(q), torch.from_numpy(p), torch.from_numpy(docs), mode)
    s1, s2 = np.clip(docs @ q, -1, 1), np.clip(docs @ p, -1, 1)
    if mode == "angle":
        expected = np.cos(np.arccos(s1) + np.arccos(s2))
    elif mode == "adaptive":  # DTR's released reranker, written out as there
        alpha = 0.05848 * np.arccos(np.clip(np.dot(q, p), -1, 1)) + 0.45520
        expected = -(alpha * np.arccos(s1) + (1 - alpha) * np.arccos(s2))
    else:
        expected = s1 + s2
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("d", [7, 384, 769, 2081])
@pytest.mark.parametrize("mode", ["angle", "adaptive"])
def test_ais_scores_of_nearly_parallel_vectors_match_the_reference(d, mode):
    """sqrt(1 − s²) and arccos(s) near s = 1 magnify the dot products' rounding: summed in float32 the C++ op was
    1.7e-4 from the float64 reference at d = 769; its products and sums are now in double as the reference's."""
    rng = np.random.default_rng(d)
    q = _unit(rng.normal(size=d)).astype(np.float32)
    p = _unit(q + 1e-3 * rng.normal(size=d)).astype(np.float32)
    docs = _unit(q + rng.uniform(1e-4, 1e-2, size=(6, 1)) * rng.normal(size=(6, d))).astype(np.float32)
    ref = PY.ais_scores(torch.from_numpy(q), torch.from_numpy(p), torch.from_numpy(docs), mode)
    for backend in BACKENDS[1:]:
        out = backend.ais_scores(torch.from_numpy(q), torch.from_numpy(p), torch.from_numpy(docs), mode)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("where", [0, 31, 32, 1024, 1029])
@pytest.mark.parametrize("mode", ["angle", "sum", "adaptive"])
def test_ais_rejects_a_non_finite_document_element_in_the_vector_body_or_the_tail(where, mode):
    d = 1030  # one full 1024 block (32-float steps) and a 6-float block handled element by element
    docs = torch.ones(3, d) / d**0.5
    q = p = torch.ones(d) / d**0.5
    for bad in (float("nan"), float("inf")):
        docs2 = docs.clone()
        docs2[1, where] = bad
        for backend in BACKENDS:
            with pytest.raises(ShapeError, match="NaN or inf"):
                backend.ais_scores(q, p, docs2, mode)
            q2 = q.clone()
            q2[where] = bad  # a non-finite q (which the adaptive weight also reads) is rejected too
            with pytest.raises(ShapeError, match="NaN or inf"):
                backend.ais_scores(q2, p, docs, mode)
            with pytest.raises(ShapeError, match="NaN or inf"):
                backend.ais_scores_batch(q[None], q2[None], docs[None], mode)


def test_ais_scores_clips_similarities_outside_unit_range():
    q = torch.tensor([1.0, 0.0])
    p = torch.tensor([0.0, 1.0])
    docs = torch.tensor([[1.5, 0.0], [-2.0, 0.5], [0.0, 0.0]])  # s1 = 1.5 -> 1, s1 = -2 -> -1
    out = both("ais_scores", q, p, docs, "angle")
    assert out[0].item() == pytest.approx(0.0, abs=1e-7)  # s1=1: sqrt(1-s1²)=0, s2=0 -> 0
    assert out[1].item() == pytest.approx(-0.5, abs=1e-6)  # s1=-1 -> -s2
    assert torch.isfinite(out).all()
    out_sum = both("ais_scores", q, p, docs, "sum")
    assert out_sum.tolist() == pytest.approx([1.0, -0.5, 0.0])
    # adaptive: q ⟂ p gives α = 0.05848·π/2 + 0.45520; s1 clipped to 1 -> angle 0, to -1 -> angle π
    alpha = 0.05848 * math.pi / 2 + 0.45520
    out_adaptive = both("ais_scores", q, p, docs, "adaptive")
    assert out_adaptive.tolist() == pytest.approx(
        [-(1 - alpha) * math.pi / 2, -(alpha * math.pi + (1 - alpha) * math.acos(0.5)), -math.pi / 2], abs=1e-6)
    # q·p itself is clipped before arccos: a q·p that rounds above 1 gives α at angle 0, not NaN
    v = torch.tensor([0.6, 0.8]) * 1.0000001
    assert float((v * v).sum()) > 1.0
    out = both("ais_scores", v, v, torch.tensor([[0.6, 0.8], [0.8, -0.6]]), "adaptive")
    assert torch.isfinite(out).all()
    assert out.tolist() == pytest.approx([0.0, -math.pi / 2], abs=1e-6)


@pytest.mark.parametrize("mode", ["angle", "sum", "adaptive"])
@pytest.mark.parametrize("B,n,d", [(3, 11, 769), (1, 1, 1), (2, 13, 7), (5, 3, 1031)])
def test_ais_scores_batch_matches_single_and_noncontiguous(mode, B, n, d):
    rng = np.random.default_rng(7 + B * n * d)
    Q = torch.from_numpy(_unit(rng.normal(size=(B, d))).astype(np.float32))
    P = torch.from_numpy(_unit(rng.normal(size=(B, 2 * d))).astype(np.float32))[:, ::2]  # non-contiguous, ‖·‖ < 1
    D = torch.from_numpy(_unit(rng.normal(size=(B, d, n))).astype(np.float32)).transpose(1, 2)  # non-contiguous
    assert not D.is_contiguous() or n == 1
    out = both("ais_scores_batch", Q, P, D, mode)
    assert out.shape == (B, n)
    for b in range(B):  # each row gets its own q·p (adaptive): the batch equals the single calls
        for backend in BACKENDS:
            torch.testing.assert_close(out[b], backend.ais_scores(Q[b], P[b], D[b], mode), atol=1e-6, rtol=0)


def test_ais_shape_and_mode_errors():
    for backend in BACKENDS:
        with pytest.raises(ShapeError):
            backend.ais_scores(torch.zeros(3), torch.zeros(4), torch.zeros(2, 3))
        with pytest.raises(ShapeError):
            backend.ais_scores_batch(torch.zeros(2, 3), torch.zeros(1, 3), torch.zeros(2, 4, 3))
        with pytest.raises(ShapeError):
            backend.ais_scores(torch.tensor([float("nan")]), torch.zeros(1), torch.zeros(1, 1))
        with pytest.raises(ShapeError, match="'angle', 'sum' or 'adaptive'"):
            backend.ais_scores(torch.zeros(3), torch.zeros(3), torch.zeros(2, 3), "product")
        with pytest.raises(ShapeError, match="'angle', 'sum' or 'adaptive'"):
            backend.ais_topk_batch(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 2, 3), 1, "Adaptive")
        with pytest.raises(ShapeError, match="NaN or inf"):
            backend.ais_scores(torch.tensor([float("nan")]), torch.zeros(1), torch.zeros(1, 1), "adaptive")
        docs = torch.zeros(2, 4, 3)
        docs[1, 2, 1] = float("inf")
        with pytest.raises(ShapeError, match="NaN or inf"):
            backend.ais_scores_batch(torch.zeros(2, 3), torch.zeros(2, 3), docs)
        with pytest.raises(ShapeError, match="NaN or inf"):
            backend.ais_topk_batch(torch.zeros(2, 3), torch.full((2, 3), float("nan")), torch.zeros(2, 4, 3), 2)


def test_backend_selection(monkeypatch):
    assert build_ops("python", "cpu").cpu_backend == "python"
    with pytest.raises(InputError):
        build_ops("gpu", "cpu")
    monkeypatch.setenv("FASTGATE_BACKEND", "torch")
    assert build_ops("auto", "cpu").cpu_backend == "python"
    monkeypatch.setattr(registry, "import_ext", lambda: None)
    with pytest.raises(BackendUnavailableError):
        build_ops("ext", "cpu")


def test_answer_nll():
    lp = torch.tensor([[-0.1, -0.3, -5.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    out = answer_nll(lp, mask)
    assert out[0].item() == pytest.approx(0.2)
    assert math.isinf(out[1].item())
    with pytest.raises(ShapeError):
        answer_nll(lp, mask[:, :2])


# ---------------------------------------------------------------- batched C++ ops (one call for many sequences)
def test_align_word_logprobs_batch_equals_per_sequence_calls():
    rng = random.Random(7)
    batch_pieces = [["Ouaga", "dougou", " is", " the", " capital"], [], [b"caf", b"\xc3", b"\xa9", b" ok"],
                    [" don", "'t", " re-", "enter", "!"]]
    batch_lp = [np.log([rng.uniform(0.05, 1.0) for _ in p]) for p in batch_pieces]
    per = []
    for pieces, lp in zip(batch_pieces, batch_lp):
        words, ids = PY.align_words(pieces)
        per.append((words, ids, PY.word_logprobs(lp, ids, len(words))))
    for backend in BACKENDS:
        got = backend.align_word_logprobs_batch(batch_pieces, batch_lp)
        assert len(got) == len(per)
        for (w, i, lp), (pw, pi, plp) in zip(got, per):
            assert (w, i) == (pw, pi)
            torch.testing.assert_close(lp, plp, rtol=0, atol=1e-6)
    with pytest.raises(ShapeError, match="pieces but"):
        BACKENDS[-1].align_word_logprobs_batch([["a", "b"]], [np.zeros(3)])
    with pytest.raises(ShapeError, match="log-prob arrays"):
        BACKENDS[-1].align_word_logprobs_batch([["a"]], [])


@pytest.mark.parametrize("b,n,d,k", [(1, 1, 1, 1), (3, 7, 13, 3), (2, 10, 769, 4), (4, 5, 384, 9)])
@pytest.mark.parametrize("mode", ["angle", "sum", "adaptive"])
def test_ais_topk_batch(b, n, d, k, mode):
    torch.manual_seed(n * d)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s), dim=-1)  # noqa: E731
    Q, P, D = unit(b, d), unit(b, d), unit(b, n, d)
    D[0, -1] = D[0, 0]  # a tie: the lower index must come first
    full = PY.ais_scores_batch(Q, P, D, mode)
    for backend in BACKENDS:
        s, i = backend.ais_topk_batch(Q, P, D, k, mode)
        kk = min(k, n)
        assert s.shape == (b, kk) and i.shape == (b, kk) and i.dtype == torch.int64
        torch.testing.assert_close(s, torch.gather(full, 1, i), rtol=0, atol=1e-6)
        want = torch.tensor([sorted(range(n), key=lambda j: (-float(full[r, j]), j))[:kk] for r in range(b)])
        assert torch.equal(i, want)
    with pytest.raises(ShapeError, match="k must be"):
        BACKENDS[-1].ais_topk_batch(Q, P, D, 0)


# ------------------------------------------------------------------ eigenscore (C++ vs the torch reference)
@pytest.mark.parametrize("b,k,d", [(1, 1, 2), (1, 20, 576), (3, 7, 13), (2, 20, 769), (5, 3, 1031), (2, 4, 4096)])
def test_eigenscore_ext_matches_reference(b, k, d):
    from fastgate.ops.reference import eigenscore as reference

    torch.manual_seed(b * k * d)
    z = torch.randn(b, k, d) * 2 + 0.5  # d crosses the C++ op's 4-double steps and 256-feature blocks
    for scale in (None, "cov"):
        want = reference(z, scale=scale)
        for backend in BACKENDS:
            torch.testing.assert_close(backend.eigenscore(z, scale=scale), want, rtol=1e-5, atol=1e-5)


def test_eigenscore_ext_masks_offsets_layouts_and_errors():
    from fastgate.ops.reference import eigenscore as reference

    torch.manual_seed(11)
    # near-identical samples far from zero: the centring must match the reference's
    z = 1000.0 + torch.randn(2, 1, 577) + 1e-2 * torch.randn(2, 20, 577)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[0, ::3] = False
    for backend in BACKENDS:
        torch.testing.assert_close(backend.eigenscore(z, valid=valid), reference(z, valid=valid), rtol=1e-5, atol=1e-5)
    # a larger offset: the rank-one correction Z Zᵀ - s sᵀ / d lost more than the ridge to rounding (NaN); the op
    # centres each row before its Gram matrix, as the reference does
    far = (1e6 + 1e-2 * torch.randn(2, 5, 769)).float()
    for backend in BACKENDS:
        torch.testing.assert_close(backend.eigenscore(far), reference(far), rtol=1e-5, atol=1e-5)
    nc = torch.randn(9, 3, 4).permute(2, 1, 0)  # [4, 3, 9] non-contiguous
    none_valid = torch.zeros(4, 3, dtype=torch.bool)
    for backend in BACKENDS:
        torch.testing.assert_close(backend.eigenscore(nc), reference(nc.contiguous()), rtol=1e-5, atol=1e-6)
        assert torch.isinf(backend.eigenscore(nc, valid=none_valid)).all()  # no valid sample: +inf
        assert backend.eigenscore(torch.zeros(0, 3, 4)).shape == (0,)
        bad = torch.randn(2, 3, 300)
        bad[1, 2, 299] = float("nan")
        with pytest.raises(ShapeError, match="NaN or inf"):
            backend.eigenscore(bad, valid=torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool))  # dropped row too
        with pytest.raises(ShapeError, match="z must be"):
            backend.eigenscore(torch.zeros(3, 4))
        with pytest.raises(ShapeError, match="valid must be"):
            backend.eigenscore(torch.zeros(2, 3, 4), valid=torch.ones(2, 4, dtype=torch.bool))
        with pytest.raises(ShapeError, match="alpha"):
            backend.eigenscore(torch.zeros(1, 2, 4), alpha=0.0)


@pytest.mark.skipif(not ext_available(), reason="the C++ extension is not built")
def test_gate_ops_pick_the_extension_on_cpu(monkeypatch):
    monkeypatch.delenv("FASTGATE_BACKEND", raising=False)
    assert build_ops("auto", "cpu").backend == "ext"  # make test builds the extension
    assert build_ops("torch", "cpu").backend == "torch"
    with pytest.raises(BackendUnavailableError, match="CPU tensors"):
        build_ops("ext", "cuda")
    monkeypatch.setenv("FASTGATE_BACKEND", "torch")
    assert build_ops("auto", "cpu").backend == "torch"
    monkeypatch.delenv("FASTGATE_BACKEND")
    monkeypatch.setattr(registry, "import_ext", lambda: None)
    assert build_ops("auto", "cpu").backend == "torch"
    with pytest.raises(BackendUnavailableError, match="fastgate._C"):
        build_ops("ext", "cpu")


def test_zero_heads_and_a_bad_position_are_handled_as_the_reference_does():
    from fastgate.errors import ShapeError as Shape
    from fastgate.ops import reference

    x, c = torch.randn(4, 0, 64).bfloat16(), torch.randn(4, 1, 64).bfloat16()
    for backend in BACKENDS:  # no heads: an empty result (the C++ op raised "bad shape")
        assert backend.rope(x, c, c).shape == (4, 0, 64)
    q, kn = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    keys, vals = torch.zeros(2, 1, 8, 8), torch.zeros(2, 1, 8, 8)
    with pytest.raises((Shape, IndexError)):
        reference.decode_attention_step(q, kn, kn, keys, vals, torch.tensor([-1, 0]))
    assert not keys.any() and not vals.any()  # checked before the write (pos -1 wrote the last column first)
