"""The engine: the model's passes and the decode loops that serve many rows at once.

``local.py`` is the facade (:class:`~fastgate.engine.local.Engine`), ``model_runner.py`` the model's passes (prefill,
step, prefix cache, taps), ``packed.py`` and ``decode.py`` the decode loops, ``static_step.py`` the compiled step,
``kv_cache.py`` the KV memory, ``lm_head.py`` the output projection, ``generation.py`` the result types and
``remote.py`` the same contract over an OpenAI-compatible server. Kept free of imports so that importing one part
does not load the others.
"""

__all__: list[str] = []
