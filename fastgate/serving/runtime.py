"""One loaded model and its retrievers, building methods on request: what ``fastgate ask``, ``fastgate eval`` and
``fastgate serve`` share.

Requests are checked with :func:`check_request` before anything heavy is loaded, so a bad method name, parameter or
missing checkpoint fails in milliseconds with a clear message. Where the model is known (a server), the check builds
the method's typed config once, calibrated for the model, and it travels with the :class:`AnswerRequest` to the
method built for it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastgate.assets.pins import DEFAULT_MODEL
from fastgate.assets.precision import DTYPES
from fastgate.assets.quant import WEIGHTS
from fastgate.engine.static_step import STEP_MODES
from fastgate.errors import UnknownNameError
from fastgate.settings import setting

__all__ = ["AnswerRequest", "Runtime", "RuntimeConfig", "check_request", "finite", "result_record"]


@dataclass(frozen=True)
class AnswerRequest:
    """A validated request to answer with a method: the method, the retriever it searches, the parameters given by
    the user and, once built, the method's typed config (equal requests compare equal with or without it)."""

    method: str
    retriever: str | None  # None for methods that never retrieve
    params: tuple[tuple[str, Any], ...]  # user parameters, sorted; calibration is applied on top at build time
    # the method's config: the user's parameters on top of the model's calibrated ones, validated once (None: built
    # when the method is, see Runtime.method_config)
    config: Any = field(default=None, compare=False)

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)


def check_request(method: str, params: dict[str, Any] | None = None, retriever: str | None = None,
                  model_name: str | None = None, remote: str | None = None,
                  calibrate: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None) -> AnswerRequest:
    """Validate a method request without loading the model (unknown names, bad parameters, missing checkpoints).

    ``remote``: the name of the remote engine the method will run on (``RemoteConfig.name``); a method that reads
    hidden states is then refused. ``calibrate``: ``(method, params) -> params`` with the model's calibrated values
    under the user's (:meth:`Runtime.calibrated`, once the model is known): the config is then built from those and
    travels with the request (``request.config``), so building the method does not build it again.

    Raises:
        UnknownNameError: unknown method or retriever.
        InputError: a parameter the method does not have, a value of the wrong type or range, or a method that
            cannot run on the remote engine.
        CheckpointError: the method needs a checkpoint that is missing for ``model_name``.
    """
    from fastgate.errors import InputError
    from fastgate.methods import METHODS, make_config
    from fastgate.methods.base import black_box_refusal
    from fastgate.retrieval import RETRIEVERS

    if method not in METHODS:
        raise UnknownNameError("method", method, list(METHODS))
    cls = METHODS[method]
    if remote is not None and not cls.black_box:
        raise InputError(black_box_refusal(method, remote))
    if retriever is None:
        retriever = cls.default_retriever
    if retriever not in RETRIEVERS:
        raise UnknownNameError("retriever", retriever, RETRIEVERS)
    params = dict(params or {})
    config = make_config(method, params if calibrate is None else calibrate(method, params))
    cls.preflight(config, model_name)
    return AnswerRequest(method, retriever if cls.needs_retriever else None, tuple(sorted(params.items())),
                         None if calibrate is None else config)


@dataclass(frozen=True)
class RuntimeConfig:
    """What a :class:`Runtime` loads, each with its default and its flag: the one source of these defaults for the
    library's ``Runtime(...)``, ``fastgate serve`` (:class:`~fastgate.serving.service.ServiceConfig` extends it) and
    the CLI's ``ask`` / ``eval`` flags."""

    # the default embedded model, the smallest of fastgate.assets.models.MODELS
    model: str = setting(DEFAULT_MODEL, "embedded model ({models}) or a local HF directory (default: %(default)s)")
    # CUDA when available
    device: str = setting("auto", "auto (CUDA if available), cpu or cuda (default: %(default)s)")
    # the weights': bf16 on CUDA and on a CPU that multiplies it natively, else float32
    dtype: str = setting("auto", "the weights' dtype; auto: bfloat16 on CUDA and on a CPU that multiplies it natively "
                                 "(AMX-BF16 / AVX512-BF16, confirmed by a timed product at load), float32 elsewhere "
                                 "(default: %(default)s)", choices=("auto", *DTYPES))
    # compiled (a CUDA graph per batch bucket) on CUDA, eager on a CPU (compiling takes minutes there and gains little:
    # docs/RESULTS.md)
    step: str = setting("auto", "decode steps: compiled by torch.compile, one static step per batch size (a CUDA graph "
                                "on GPU; the first use of each size compiles, cached under $FASTGATE_HOME/compile), or "
                                "eager; auto: compiled on CUDA, eager on CPU (default: %(default)s)",
                        choices=STEP_MODES)
    # auto: 4-bit decode steps where the CPU runs the weight-only kernels and the model ships 4-bit blocks, else float
    weights: str = setting("auto", "how the decoder blocks' linear weights and the LM head are held: float (in "
                                   "--dtype), int8 (weight-only, one scale per output channel), int4 (groups of 32: "
                                   "an embedded model's own 4-bit GGUF blocks, int8 where the GGUF holds a layer "
                                   "otherwise), int4-dense (int4 for decode steps of <= 4 rows, a de-quantized copy "
                                   "for larger products: prefill at float's speed, more memory) or auto (int4-dense "
                                   "for an embedded model in bfloat16 on an AVX-512 CPU or in float32 chosen by "
                                   "--dtype auto on an AVX2 CPU, else float); activations "
                                   "stay in --dtype, logits float32; fastgate/assets/quant.py (default: %(default)s)",
                           choices=WEIGHTS)
    # None: the default corpus
    index: str | None = setting(None, "index root holding bm25/ and dense/ (default: the default corpus, built on "
                                      "first use)")
    # thresholds calibrated for the model unless asked otherwise
    paper_defaults: bool = setting(False, "use the papers' thresholds instead of the values calibrated for the model")


