"""torch's CPU work between the C++ kernels of a decode step, on one thread (:func:`serial_torch`).

Why: the C++ kernels split their rows over a pool of their own threads (csrc/ops.cpp ``WorkerPool``; the extension
does not link against torch), and torch's OpenMP threads, after a parallel region, spin on their cores for a while
before they sleep (libgomp). A decode step of few rows runs a handful of torch operations over the logits (SmolLM2's
49,152: a cast to float32, ``log_softmax``, ``argmax``, a ``gather``), each long enough for torch to split it over its
threads; their spinning then takes the cores the next step's pooled products wait for, and the operating system
shares each core between the two in time slices. Measured on a 2-core Zen 4 EPYC, SmolLM2 in bf16 with int4 weights,
a batch-1 step: 14.9-16.1 ms with torch's two threads against 7.6-9.3 ms with torch's at one and the kernels' at two;
the logits' operations alone take 85 us on one thread and 92 us on two (no gain from the second). ``OMP_WAIT_POLICY=
PASSIVE`` does the same for the whole process (8.8-9.7 ms) and more (a prefill's products and C++ attention take turns
too): the ``fastgate`` command sets it, but it must be set before torch loads, which a program that imports fastgate
may not have done; this keeps a decode step off the spinning threads either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["SERIAL_ROWS", "serial_torch"]

# rows up to which a decode step's logits are handled on one torch thread: the steps whose products ran the C++
# kernels when it was measured (float32's 16, fastgate.ops.quant.F32_KERNEL_ROWS; bf16's then 4, now 32 with a kept
# copy: fastgate.ops.quant.BF16_KERNEL_ROWS; 17-32 rows not measured)
SERIAL_ROWS = 16


@contextmanager
def serial_torch(tensor: torch.Tensor, rows: int) -> Iterator[None]:
    """torch's CPU operations inside on one thread where ``tensor`` is on a CPU and ``rows`` <= :data:`SERIAL_ROWS`
    (the C++ kernels, which are told their threads by the caller, must not run inside). ``torch.set_num_threads``
    is process-wide and ~0.1 us a call; the count is restored on the way out."""
    n = torch.get_num_threads()
    if n == 1 or rows > SERIAL_ROWS or tensor.device.type != "cpu":
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
