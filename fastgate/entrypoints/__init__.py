"""Entry points: the ``fastgate`` command (``cli.py``), the HTTP app (``http/``) and its Ray Serve
replicas (``ray_serve.py``); the address a server listens on by default, once. Kept free of imports so that importing
one part does not load the others.
"""

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "LOOPBACK"]

DEFAULT_HOST = "127.0.0.1"  # loopback: a server is reachable from this machine only, unless asked otherwise
DEFAULT_PORT = 8000  # uvicorn's and vLLM's default
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # bind addresses that need no warning
