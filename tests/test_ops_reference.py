"""Torch reference ops (ops 1, 2, 5 of docs/ARCHITECTURE.md) against constructed inputs with known answers and plain
torch.nn."""

from __future__ import annotations

import math

import pytest
import torch

from fastgate.errors import ShapeError
from fastgate.gates.checkpoints import Prober, random_probe_params, stack_probers
from fastgate.ops.reference import ProbeParams, answer_nll, eigenscore, probe_logits


# ------------------------------------------------------------------ probe_logits
@pytest.mark.parametrize("b,n_layers,d,h", [(1, 1, 2, 2), (3, 2, 7, 5), (5, 3, 769, 13), (2, 1, 64, 512)])
def test_probe_logits_equals_torch_nn_probers(b, n_layers, d, h):
    torch.manual_seed(b * 100 + d)
    probers = [Prober(d, h).eval() for _ in range(n_layers)]
    with torch.no_grad():
        for p in probers:  # non-trivial LayerNorm affines so a swapped weight/bias would show
            for m in p.net:
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.normal_(1.0, 0.2)
                    m.bias.normal_(0.0, 0.2)
    params = stack_probers(probers)
    sums = torch.randn(b, n_layers, d) * 3
    counts = torch.randint(1, 9, (b,)).float()
    got = probe_logits(sums, counts, params)
    assert got.shape == (b, n_layers, 2) and got.dtype == torch.float32
    with torch.no_grad():
        want = torch.stack([probers[layer](sums[:, layer] / counts[:, None]) for layer in range(n_layers)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_probe_logits_non_contiguous_inputs():
    torch.manual_seed(3)
    probers = [Prober(16, 8).eval() for _ in range(3)]
    params = stack_probers(probers)
    base = torch.randn(16, 3, 4)  # [d, L, B] -> permuted view [B, L, d]
    sums = base.permute(2, 1, 0)
    assert not sums.is_contiguous()
    counts = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])[::2]
    with torch.no_grad():  # against plain torch.nn, not against itself on a contiguous copy
        want = torch.stack([probers[layer](sums[:, layer] / counts[:, None]) for layer in range(3)], dim=1)
    torch.testing.assert_close(probe_logits(sums, counts, params), want, rtol=1e-4, atol=1e-5)


def test_probe_logits_rejects_bad_shapes():
    params = random_probe_params(2, 8, 4)
    with pytest.raises(ShapeError, match="sums must be"):
        probe_logits(torch.zeros(1, 3, 8), torch.ones(1), params)
    with pytest.raises(ShapeError, match="counts must be"):
        probe_logits(torch.zeros(2, 2, 8), torch.ones(3), params)
    with pytest.raises(ShapeError, match="> 0"):
        probe_logits(torch.zeros(1, 2, 8), torch.zeros(1), params)
    bad = params._replace(b2=torch.zeros(2, 5))
    with pytest.raises(ShapeError, match="b2"):
        probe_logits(torch.zeros(1, 2, 8), torch.ones(1), bad)


# ------------------------------------------------------------------ eigenscore
def _seakr_reference(z: torch.Tensor, alpha: float) -> float:
    """SeaKR's released formulation for one request: a d×d centring matrix, einsum, logdet."""
    k, d = z.shape
    z = z.double()
    j_d = torch.eye(d, dtype=torch.float64) - torch.ones(d, d, dtype=torch.float64) / d
    sigma = torch.einsum("ij,jk,lk->il", z, j_d, z)
    return float(torch.logdet(sigma + alpha * torch.eye(k, dtype=torch.float64)) / k)


@pytest.mark.parametrize("k", [1, 2, 5, 20])
def test_eigenscore_identical_samples_closed_form(k):
    alpha = 1e-3
    v = torch.randn(97)
    z = v.expand(1, k, 97).clone()
    zc = v - v.mean()
    want = (math.log(k * float(zc @ zc) + alpha) + (k - 1) * math.log(alpha)) / k
    assert float(eigenscore(z, alpha)[0]) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("b,k,d", [(1, 2, 2), (3, 7, 13), (2, 20, 769), (4, 5, 576)])
def test_eigenscore_matches_seakr_formulation(b, k, d):
    torch.manual_seed(k * d)
    z = torch.randn(b, k, d)
    got = eigenscore(z)
    for i in range(b):
        assert float(got[i]) == pytest.approx(_seakr_reference(z[i], 1e-3), rel=1e-4, abs=1e-4)


def test_eigenscore_diversity_raises_the_score():
    torch.manual_seed(0)
    base = torch.randn(1, 1, 64).expand(1, 8, 64)
    near = base + 0.01 * torch.randn(1, 8, 64)
    far = base + 1.0 * torch.randn(1, 8, 64)
    s = eigenscore(torch.cat([near, far]))
    assert s[0] < s[1]


def test_eigenscore_valid_mask_drops_samples():
    torch.manual_seed(1)
    z = torch.randn(2, 6, 33)
    valid = torch.tensor([[True, False, True, True, False, True], [True] * 6])
    got = eigenscore(z, valid=valid)
    assert float(got[0]) == pytest.approx(float(eigenscore(z[0:1, [0, 2, 3, 5]])[0]), rel=1e-5)
    assert float(got[1]) == pytest.approx(float(eigenscore(z[1:2])[0]), rel=1e-6)
    none_valid = eigenscore(z[:1], valid=torch.zeros(1, 6, dtype=torch.bool))
    assert math.isinf(float(none_valid[0]))


