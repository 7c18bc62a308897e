"""Entry points: the ``fastgate`` command (``cli.py``, ``cli_params.py``), the HTTP app (``http/``) and its Ray Serve
replicas (``ray_serve.py``). Kept free of imports so that importing one part does not load the others.
"""

__all__: list[str] = []