class Runtime:
    """A loaded model with its engine, plus retrievers opened on first use.

    Args:
        model: embedded model name or a local HF directory.
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda``.
        index: index root holding ``bm25/`` and ``dense/`` (default: the default corpus, built on first use).
        paper_defaults: use the papers' thresholds instead of the values calibrated for the model.
        engine: an already built :class:`~fastgate.engine.local.Engine` to use instead of loading ``model``.
        dtype: the weights' dtype, ``auto`` (bf16 on CUDA and on a CPU that multiplies bf16 natively, float32
            elsewhere; see :mod:`fastgate.assets.precision`), ``float32`` or ``bfloat16``; chosen once, when the model
            loads.
        step: how the decode loops run their decode-only steps: ``auto`` (compiled on CUDA, eager on CPU),
            ``eager`` or ``compiled`` (one static step per batch bucket, :mod:`fastgate.engine.static_step`).
        remote: generate on an OpenAI-compatible server instead (:class:`~fastgate.engine.remote.RemoteConfig`): no
        model
            loads here, ``model`` becomes the server's model name, and only the methods that read nothing but text
            and token log-probabilities can be built (never, always, flare, scaar, dtr).
    """

    def __init__(self, model: str = RuntimeConfig.model, device: str = RuntimeConfig.device,
                 index: str | None = RuntimeConfig.index, paper_defaults: bool = RuntimeConfig.paper_defaults,
                 engine=None, dtype: str = RuntimeConfig.dtype, step: str = RuntimeConfig.step, remote=None,
                 weights: str = RuntimeConfig.weights) -> None:
        from fastgate.assets.precision import canonical_dtype
        from fastgate.assets.quant import canonical_weights
        from fastgate.engine.static_step import StepConfig

        self.remote = remote
        if remote is not None:
            model = remote.model
        self.model = model
        self.device = device
        if remote is None and engine is None:
            from fastgate.assets.models import resolve_device

            resolve_device(device)  # an unknown device, or CUDA where there is none, fails now, before a download
        self.dtype = canonical_dtype(dtype)  # an unknown name fails now, before anything loads
        self.step = StepConfig(mode=step).mode  # and so does an unknown step
        self.weights = canonical_weights(weights)  # and an unknown weight format
        self.index = index
        self.paper_defaults = paper_defaults
        self._engine = engine
        self._retrievers: dict[str, Any] = {}
        self.setup_s = 0.0  # seconds spent loading the model and opening retrievers

    @property
    def engine(self):
        """The :class:`~fastgate.engine.local.Engine`; the model is loaded on first access."""
        if self._engine is None:
            t0 = time.perf_counter()
            if self.remote is not None:
                from fastgate.engine.remote import RemoteEngine

                self._engine = RemoteEngine(self.remote).connect()  # a server without logprobs is refused here
            else:
                from fastgate.assets.models import load
                from fastgate.engine.local import Engine

                self._engine = Engine(load(self.model, device=self.device, dtype=self.dtype, weights=self.weights),
                                      step=self.step)
            self.setup_s += time.perf_counter() - t0
        return self._engine

    @property
    def engine_name(self) -> str:
        """What records name as the engine: ``local``, or ``openai:<base-url>:<model>`` for a remote one."""
        if self.remote is not None:
            return self.remote.name
        if self._engine is not None and self._engine.remote:  # a RemoteEngine passed in as ``engine``
            return self._engine.name
        return "local"

    @property
    def loaded(self) -> bool:
        """Whether the model has been loaded (a resumed evaluation with nothing left to answer never loads it)."""
        return self._engine is not None

    @property
    def dtype_name(self) -> str | None:
        """The weights' dtype (``float32``, ``bfloat16``; None on a remote engine), known without loading the model
        unless only the probe at load can tell (``auto`` on a CPU with native bf16 flags): a resumed evaluation
        checks its records with it."""
        if self.remote is not None or (self._engine is not None and self._engine.remote):
            return None  # a server's weights: not known here
        if self._engine is None:
            from fastgate.assets.models import resolve_device
            from fastgate.assets.precision import expected_dtype

            name = expected_dtype(self.dtype, resolve_device(self.device))
            if name is not None:
                return name
        return self.engine.dtype_name

    @property
    def weights_name(self) -> str | None:
        """How the linear weights are held (``float``, ``int8``, ``int4``, ``int4-dense``; None on a remote engine),
        known without loading unless ``auto`` depends on a dtype only the probe at load can tell: the engine passed
        in says its own (its model's ``weights``)."""
        if self.remote is not None or (self._engine is not None and self._engine.remote):
            return None
        if self._engine is None and self.weights == "auto":
            import torch

            from fastgate.assets.models import MODELS, resolve_device
            from fastgate.assets.precision import DTYPES, canonical_dtype, expected_dtype
            from fastgate.assets.quant import choose_weights

            device = resolve_device(self.device)
            dtype = expected_dtype(self.dtype, device)
            if dtype is not None:
                return choose_weights("auto", device, DTYPES.get(dtype, torch.float16),
                                      gguf_blocks=self.model in MODELS,
                                      dtype_auto=canonical_dtype(self.dtype) == "auto").weights
        if self._engine is not None or self.weights == "auto":
            return getattr(self.engine.lm, "weights", "float")
        return self.weights

    @property
    def lm(self):
        return self.engine.lm

    @property
    def model_name(self) -> str:
        return self.lm.name

    def retriever(self, kind: str):
        """The retriever of ``kind`` over this runtime's index (opened once)."""
        from fastgate.retrieval import open_retriever

        if kind not in self._retrievers:
            t0 = time.perf_counter()
            opened = open_retriever(kind, self.index)
            self._check_one_corpus(kind)  # before it is kept: a second call would return it unchecked
            self._retrievers[kind] = opened
            self.setup_s += time.perf_counter() - t0
        return self._retrievers[kind]

    def _check_one_corpus(self, kind: str) -> None:
        """The index of ``kind`` and those this runtime opened were built from one corpus: a build interrupted between
        its two kinds, or a re-index of one kind with another corpus, left BM25 and dense indexes of different
        passages side by side, which the read gate and DTR combine (its passage ids then name other passages).

        Raises:
            IndexError_: the opened indexes name different corpora."""
        from fastgate.errors import IndexError_
        from fastgate.retrieval import corpus_fingerprint_of

        prints = {k: corpus_fingerprint_of(self.index, k) for k in (*self._retrievers, kind)}
        known = {p for p in prints.values() if p}
        if len(known) > 1:
            raise IndexError_(f"the indexes under {self.index or 'the default index root'} were built from different "
                              f"corpora ({', '.join(f'{k}: {v}' for k, v in sorted(prints.items()))}); rebuild them "
                              "together with `fastgate index --corpus FILE --retriever all --force`")

    def calibrated(self, method: str, params: dict[str, Any], warn: bool = True) -> dict[str, Any]:
        """``params`` on top of the model's calibrated thresholds for ``method`` (unless ``paper_defaults`` and the
        paper gives one); loads the model (its name picks the calibration). ``warn``: say once when no calibration
        applies."""
        from fastgate.methods import METHODS
        from fastgate.methods.calibration import calibrated_params

        if self.paper_defaults and METHODS[method].paper_threshold:  # the read gate has no paper value: its price
            return params
        return calibrated_params(self.lm.name, method, params, warn=warn)

    def effective_params(self, request: AnswerRequest, warn: bool = True) -> dict[str, Any]:
        """The user's parameters on top of the model's calibrated thresholds (unless ``paper_defaults``)."""
        return self.calibrated(request.method, request.param_dict, warn)

    def method_config(self, request: AnswerRequest, warn: bool = True):
        """The typed config the method of ``request`` is built with: the one it carries, else built now from
        :meth:`effective_params`."""
        if request.config is not None:
            return request.config
        from fastgate.methods import make_config

        return make_config(request.method, self.effective_params(request, warn))

    def build(self, request: AnswerRequest):
        """Construct the method of ``request`` on this runtime's engine."""
        from fastgate.methods import METHODS, build_method

        retriever = self.retriever(request.retriever) if request.retriever is not None else None
        others = {kind: self.retriever(kind) for kind in METHODS[request.method].uses_retrievers}
        method = build_method(request.method, self.engine, retriever, retrievers=others or None,
                              config=self.method_config(request, warn=False))
        # a missing calibration is said once the method is built: a checkpoint for another model is refused by the
        # build, without a warning about its calibration first
        self.effective_params(request)
        return method


def result_record(result, model: str, retriever: str | None, setup_s: float = 0.0,
                  dtype: str | None = None, engine: str | None = None, weights: str | None = None) -> dict[str, Any]:
    """The JSON object ``fastgate ask --json`` prints for one :class:`~fastgate.methods.MethodResult` (with the
    weights' ``dtype`` and format (``weights``: ``float``, ``int8``, ``int4``, ``int4-dense``) and the ``engine``,
    ``local`` or
    ``openai:<base-url>:<model>``, when given)."""
    record = result.to_dict()
    record.update({"model": model, "retriever": retriever})
    if dtype is not None:
        record["dtype"] = dtype
    if weights is not None:
        record["weights"] = weights
    if engine is not None:
        record["engine"] = engine
    record["timings"] = {**record["timings"], "setup_s": setup_s}
    return record


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (an eigenscore with no valid sample is +inf) as None: JSON has no
    infinity."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
