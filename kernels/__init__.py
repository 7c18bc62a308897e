"""Triton kernels, installed as ``fastgate.kernels``.

Each kernel file holds one op: a private ``@triton.jit`` kernel, a typed launcher that validates shapes and the torch
reference beside it:

- ``probe.py``: the per-step tap accumulate and the fused prober (op 1, docs/ARCHITECTURE.md);
- ``gram.py``: the batched eigenscore (op 2, docs/ARCHITECTURE.md).

Importing a kernel module needs ``triton``; the ops registry (``fastgate.ops.registry.build_ops``) chooses between
them and the torch references once, where the engine is built, and sends inputs a kernel cannot take (e.g. more than
``gram.MAX_K`` samples) to the reference.
"""

__all__: list[str] = []
