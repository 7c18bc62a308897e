"""Triton kernels against their torch references: on CUDA when present, else in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set by conftest) on small awkward shapes."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from fastgate.errors import ShapeError
from fastgate.gates.checkpoints import random_probe_params

triton = pytest.importorskip("triton")

from fastgate.kernels import gram, probe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("b,n_layers,d", [(1, 1, 1), (3, 2, 7), (2, 3, 769), (5, 1, 64)])
def test_accumulate_matches_reference(b, n_layers, d):
    torch.manual_seed(d)
    rs = torch.randn(b, n_layers, d, device=DEVICE)
    states = torch.randn(d, n_layers, b, device=DEVICE).permute(2, 1, 0)  # non-contiguous [B, L, d]
    weight = (torch.arange(b, device=DEVICE) % 2 == 0).float()  # odd rows are finished sequences
    got, want = rs.clone(), rs.clone()
    probe.accumulate(got, states, weight)
    probe.accumulate_reference(want, states, weight)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if b > 1:
        assert torch.equal(got[1], rs[1])  # a finished sequence's sum does not move


def test_accumulate_casts_low_precision_states():
    rs = torch.zeros(2, 2, 33, device=DEVICE)
    states = torch.randn(2, 2, 33, device=DEVICE).to(torch.bfloat16)
    probe.accumulate(rs, states, torch.ones(2, device=DEVICE))
    torch.testing.assert_close(rs, states.float())


@pytest.mark.parametrize("b,n_layers,d,h", [(1, 1, 2, 2), (3, 2, 7, 5), (2, 3, 769, 13), (2, 1, 64, 40)])
def test_fused_prober_matches_reference(b, n_layers, d, h):
    params = random_probe_params(n_layers, d, h, seed=d).to(DEVICE)
    torch.manual_seed(h)
    sums = (torch.randn(d, n_layers, b, device=DEVICE) * 3).permute(2, 1, 0)
    counts = torch.randint(1, 7, (b,), device=DEVICE).float()
    torch.testing.assert_close(probe.probe_logits(sums, counts, params),
                               probe.probe_logits_reference(sums, counts, params), rtol=1e-4, atol=1e-5)


def test_fused_prober_errors():
    params = random_probe_params(2, 8, 4).to(DEVICE)
    with pytest.raises(ShapeError, match="sums must be"):
        probe.probe_logits(torch.zeros(1, 3, 8, device=DEVICE), torch.ones(1, device=DEVICE), params)
    with pytest.raises(ShapeError, match="> 0"):
        probe.probe_logits(torch.zeros(1, 2, 8, device=DEVICE), torch.zeros(1, device=DEVICE), params)
    with pytest.raises(ShapeError, match="states"):
        probe.accumulate(torch.zeros(1, 2, 8, device=DEVICE), torch.zeros(1, 2, 9, device=DEVICE),
                         torch.ones(1, device=DEVICE))


@pytest.mark.parametrize("b,k,d", [(1, 1, 2), (3, 7, 13), (2, 20, 769), (1, 5, 576)])
def test_eigenscore_kernel_matches_reference(b, k, d):
    torch.manual_seed(k * d)
    z = torch.randn(b, k, d, device=DEVICE)
    torch.testing.assert_close(gram.eigenscore(z), gram.eigenscore_reference(z), rtol=1e-5, atol=1e-5)


def test_eigenscore_kernel_known_answers_and_masks():
    alpha = 1e-3
    v = torch.randn(97, device=DEVICE)
    z = v.expand(1, 5, 97).clone()
    zc = v - v.mean()
    want = (math.log(5 * float(zc @ zc) + alpha) + 4 * math.log(alpha)) / 5
    assert float(gram.eigenscore(z, alpha)[0]) == pytest.approx(want, rel=1e-5)
    z = torch.randn(2, 6, 33, device=DEVICE)
    valid = torch.tensor([[True, False, True, True, False, True], [True] * 6], device=DEVICE)
    torch.testing.assert_close(gram.eigenscore(z, valid=valid), gram.eigenscore_reference(z, valid=valid))
    torch.testing.assert_close(gram.eigenscore(z, scale="cov"), gram.eigenscore_reference(z, scale="cov"))
    assert math.isinf(float(gram.eigenscore(z[:1], valid=torch.zeros(1, 6, dtype=torch.bool, device=DEVICE))[0]))
    nc = torch.randn(9, 3, 4, device=DEVICE).permute(2, 1, 0)
    torch.testing.assert_close(gram.eigenscore(nc), gram.eigenscore_reference(nc))
    with pytest.raises(ShapeError, match="k=65"):
        gram.eigenscore(torch.zeros(1, 65, 4, device=DEVICE))


@pytest.mark.parametrize("offset", [1e3, 1e4, 1e5, 1e6])
def test_eigenscore_kernel_centring_survives_a_large_common_offset(offset):
    # near-identical samples far from zero: a rank-one centring of the raw Gram (Z Zᵀ - s sᵀ / d) cancelled to its
    # rounding here (1e-4 off at 1e4, NaN at 1e6); the kernel must give the reference's score, which centres first
    torch.manual_seed(3)
    base = offset + torch.randn(2, 1, 769, device=DEVICE)
    z = base + 1e-2 * torch.randn(2, 20, 769, device=DEVICE)  # [2, 20, 769]
    torch.testing.assert_close(gram.eigenscore(z), gram.eigenscore_reference(z), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_eigenscore_kernel_rejects_non_finite_z_like_the_reference(bad):
    z = torch.randn(3, 4, 37, device=DEVICE)
    z[1, 2, 36] = bad  # the last feature of a middle request
    valid = torch.ones(3, 4, dtype=torch.bool, device=DEVICE)
    for v in (None, valid, valid.index_fill(1, torch.tensor([2], device=DEVICE), False)):  # also in a dropped sample
        for fn in (gram.eigenscore, gram.eigenscore_reference):
            with pytest.raises(ShapeError, match="NaN or inf"):
                fn(z, valid=v)
    assert gram.eigenscore(z[::2]).isfinite().all()  # the other requests are fine
    for fn in (gram.eigenscore, gram.eigenscore_reference):
        assert fn(z[:0]).shape == (0,)  # an empty batch is not an error


def test_engine_and_gates_run_on_the_kernels(tiny, monkeypatch):
    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.local import Engine
    from fastgate.errors import BackendUnavailableError

    prompts = ["Q: a?\nA:", "Q: a longer question?\nA:"]
    taps = TapSpec(layers=(1, 3))
    cfg = GenerationConfig(max_new_tokens=5)
    if DEVICE == "cuda":  # Triton runs CUDA tensors only, outside the interpreter
        tiny = dataclasses.replace(tiny, model=copy.deepcopy(tiny.model).to(DEVICE))
    fused = Engine(tiny, backend="triton")
    assert fused.backend == "triton" and fused.ops.backend == "triton"
    a = fused.generate(prompts, cfg, taps)
    b = Engine(tiny, backend="torch").generate(prompts, cfg, taps)
    torch.testing.assert_close(a.running_sum, b.running_sum, rtol=1e-5, atol=1e-5)
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(BackendUnavailableError, match="CUDA"):
            Engine(tiny, backend="triton")
