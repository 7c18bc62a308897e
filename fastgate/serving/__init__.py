"""Serving: what a request needs, loaded once (``runtime.py``), and the thread-safe service in front of one scheduler
(``service.py``), with the plain-completion program the server answers for its own model (``completion.py``). Kept
free of imports so that importing one part does not load the others.
"""

__all__: list[str] = []
