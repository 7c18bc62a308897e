"""The extension's worker pool (csrc/ops.cpp, ``WorkerPool``): the threads a C++ op splits its rows over, started once.
Results do not depend on the split (each output row is one thread's), calls from two Python threads at once (the GIL
released) each get every row, and a forked child gets threads of its own (a fork keeps only the forking thread)."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from fastgate.assets.quant import Int4Linear, quantize_int4
from fastgate.ops.quant import f32_tiles
from fastgate.ops.registry import import_ext

EXT = import_ext()
needs_f32 = pytest.mark.skipif(
    EXT is None or not EXT.quant_f32_kernels_supported() or not hasattr(EXT, "set_quant_grain"),
    reason="no C++ extension with the float32 kernels and the pool, or no AVX2 + FMA")


def _product(x: torch.Tensor, layer: Int4Linear, threads: int) -> torch.Tensor:
    out = torch.empty((x.shape[0], layer.out_features))
    codes, scales, offsets = f32_tiles(layer)
    EXT.int4_matmul_f32(x.data_ptr(), x.stride(0), codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(),
                        out.data_ptr(), x.shape[0], layer.out_features, layer.in_features, threads)
    return out


def _layer(n: int, k: int, seed: int) -> Int4Linear:
    return Int4Linear(*quantize_int4(torch.randn((n, k), generator=torch.Generator().manual_seed(seed)) * 0.05))


@pytest.fixture
def small_grain():
    """Every product split over the threads it may have (a grain of one multiply-add), restored after."""
    EXT.set_quant_grain(1)
    yield
    EXT.set_quant_grain(1 << 17)


@needs_f32
def test_split_products_equal_one_thread_s_bitwise(small_grain):
    g = torch.Generator().manual_seed(0)
    for i, (m, n, k) in enumerate([(1, 64, 32), (1, 577, 96), (3, 1000, 64), (2, 129, 160), (1, 7, 32)] * 8):
        layer = _layer(n, k, i)
        x = torch.randn(m, k, generator=g)
        assert torch.equal(_product(x, layer, 4), _product(x, layer, 1))
    with pytest.raises(ValueError, match="grain"):
        EXT.set_quant_grain(0)


@needs_f32
def test_two_callers_at_once_each_get_every_row(small_grain):
    layer = _layer(700, 96, 1)
    xs = [torch.randn(2, 96, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    want = [_product(x, layer, 1) for x in xs]
    bad = []

    def call(j: int) -> None:
        for _ in range(200):
            if not torch.equal(_product(xs[j], layer, 2), want[j]):
                bad.append(j)

    threads = [threading.Thread(target=call, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and bad == []


def _child(queue, layer: Int4Linear, x: torch.Tensor, want: bytes) -> None:
    # the extension only: torch's own parallel operations may hang in a forked child (its OpenMP pool)
    EXT.set_quant_grain(1)
    queue.put(_product(x, layer, 2).numpy().tobytes() == want)


@needs_f32
def test_a_forked_child_splits_on_threads_of_its_own(small_grain):
    layer = _layer(300, 64, 2)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    want = _product(x, layer, 1).numpy().tobytes()
    assert _product(x, layer, 2).numpy().tobytes() == want  # the parent's pool exists before the fork
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, layer, x, want))
    proc.start()
    proc.join(timeout=60)
    alive = proc.is_alive()
    if alive:
        proc.kill()
    assert not alive and proc.exitcode == 0 and queue.get(timeout=5) is True
