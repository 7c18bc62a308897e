"""The engine contract: what the methods, the scheduler and the runtime may call on an engine, local or remote.

:class:`LLMEngine` is implemented by :class:`~fastgate.engine.local.Engine` (a model in this process) and
:class:`~fastgate.engine.remote.RemoteEngine` (an OpenAI-compatible server). Capabilities are declared attributes,
read as they are, never probed with ``getattr``:

- ``remote``: no model here; each tick's generations go out at once through ``generate_each``
  (:class:`ConcurrentEngine`), with no decode loop and no KV memory on this side;
- ``black_box``: only text and token log-probabilities come back (no hidden states, taps or prompt states): the
  methods that read hidden states refuse such an engine.

A local engine also has ``kv`` (its :class:`~fastgate.engine.kv_cache.KVCacheManager`), ``model`` and the loops'
needs; those belong to :class:`~fastgate.engine.local.Engine` itself, asked for only where ``remote`` is false.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.generation import GenerationBatch
    from fastgate.ops import Ops

__all__ = ["ConcurrentEngine", "LLMEngine"]


@runtime_checkable
class LLMEngine(Protocol):
    """Batched generation with token log-probabilities (and, unless ``black_box``, taps) on one model."""

    remote: bool  # generations go out as concurrent requests (ConcurrentEngine.generate_each): no loop, no KV here
    black_box: bool  # only text and token log-probabilities come back: no hidden states, taps or prompt states
    name: str  # what messages call the engine: the model's name, or the server's model and address
    lm: Any  # the model's name, max_context, fingerprint, n_layers and hidden_size (LoadedModel or RemoteLM)
    ops: Ops  # every gate op, bound once for this engine's device
    backend: str
    device: Any  # where tensors the gates read live (a torch device; None on a remote engine: the CPU)
    dtype_name: str | None  # the weights' dtype as records name it; None where the server's weights are its own
    n_layers: int
    prefix_hits: int

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as a prompt (an estimate where the tokenizer is not here)."""
        ...

    def finish_warm_up(self) -> None:
        """Take on the one-time work a warm-up's first answer left for later passes (nothing where none is left)."""
        ...

    def bind_thread(self) -> None:
        """Make the calling thread's current device the engine's, for work that runs on the current device rather
        than a tensor's (CUDA graphs, Triton launches): a thread that runs the engine calls it first (nothing off
        CUDA or remotely)."""
        ...

    def cache_prefix(self, text: str) -> int:
        """Keep the KV of ``text`` for prompts that start with it; the prefix's tokens (0: nothing cached)."""
        ...

    def token_pieces(self, token_ids: list[int]) -> list[bytes]:
        """Raw bytes of each token, the input of ``ops.align_words``."""
        ...

    def prompt_states(self, prompts: list[str], layer: int | None = None, batch_size: int = 16) -> torch.Tensor:
        """Hidden state ``[B, d]`` at ``layer`` of each prompt's last token (refused by a ``black_box`` engine)."""
        ...

    def generate(self, prompts: list[str], config: GenerationConfig | Sequence[GenerationConfig] | None = None,
                 taps: TapSpec | Sequence[TapSpec | None] | None = None, k: int | Sequence[int] = 1,
                 seeds: Sequence[int | None] | None = None) -> GenerationBatch:
        """Generate for a batch of prompts (``k`` samples each), with the taps asked for."""
        ...


@runtime_checkable
class ConcurrentEngine(LLMEngine, Protocol):
    """A ``remote`` engine: each prompt is its own request, all in flight at once."""

    def generate_each(self, prompts: list[str], configs: Sequence[GenerationConfig | None],
                      taps: Sequence[TapSpec | None] | None = None, ks: Sequence[int] | None = None,
                      seeds: Sequence[int | None] | None = None) -> list[GenerationBatch | BaseException]:
        """One result per prompt, or the error that ended that prompt's request alone."""
        ...

    def submit_each(self, prompts: list[str], configs: Sequence[GenerationConfig | None],
                    taps: Sequence[TapSpec | None] | None = None, ks: Sequence[int] | None = None,
                    seeds: Sequence[int | None] | None = None) -> list[Any]:
        """:meth:`generate_each`'s requests in flight without waiting: per prompt a handle with ``done()``,
        ``result()`` (a :class:`GenerationBatch` or the prompt's error), ``futures`` and ``cancel()``, or the error
        that refused it at once."""
        ...