def test_eigenscore_cov_scale_is_inside_form():
    torch.manual_seed(2)
    z = torch.randn(1, 5, 40)
    zc = (z[0] - z[0].mean(-1, keepdim=True)).double()
    gram = zc @ zc.T / 39
    want = float(torch.logdet(gram + 1e-3 * torch.eye(5, dtype=torch.float64)) / 5)
    assert float(eigenscore(z, scale="cov")[0]) == pytest.approx(want, rel=1e-5)


def test_eigenscore_non_contiguous_and_errors():
    z = torch.randn(9, 3, 4).permute(2, 1, 0)  # [4, 3, 9] non-contiguous
    torch.testing.assert_close(eigenscore(z), eigenscore(z.contiguous()))
    with pytest.raises(ShapeError, match="z must be"):
        eigenscore(torch.zeros(3, 4))
    with pytest.raises(ShapeError, match="valid must be"):
        eigenscore(torch.zeros(2, 3, 4), valid=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ShapeError, match="NaN"):
        eigenscore(torch.full((1, 2, 4), float("nan")))
    with pytest.raises(ShapeError, match="scale"):
        eigenscore(torch.zeros(1, 2, 4), scale="bogus")


# ------------------------------------------------------------------ answer_nll
def test_answer_nll_masks_and_empty_rows():
    lp = torch.tensor([[-0.5, -1.5, -9.0], [-0.1, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    got = answer_nll(lp, mask)
    assert float(got[0]) == pytest.approx(1.0)
    assert math.isinf(float(got[1]))
    with pytest.raises(ShapeError):
        answer_nll(lp, mask[:, :2])


def test_probe_params_types():
    p = random_probe_params(2, 6, 3)
    assert isinstance(p, ProbeParams) and (p.n_layers, p.d, p.h) == (2, 6, 3)


# ------------------------------------------------------------------ AIS, adaptive form (numpy reference)
def test_ais_adaptive_reference_hand_computed():
    """DTR's released ``consider_adaptive`` score on a 2-d example worked by hand.

    q = (1, 0), p = (0.6, 0.8): q·p = 0.6, arccos 0.6 = 0.927295, α = 0.05848·0.927295 + 0.45520 = 0.509428.
    d = q: s1 = 1, s2 = 0.6  -> -(α·0 + (1-α)·0.927295)         = -0.454905
    d ⟂ q: s1 = 0, s2 = 0.8  -> -(α·1.570796 + (1-α)·0.643501)  = -1.115891
    d = p: s1 = 0.6, s2 = 1  -> -(α·0.927295 + (1-α)·0)         = -0.472390
    """
    import numpy as np

    from fastgate.ops import _python

    q, p = np.array([1.0, 0.0], np.float32), np.array([0.6, 0.8], np.float32)
    docs = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], np.float32)
    out = _python.ais_scores(q, p, docs, "adaptive")
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [-0.454905, -1.115891, -0.472390], atol=2e-6)
    # s1 is the cosine to the question and s2 to the pseudo-context: swapping q and p changes the weights
    swapped = _python.ais_scores(p, q, docs, "adaptive")
    np.testing.assert_allclose(swapped, [-0.472390, -(0.509428 * 0.643501 + 0.490572 * 1.570796), -0.454905],
                               atol=2e-6)
    # the batched form reads each row's own q·p
    batch = _python.ais_scores_batch(np.stack([q, p]), np.stack([p, q]), np.stack([docs, docs]), "adaptive")
    np.testing.assert_allclose(batch, np.stack([out, swapped]), atol=0)
    # the ranking differs from the plain angle sum (α = 1/2) only through α: with q ⟂ p, α = 0.547061
    q2, p2 = np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)
    d2 = np.array([[np.cos(0.5), np.sin(0.5)], [np.cos(1.0), np.sin(1.0)]], np.float32)  # θ1 = 0.5, 1.0
    a = 0.05848 * math.pi / 2 + 0.45520
    np.testing.assert_allclose(_python.ais_scores(q2, p2, d2, "adaptive"),
                               [-(a * 0.5 + (1 - a) * (math.pi / 2 - 0.5)), -(a * 1.0 + (1 - a) * (math.pi / 2 - 1.0))],
                               atol=2e-6)


def test_answer_nll_leaves_masked_out_positions_out():
    """A -inf log-prob where the mask is 0 made the row NaN (-inf * 0); the formula leaves it out."""
    lp = torch.tensor([[-0.5, -1.5, -math.inf], [-math.inf, -1.0, -3.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(answer_nll(lp, mask), torch.tensor([1.0, 2.0]))


def test_eigenscore_refuses_a_nan_or_infinite_alpha():
    z = torch.randn(2, 4, 9)
    for alpha in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(ShapeError, match="alpha"):
            eigenscore(z, alpha=alpha)


def test_reference_ops_refuse_shapes_they_would_broadcast():
    from fastgate.ops.reference import accumulate_taps, decode_attention_step

    sums = torch.zeros(3, 2, 5)
    with pytest.raises(ShapeError, match="accumulate_taps"):
        accumulate_taps(sums, torch.ones(1, 2, 5), torch.ones(3))  # one row's states into three rows' sums
    with pytest.raises(ShapeError, match="accumulate_taps"):
        accumulate_taps(sums, torch.ones(3, 2, 5), torch.ones(1))
    assert not sums.any()
    keys, values = torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8)  # [R, Hkv, C, D]
    q = torch.randn(2, 4, 8)
    with pytest.raises(ShapeError, match="k_new / v_new"):  # one key head into both heads of the store
        decode_attention_step(q, torch.randn(2, 1, 8), torch.randn(2, 2, 8), keys, values, torch.tensor([0, 1]))
    assert not keys.any() and not values.any()
