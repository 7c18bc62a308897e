"""Entry points: the ``fastgate`` command (``cli.py``), the HTTP app (``http/``) and its Ray Serve
replicas (``ray_serve.py``); the address a server listens on by default, once. Kept free of imports so that importing
one part does not load the others.
"""

import os

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "LOG_LEVELS", "LOOPBACK", "OMP_POLICY_SET", "passive_omp_threads"]

DEFAULT_HOST = "127.0.0.1"  # loopback: a server is reachable from this machine only, unless asked otherwise
DEFAULT_PORT = 8000  # uvicorn's and vLLM's default
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # bind addresses that need no warning
# uvicorn's log levels (`fastgate serve --log-level`) -> Python's, which Ray Serve's LoggingConfig takes
LOG_LEVELS = {"critical": "CRITICAL", "error": "ERROR", "warning": "WARNING", "info": "INFO", "debug": "DEBUG",
              "trace": "DEBUG"}
OMP_POLICY_SET = False  # passive_omp_threads set OMP_WAIT_POLICY in this process (not the user)


def passive_omp_threads() -> bool:
    """Ask torch's OpenMP threads to sleep when a parallel region ends, where the environment names no policy:
    libgomp's default spins them a while first, on the cores the C++ kernels' own threads need between torch's
    products (a 16 x 700 prefill 1.15x HF's forward against 0.86-1.0x, a 2-core Zen 4: docs/models.md). libgomp reads
    it when torch loads: call this before anything imports torch (the command's ``main``, the benches). Whether it set
    the policy, in this call or an earlier one (False: the environment had one, kept; :data:`OMP_POLICY_SET`): a bench
    gives llama.cpp's process the environment without it."""
    global OMP_POLICY_SET
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        OMP_POLICY_SET = True
    return OMP_POLICY_SET
