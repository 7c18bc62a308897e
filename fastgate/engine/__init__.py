"""The engine: the model's passes and the decode loops that serve many rows at once.

``protocol.py`` is the contract (:class:`~fastgate.engine.protocol.LLMEngine`) that ``local.py`` (the facade over a
model here, :class:`~fastgate.engine.local.Engine`) and ``remote.py`` (an OpenAI-compatible server) implement.
``model_runner.py`` holds the model's passes (prefill, step, prefix cache, taps), ``packed.py`` and ``decode.py`` the
decode loops, ``static_step.py`` the compiled step, ``attention.py`` the one switch of HF's attention
implementation, ``kv_cache.py`` the KV memory and its owner (:class:`~fastgate.engine.kv_cache.KVCacheManager`),
``lm_head.py`` the output projection and ``generation.py`` the result types. Kept free of imports so that importing
one part does not load the others.
"""

__all__: list[str] = []
