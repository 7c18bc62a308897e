"""Triton kernels, installed as ``fastgate.kernels``.

Each kernel file holds one op: a private ``@triton.jit`` kernel, a typed launcher that validates shapes and the torch
reference beside it. The gating kernels (fused prober, running-sum accumulate, batched Gram log-det) land here; until
then every op runs on its torch reference in ``fastgate.ops``.
"""

__all__: list[str] = []
