"""Entry points: the ``fastgate`` command (``cli.py``), the HTTP app (``http/``) and its Ray Serve
replicas (``ray_serve.py``); the address a server listens on by default, once. Kept free of imports so that importing
one part does not load the others.
"""

import os

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "LOOPBACK", "passive_omp_threads"]

DEFAULT_HOST = "127.0.0.1"  # loopback: a server is reachable from this machine only, unless asked otherwise
DEFAULT_PORT = 8000  # uvicorn's and vLLM's default
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # bind addresses that need no warning


def passive_omp_threads() -> None:
    """Ask torch's OpenMP threads to sleep when a parallel region ends, where the environment names no policy:
    libgomp's default spins them a while first, on the cores the C++ kernels' own threads need between torch's
    products (a 16 x 700 prefill 1.15x HF's forward against 0.86-1.0x, a 2-core Zen 4: docs/models.md). libgomp reads
    it when torch loads: call this before anything imports torch (the command's ``main``, the benches)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
