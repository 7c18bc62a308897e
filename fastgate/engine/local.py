"""The engine: ``Engine.generate``, a facade over the model runner and the decode loop.

:class:`~fastgate.engine.model_runner.ModelRunner` owns the model's passes (prefill, eager or compiled decode step,
prefix cache, taps) and binds the ops (:func:`fastgate.ops.build_ops`), :class:`~fastgate.engine.decode.DecodeLoop`
chooses tokens and keeps the rows' states, :mod:`fastgate.engine.generation` holds the result types. This module holds
:class:`Engine`: what methods and gates read of a model (the runner's attributes, ``engine.ops`` and ``engine.backend``,
which a subclass may swap), the runner's helpers under the names subclasses use, and ``generate``, which checks a call's
arguments and runs one loop from a single admission to its end (:class:`~fastgate.scheduler.Scheduler` runs its own
loops). It imports those modules and none of them imports it (the loops take a runner). ``Generation``,
``GenerationBatch``, ``FinishReason`` and ``accumulate_taps`` are re-exported here for the code that has always imported
them from this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastgate.assets.models import LoadedModel
from fastgate.config import GenerationConfig, TapSpec, as_integer, check_tap_layers
from fastgate.engine.decode import DecodeLoop
from fastgate.engine.generation import FinishReason, Generation, GenerationBatch, check_prompts
from fastgate.engine.lm_head import DEFAULT_COLUMNS
from fastgate.engine.model_runner import ModelRunner
from fastgate.engine.static_step import StepConfig
from fastgate.errors import InputError
from fastgate.ops.reference import accumulate_taps

__all__ = ["Engine", "FinishReason", "Generation", "GenerationBatch", "accumulate_taps"]


def _per_prompt(value, kind: type, n: int, what: str) -> list:
    """``value`` (one ``kind``, None for the default, or one per prompt) as a list of ``n``."""
    if value is None or isinstance(value, kind):
        return [value if value is not None else kind()] * n
    out = [v if v is not None else kind() for v in value]
    if len(out) != n:
        raise InputError(f"generate: {len(out)} {what} for {n} prompts")
    if any(not isinstance(v, kind) for v in out):
        raise InputError(f"generate: {what} must be {kind.__name__} objects")
    return out


class Engine:
    """Batched generation with taps on one loaded model (implements :class:`~fastgate.engine.protocol.LLMEngine`).

    The arguments are :class:`~fastgate.engine.model_runner.ModelRunner`'s (``engine.runner``, built here): ``backend``
    for the gating ops, ``prefix_cache``, ``prefill_chunk``, ``head_columns`` and ``step`` (eager or compiled decode
    steps). The attributes methods and gates read (``lm``, ``model``, ``tokenizer``, ``device``, ``dtype``,
    ``n_layers``, the EOS and pad ids) are the runner's. ``ops`` (every op, :func:`fastgate.ops.build_ops`) and
    ``backend`` are the engine's own, set from the runner's: a subclass may swap them (the baseline pipeline of
    :mod:`fastgate.eval.baseline` does) without changing what the loops run.
    """

    remote = False  # the model runs here: generations join the scheduler's decode loop within the KV budget
    black_box = False  # hidden states, taps and prompt states are all here

    def __init__(self, model: LoadedModel, backend: str = "auto", prefix_cache: int = 32,
                 prefill_chunk: int | None = None, head_columns: int = DEFAULT_COLUMNS,
                 step: StepConfig | str = "auto", forward: str = "auto") -> None:
        if not hasattr(model, "model") or not hasattr(model, "tokenizer"):  # Engine(a model name): AttributeError
            raise InputError(f"Engine takes a loaded model (fastgate.load_model(name)), got {type(model).__name__} "
                             f"{model!r:.60}")
        self.runner = ModelRunner(model, backend, prefix_cache, prefill_chunk, head_columns, step, forward)
        self.ops = self.runner.ops  # every op bound for the model's device (fastgate.ops.Ops)
        self.backend = self.runner.backend

    # ------------------------------------------------------------------ the runner's, read-only
    lm = property(lambda self: self.runner.lm, doc="The :class:`~fastgate.assets.models.LoadedModel`.")
    name = property(lambda self: self.runner.lm.name, doc="The model's name (what messages call the engine).")
    model = property(lambda self: self.runner.model, doc="The HF causal LM.")
    tokenizer = property(lambda self: self.runner.tokenizer)
    device = property(lambda self: self.runner.device)
    dtype = property(lambda self: self.runner.dtype, doc="The weights' dtype (chosen when the model loaded).")
    dtype_name = property(lambda self: self.runner.dtype_name, doc="``float32`` or ``bfloat16``: what records name.")
    n_layers = property(lambda self: self.runner.n_layers)
    kv = property(lambda self: self.runner.kv, doc="The :class:`~fastgate.engine.kv_cache.KVCacheManager`.")
    eos_ids = property(lambda self: self.runner.eos_ids)
    eos_id = property(lambda self: self.runner.eos_id)
    eos_id_set = property(lambda self: self.runner.eos_id_set)
    pad_id = property(lambda self: self.runner.pad_id)
    prefix_cache = property(lambda self: self.runner.prefix_cache)
    prefill_chunk = property(lambda self: self.runner.prefill_chunk)
    sliced_head = property(lambda self: self.runner.sliced_head)
    prefix_hits = property(lambda self: self.runner.prefix_hits, doc="Prompts prefilled from a cached prefix.")

    def finish_warm_up(self) -> None:
        """Take on now the one-time work the products' first calls of more rows would do (oneDNN's probes of each
        class of row counts, :func:`fastgate.ops.dense.probe_pending`): a warm-up calls it after its first answer,
        so that no timed pass or request pays for it. Changes no result."""
        from fastgate.ops.dense import probe_pending

        probe_pending()

    def bind_thread(self) -> None:
        """The calling thread's current CUDA device is the model's (:meth:`ModelRunner.bind_thread`)."""
        self.runner.bind_thread()

    def count_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` as a prompt (special tokens included)."""
        return self.runner.count_tokens(text)

    def cache_prefix(self, text: str) -> int:
        """Keep the KV cache of ``text`` for prompts that start with its tokens (:meth:`ModelRunner.cache_prefix
        <fastgate.engine.model_runner.ModelRunner.cache_prefix>`); the number of prefix tokens."""
        return self.runner.cache_prefix(text)

    def token_pieces(self, token_ids: list[int]) -> list[bytes]:
        """Raw bytes of each token (special tokens give ``b""``), the input of ``ops.align_words``."""
        return self.runner.token_pieces(token_ids)

    def prompt_states(self, prompts: list[str], layer: int | None = None, batch_size: int = 16) -> torch.Tensor:
        """Hidden state ``[B, d]`` float32 at ``layer`` of each prompt's last token, from a prefill stopped after that
        layer (:meth:`ModelRunner.prompt_states <fastgate.engine.model_runner.ModelRunner.prompt_states>`)."""
        return self.runner.prompt_states(prompts, layer, batch_size)

    def encode(self, prompts: list[str], max_new_tokens: int | list[int]) -> tuple[list[list[int]], list[bool]]:
        """Token ids of each prompt, cut on the left to leave room for its ``max_new_tokens`` and a forced EOS (the
        KV owner's truncation, :meth:`KVCacheManager.truncate <fastgate.engine.kv_cache.KVCacheManager.truncate>`);
        and whether each was cut."""
        return self.runner.encode(prompts, max_new_tokens)

    # the runner's helpers under their old names, for subclasses (fastgate.eval.baseline.ReferenceEngine)

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.pad(rows)

    def _tokens_before(self, token_ids: list[int], n_chars: int) -> int:
        return self.runner.tokens_before(token_ids, n_chars)

    # ------------------------------------------------------------------ main entry
    @torch.inference_mode()
    def generate(
        self,
        prompts: list[str],
        config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        taps: TapSpec | Sequence[TapSpec | None] | None = None,
        k: int | Sequence[int] = 1,
        seeds: Sequence[int | None] | None = None,
    ) -> GenerationBatch:
        """Generate for a batch of prompts.

        Args:
            prompts: B prompt strings (left-padded into one batch).
            config: decoding settings, one for the batch or one per prompt (rows may then differ in temperature,
                top-k, top-p, stop strings, max tokens and greedy vs sampled).
            taps: signals to capture, one :class:`~fastgate.config.TapSpec` for the batch or one per prompt; with
                per-prompt taps the running sums cover the union of the layers asked for (``batch.layers``), and
                rows that asked for none of them are still summed (their sums are simply not read).
            k: samples per prompt (an int, or one per prompt); the k samples share the prompt's prefill (KV cache
                expanded after it).
            seeds: one sampling seed per prompt. Sample j of prompt i then draws from its own generator seeded with
                ``(seeds[i], j)``, so its tokens do not depend on what else is in the batch. With one config and no
                seeds, ``config.seed`` seeds one generator shared by the whole batch; with per-prompt configs a
                sampled row without a seed draws from its own generator seeded with its config's seed (0 if None).

        Returns:
            A :class:`GenerationBatch` with ``Σ k_i`` sequences, prompt-major (the samples of prompt i follow those of
            prompt i-1).
        """

        check_prompts(prompts)
        b = len(prompts)
        one_k = not isinstance(k, (list, tuple))  # an int (numpy's too), or one per prompt
        per_row = not (config is None or isinstance(config, GenerationConfig)) or not (
            taps is None or isinstance(taps, TapSpec)) or not one_k
        cfgs = _per_prompt(config, GenerationConfig, b, "configs")
        row_taps = _per_prompt(taps, TapSpec, b, "taps")
        ks = [as_integer("generate: k", x) for x in ([k] * b if one_k else k)]
        if len(ks) != b:
            raise InputError(f"generate: {len(ks)} sample counts for {b} prompts")
        if any(x < 1 for x in ks):
            raise InputError(f"k must be >= 1, got {k}")
        if seeds is not None:
            if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__len__"):
                raise InputError(f"generate: seeds must be one integer (or None) per prompt, got {seeds!r:.60}")
            seeds = [None if s is None else as_integer("generate: seed", s) for s in seeds]
            if len(seeds) != b:
                raise InputError(f"generate: {len(seeds)} seeds for {b} prompts")
        mids = {t.mid_layer if t.mid_layer is not None else self.n_layers // 2
                for t in row_taps if t.pre_answer or t.eos_state}
        if len(mids) > 1:
            raise InputError(f"generate: rows ask for pre-answer / EOS states at different layers {sorted(mids)}")
        mid = mids.pop() if mids else (row_taps[0].mid_layer if row_taps[0].mid_layer is not None
                                       else self.n_layers // 2)
        if per_row:
            layers = tuple(sorted({x for t in row_taps for x in t.layers}))
        else:
            layers = tuple(row_taps[0].layers)
        check_tap_layers((*layers, mid), self.n_layers)
        want_pre = any(t.pre_answer for t in row_taps)
        want_eos = any(t.eos_state for t in row_taps)
        # One config: sampled rows without a seed share one generator (its config's seed), and with no seeds at all
        # they draw together over the whole batch (their draws then depend on the batch, as they always have).
        generator = None
        if not per_row and cfgs[0].do_sample and cfgs[0].seed is not None:
            # within torch's 64-bit seeds (2**70 was torch's "Overflow"; seeds passed per row were taken modulo too)
            generator = torch.Generator(device=self.device).manual_seed(cfgs[0].seed % 2**63)
        loop = DecodeLoop(self.runner, mid, shared_rng=not per_row and seeds is None, generator=generator)
        specs = [(prompts[i], cfgs[i], row_taps[i], ks[i], seeds[i] if seeds is not None else None) for i in range(b)]
        (ticket,) = loop.add(specs, one_ticket=(layers, want_pre, want_eos), per_row=per_row)
        while ticket.result is None:
            loop.step()
        return ticket.result
