"""The ops registry: one choice per op for (backend, device), one read of FASTGATE_BACKEND, the reference as the
fallback of every fast implementation, and ``build_ops`` as the one entry point of ``fastgate.ops``."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastgate import ops
from fastgate.errors import BackendUnavailableError, InputError, ShapeError
from fastgate.gates.checkpoints import random_probe_params
from fastgate.ops import reference, registry
from fastgate.ops._cpu import CpuOps
from fastgate.ops.dense import onednn_agrees
from fastgate.ops.registry import OP_NAMES, Ops, build_ops
from fastgate.ops.sampling import ext_token_logprobs

ROOT = Path(__file__).resolve().parent.parent


# what `auto` chooses where the extension is built (`make install` builds it; test_ext_is_built_in_ci checks that CI
# did); an install with FASTGATE_SKIP_EXT=1 runs the references, which the tests without this mark cover
needs_ext = pytest.mark.skipif(not registry.ext_available(), reason="the C++ extension is not built")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("FASTGATE_BACKEND", raising=False)


@needs_ext
def test_ops_hold_every_op_and_record_each_choice():
    o = build_ops("auto", "cpu")
    assert isinstance(o, Ops)
    assert set(OP_NAMES) == {f.name for f in dataclasses.fields(Ops)} - {"backend", "device", "backends"}
    assert tuple(o.backends) == OP_NAMES
    assert all(callable(getattr(o, name)) for name in OP_NAMES)
    # the extension is built by `make install`: on CPU it runs the eigenscore and the CPU ops
    assert o.backend == "ext" and o.device == torch.device("cpu")
    # the C++ prefill attention needs AVX512-BF16 (bf16 keys) or AVX2 and FMA (float32); the quantized products
    # that (bf16 rows) or AVX2 and FMA (float32)
    ext = registry.import_ext()
    kernel = ext.prefill_attention_bf16_supported()
    quant = kernel or ext.quant_f32_kernels_supported()
    layers = ext.torch_exp_found()  # the float32 decoder layers in one call: AVX2, FMA and torch's exp
    assert dict(o.backends) == {
        "accumulate": "torch", "probe_logits": "torch", "eigenscore": "ext", "answer_nll": "torch",
        "decode_attention": "ext", "decode_attention_step": "ext", "rms_norm": "ext", "rope": "ext",
        # the bf16 SwiGLU: AVX512-BF16 kernels built, torch's exp, a probe that finds torch's bits
        "swiglu": "ext" if kernel and layers else "torch",
        "prefill_attention": "ext" if kernel or ext.prefill_attention_f32_supported() else "blocked",
        "int4_matmul": "ext" if quant else "torch",
        "int8_matmul": "ext" if quant else "torch",
        # the dense products' weights reordered once where oneDNN multiplies bf16 with F.linear's bits
        "dense_linear": "onednn" if onednn_agrees() else "torch",
        "decode_layers": "ext" if layers else "torch",
        # the tokens' log-probs: AVX2, FMA, torch's exp and log, and a probe that finds torch's bits
        "token_logprobs": "ext" if ext_token_logprobs(ext) is not reference.token_logprobs else "torch",
        "align_words": "ext", "word_logprobs": "ext",
        "align_word_logprobs_batch": "ext",
        "ais_scores": "ext", "ais_scores_batch": "ext", "ais_topk_batch": "ext",
    }
    with pytest.raises(TypeError):
        o.backends["eigenscore"] = "torch"  # read-only record
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.eigenscore = reference.eigenscore


@pytest.mark.parametrize("backend", ["torch", "python"])
def test_reference_backends_run_every_reference(backend):
    o = build_ops(backend, "cpu")
    assert o.backend == "torch" and o.cpu_backend == "python"
    assert o.eigenscore is reference.eigenscore and o.accumulate is reference.accumulate_taps
    assert o.probe_logits is reference.probe_logits and o.answer_nll is reference.answer_nll
    assert o.decode_attention is reference.decode_attention and o.backends["decode_attention"] == "torch"
    assert o.decode_attention_step is reference.decode_attention_step and o.rms_norm is reference.rms_norm
    assert {o.backends[n] for n in ("decode_attention_step", "rms_norm", "rope", "swiglu", "prefill_attention")} == {
        "torch"}
    assert o.prefill_attention is reference.prefill_attention
    assert o.token_logprobs is reference.token_logprobs and o.backends["token_logprobs"] == "torch"
    assert {o.backends[n] for n in registry.CPU_OPS} == {"python"}


@needs_ext
@pytest.mark.parametrize("value,want", [("torch", ("torch", "python")), ("python", ("torch", "python")),
                                        ("PYTHON", ("torch", "python")), ("ext", ("ext", "ext")),
                                        ("auto", ("ext", "ext")), ("", ("ext", "ext"))])
def test_fastgate_backend_applies_where_auto_is_asked(monkeypatch, value, want):
    monkeypatch.setenv("FASTGATE_BACKEND", value)
    o = build_ops("auto", "cpu")
    assert (o.backend, o.cpu_backend) == want
    # an explicit backend is not overridden by the variable
    assert build_ops("ext", "cpu").backend == "ext"
    assert build_ops("torch", "cpu").cpu_backend == "python"


@needs_ext
def test_fastgate_backend_is_read_once_per_build_and_nowhere_else(monkeypatch, tiny):
    calls = []
    real = registry.env_backend

    def counting():
        calls.append(os.environ.get("FASTGATE_BACKEND"))
        return real()

    monkeypatch.setattr(registry, "env_backend", counting)
    monkeypatch.setenv("FASTGATE_BACKEND", "torch")
    assert build_ops("auto", "cpu").backend == "torch"
    assert calls == ["torch"]
    from fastgate.engine.local import Engine

    engine = Engine(tiny)  # the engine builds its ops once
    assert calls == ["torch", "torch"]
    assert engine.backend == "torch" and engine.ops.backends["ais_scores"] == "python"
    build_ops("ext", "cpu")  # an explicit backend does not read the variable
    assert len(calls) == 2
    # no other module reads the variable
    readers = [p.relative_to(ROOT) for d in ("fastgate", "kernels") for p in (ROOT / d).rglob("*.py")
               if re.search(r"[\"']FASTGATE_BACKEND[\"']", p.read_text())]
    assert readers == [Path("fastgate/ops/registry.py")]


def test_unknown_backends_are_input_errors(monkeypatch):
    with pytest.raises(InputError, match="unknown backend 'gpu'"):
        build_ops("gpu", "cpu")
    monkeypatch.setenv("FASTGATE_BACKEND", "fast")
    with pytest.raises(InputError, match="FASTGATE_BACKEND='fast'"):
        build_ops("auto", "cpu")


def test_without_the_extension(monkeypatch):
    monkeypatch.setattr(registry, "import_ext", lambda: None)
    o = build_ops("auto", "cpu")
    assert o.backend == "torch" and set(o.backends.values()) - {"onednn"} == {"torch", "python", "blocked"}
    assert o.backends["prefill_attention"] == "blocked"  # torch operations: no extension needed
    with pytest.raises(BackendUnavailableError, match="fastgate._C"):
        build_ops("ext", "cpu")


def test_insisted_backends_fail_where_they_cannot_run(monkeypatch):
    with pytest.raises(BackendUnavailableError, match="CPU tensors"):
        build_ops("ext", "cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        build_ops("triton", "cpu")


def test_every_op_of_auto_gives_the_reference_numbers():
    """Each name is wired to its own op: the fast choice equals the reference choice on one input per op."""
    fast, ref = build_ops("auto", "cpu"), build_ops("torch", "cpu")
    torch.manual_seed(0)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s), dim=-1)  # noqa: E731
    Q, P, D = unit(3, 97), unit(3, 97), unit(3, 11, 97)
    pieces = [" The", " capital", " of", " Burkina", " Faso", " is", " Ouaga", "dougou", "."]
    lp = torch.log(torch.rand(len(pieces)))
    z = torch.randn(4, 6, 33)
    sums, counts = torch.randn(2, 3, 16), torch.tensor([3.0, 1.0])
    params = random_probe_params(3, 16, 8, seed=0)

    def same(a, b):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        elif isinstance(a, (tuple, list)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    calls = {
        "probe_logits": (sums, counts, params),
        "eigenscore": (z,),
        "answer_nll": (lp[None], torch.ones(1, len(pieces), dtype=torch.bool)),
        "align_words": (pieces,),
        "word_logprobs": (lp, fast.align_words(pieces)[1]),
        "align_word_logprobs_batch": ([pieces, pieces[:3]], [lp, lp[:3]]),
        "ais_scores": (Q[0], P[0], D[0]),
        "ais_scores_batch": (Q, P, D),
        "ais_topk_batch": (Q, P, D, 4),
    }
    for name, args in calls.items():
        same(getattr(fast, name)(*args), getattr(ref, name)(*args))
    for mode in ops.AIS_MODES:
        same(fast.ais_topk_batch(Q, P, D, 4, mode), ref.ais_topk_batch(Q, P, D, 4, mode))
    a, b = torch.zeros(2, 3, 16), torch.zeros(2, 3, 16)
    fast.accumulate(a, sums, torch.tensor([1.0, 0.0]))
    ref.accumulate(b, sums, torch.tensor([1.0, 0.0]))
    assert torch.equal(a, b)
    # on a CPU `auto` binds the torch reference for these: compare with the formulas too, not only with itself
    assert torch.equal(a[0], sums[0]) and not a[1].any()
    torch.testing.assert_close(fast.answer_nll(lp[None], torch.ones(1, len(pieces), dtype=torch.bool)),
                               -lp.mean()[None])
    torch.testing.assert_close(fast.eigenscore(z), _eigenscore_formula(z))


def _eigenscore_formula(z: torch.Tensor, alpha: float = 1e-3) -> torch.Tensor:
    """SeaKR's eigenscore written out: the rows centred over their features, logdet(Zc Zcᵀ + αI) / k, float64."""
    zc = z.double() - z.double().mean(-1, keepdim=True)  # [B, k, d]
    gram = zc @ zc.transpose(1, 2) + alpha * torch.eye(z.shape[1], dtype=torch.float64)
    return (torch.logdet(gram) / z.shape[1]).float()


@needs_ext
def test_build_ops_is_the_one_entry_point():
    # the older entry points (ops.load / CpuOps, ops.backend.gate_ops / GateOps, module-level ops) are gone
    assert not hasattr(ops, "load") and not hasattr(ops, "CpuOps") and not hasattr(ops, "align_words")
    with pytest.raises(ImportError):
        __import__("fastgate.ops.backend")
    o = build_ops("auto", "cpu")
    assert o.backend == "ext" and o.accumulate is reference.accumulate_taps
    z = torch.randn(3, 5, 40)
    assert torch.equal(o.eigenscore(z), CpuOps("ext", registry.import_ext()).eigenscore(z))  # the C++ eigenscore
    assert o.cpu_backend == "ext" and o.align_words.__self__.backend == "ext"


@needs_ext
def test_engine_builds_the_registry_once(tiny):
    from fastgate.engine.local import Engine

    engine = Engine(tiny)
    assert isinstance(engine.ops, Ops)
    assert engine.backend == engine.ops.backend == "ext"
    assert engine.ops is engine.runner.ops
    assert engine.runner.accumulate is engine.ops.accumulate
    assert Engine(tiny, backend="torch").ops.backends["eigenscore"] == "torch"


# --------------------------------------------------------------------------------- fallbacks to the references
triton_needed = pytest.mark.skipif(
    not registry.triton_available() or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton on CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton_needed
def test_triton_eigenscore_falls_back_to_the_reference_beyond_its_register_tile(monkeypatch):
    from fastgate.kernels import gram

    launched = []
    kernel = gram.eigenscore

    def counting(z, *args, **kwargs):
        launched.append(z.shape[1])
        return kernel(z, *args, **kwargs)

    monkeypatch.setattr(gram, "eigenscore", counting)
    o = build_ops("triton", DEVICE)
    assert {o.backends[n] for n in registry.GATE_OPS} == {"triton"}
    torch.manual_seed(5)
    for k in (gram.MAX_K + 1, 80):
        z = torch.randn(2, k, 24, device=DEVICE)
        valid = torch.ones(2, k, dtype=torch.bool, device=DEVICE)
        valid[1, ::7] = False
        with pytest.raises(ShapeError, match=f"k={k} > {gram.MAX_K}"):
            kernel(z)  # the kernel alone cannot take it ...
        for kwargs in ({}, {"valid": valid}, {"scale": "cov"}):
            # ... the registry's op gives the reference's numbers instead of raising
            assert torch.equal(o.eigenscore(z, **kwargs), reference.eigenscore(z, **kwargs))
    assert launched == []
    z = torch.randn(2, gram.MAX_K, 24, device=DEVICE)  # at the limit the kernel itself runs
    torch.testing.assert_close(o.eigenscore(z), reference.eigenscore(z), rtol=1e-5, atol=1e-5)
    assert launched == [gram.MAX_K]


@triton_needed
def test_triton_engine_gates_score_more_than_64_samples(tiny):
    from fastgate.engine.local import Engine

    engine = Engine(tiny, backend="triton")
    assert engine.backend == "triton" and engine.ops.backends["eigenscore"] == "triton"
    z = torch.randn(1, 70, 32, device=DEVICE)
    assert torch.equal(engine.ops.eigenscore(z), reference.eigenscore(z))


@triton_needed
def test_triton_accumulate_falls_back_for_a_running_sum_it_cannot_write():
    o = build_ops("triton", DEVICE)
    states = torch.randn(3, 2, 9, device=DEVICE)
    weight = torch.tensor([1.0, 0.0, 1.0], device=DEVICE)
    for running in (torch.zeros(3, 9, 2, device=DEVICE).transpose(1, 2),  # non-contiguous
                    torch.zeros(3, 2, 9, dtype=torch.float64, device=DEVICE)):  # not float32
        want = running.clone()
        reference.accumulate_taps(want, states, weight)
        o.accumulate(running, states, weight)
        assert torch.equal(running, want)
    running, want = torch.zeros(3, 2, 9, device=DEVICE), torch.zeros(3, 2, 9, device=DEVICE)
    o.accumulate(running, states, weight)  # the kernel's own case
    reference.accumulate_taps(want, states, weight)
    torch.testing.assert_close(running, want)


@needs_ext
def test_the_fallback_goes_where_the_fast_implementation_says_it_cannot_run():
    calls = []
    wrapped = registry._with_fallback(lambda *a, **k: calls.append("fast"), lambda *a, **k: calls.append("ref"),
                                      lambda z, *a, **k: z.device.type == "cpu")
    wrapped(torch.zeros(2, 3, 8, device="meta"))
    wrapped(torch.zeros(2, 3, 8))
    assert calls == ["ref", "fast"]
    o = build_ops("ext", "cpu")  # the C++ eigenscore runs CPU tensors; others go to the reference, on their device
    assert o.eigenscore.reference is reference.eigenscore and o.eigenscore.fast.__self__.backend == "ext"


def test_importing_and_building_on_cpu_does_not_import_triton():
    code = ("import sys; import fastgate.ops, fastgate.engine.local; fastgate.ops.build_ops('auto', 'cpu'); "
            "print('triton' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "FASTGATE_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_numpy_inputs_still_work_through_the_registry():
    o = build_ops("auto", "cpu")
    lp = np.log(np.array([0.5, 0.25, 0.9]))
    words, ids = o.align_words(["Hel", "lo", " you"])
    torch.testing.assert_close(o.word_logprobs(lp, ids), torch.tensor([np.log(0.5 * 0.25) / 2, np.log(0.9)],
                                                                      dtype=torch.float32))
