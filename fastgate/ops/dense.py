"""A layer's dense product of bf16 rows on a CPU with its weight in oneDNN's own layout, made once (op
``dense_linear``, docs/ARCHITECTURE.md).

Why: torch's ``F.linear`` of bf16 rows on a CPU is a oneDNN product that first reorders the plain ``[N, K]`` weight
into the blocked layout its kernel reads, on every call: the weight is read, written and read again. A fused pass's
prompt chunks and larger batches multiply the kept de-quantized copies of ``int4-dense`` (or a bf16 model's own
weights) this way, 120 products a pass for SmolLM2. ``torch.ops.mkldnn._reorder_linear_weight`` makes that layout
once and ``torch.ops.mkldnn._linear_pointwise`` multiplies it (what inductor's CPU lowering of a frozen linear does):
the same kernel, so the same bits. Measured on a 2-core Zen 4 EPYC (AVX512-BF16), SmolLM2's 120 products of 30
layers with distinct weights (as a pass reads them), ms, plain against reordered: 16 rows 25.4 / 13.9, 82 rows
66.0 / 50.5, 512 rows 287 / 259.

oneDNN runs on torch's own threads. In a chunk pass these products alternate with the extension's pooled calls (the
norm, the rotary embedding, the attention), whose idle workers spin ~200 us for the next call before they sleep: on
the core a product's second thread needs. Where the extension is built the registry passes its ``pool_rest``
(``rest``), called before each product to send those workers to sleep at once. A 497-row norm then a 576 -> 3,072
product: 4,625 -> 4,477 us; a norm then torch's SwiGLU of [497, 1,536]: 763 -> 517 us (2-core Zen 4 EPYC).

The reordered weight is made at a bound product's first call (a process that only decodes never makes it). A bf16
model's own weight stays beside it (the model's parameter, its modules' path). A quantized layer's kept copy
(int4-dense) is handed to it instead (:meth:`OnednnDense.adopt`, when a fused pass binds the layer): the plain copy is
dropped and the layer's own ``forward`` (HF's module path) multiplies the reordered weight; a join's parts (q/k/v,
gate/up) take their columns of the join's product (:class:`SharedColumns`), so each weight is held once (a later
binding by any op, the reference's too, then multiplies the reordered weight: the same bits). Where the
CPU has no bf16 oneDNN product, under the ``torch`` backend, for float32 rows and for any input the reordered weight
does not take (another dtype or device, not 2-D), the product is ``F.linear`` of the plain weight (made again from
the codes where it was handed over). The registry binds the reordered product only where a probe finds it
``F.linear``'s bits (:func:`onednn_agrees`), and each weight shape is probed again for each class of row counts at its
first product of that many rows (:class:`ReorderedLinear`): the classes of few rows at a decode step, those up to a
prompt chunk's at a prefill. Probing every class at once cost qwen2.5-0.5b's LM head (151,936 x 896) 2.4 s of its
first answer, mostly for the 515-row class, which a head meets only with prompt log-probs.
"""

from __future__ import annotations

import bisect
import functools
import math
import threading
import weakref
from collections.abc import Callable
from typing import TypeAlias

import torch
import torch.nn.functional as F

__all__ = ["OnednnDense", "ReorderedLinear", "SharedColumns", "columns_agree", "onednn_agrees", "onednn_dense_linear",
           "probe_pending", "resting_dense_linear", "torch_dense_linear"]

# rows a probe multiplies: one, a few, past a 32-row block, a prime, a prompt chunk's; each stands for the class of
# row counts above the one before it (the last for every count above it too)
_PROBE_ROWS = (1, 3, 33, 97, 515)

Product: TypeAlias = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> [M, N]

# (N, K, bias) -> how many row classes (of _PROBE_ROWS, in order) the reordered product gave F.linear's bits for;
# -1: one did not (the shape keeps F.linear)
_probed: dict[tuple[int, int, bool], int] = {}
_pending: weakref.WeakSet = weakref.WeakSet()  # ReorderedLinear products with row classes not yet probed
_columns_agree: dict[tuple, bool] = {}  # (N, K, dtype, edges) -> row blocks' products are the whole one's columns
_adopting = threading.Lock()  # OnednnDense.adopt
_probing = threading.Lock()  # one thread at a time probes a row class (ReorderedLinear._probe)


def torch_dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Product:
    """The reference: ``x [M, K] -> F.linear(x, weight [N, K], bias [N]) [M, N]``."""
    if bias is None:
        return lambda x: F.linear(x, weight)
    return lambda x: F.linear(x, weight, bias)


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)  # [N, K] in oneDNN's blocked layout (an opaque tensor)


def _product(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")  # [M, N]


def _agrees(weight: torch.Tensor, bias: torch.Tensor | None, reordered: torch.Tensor,
            rows_probed: tuple[int, ...] = _PROBE_ROWS) -> bool:
    """Whether the reordered product of ``weight`` gives ``F.linear``'s bits on random rows of each count of
    ``rows_probed`` (and on rows with a stride), with ``bias`` where given. Each count's rows are seeded by the count:
    a class probed alone sees the rows it would see among the others."""
    k = weight.shape[1]
    try:
        for m in rows_probed:
            gen = torch.Generator().manual_seed(m)
            x = torch.randn((m, k + 3), generator=gen).to(weight.dtype)  # [M, K + 3]
            for rows in (x[:, :k].contiguous(), x[:, 3:]):  # contiguous, and rows with a stride
                if not torch.equal(_product(rows, reordered, bias), F.linear(rows, weight, bias)):
                    return False
    except RuntimeError:
        return False
    return True


def probe_pending() -> int:
    """Probe every row class of every reordered product made so far that a larger product would still probe (each
    shape once), and make their reordered weights: the one-time work a warm-up takes on before serving or a timed
    run, so that no later pass pays it. Returns how many of them take every row count through their reordered
    weights (the others keep ``F.linear``: a class did not agree)."""
    done = 0
    for product in list(_pending):
        done += product._reordered_for(_PROBE_ROWS[-1] + 1) is not None
        _pending.discard(product)
    return done


def _row_classes(m: int) -> int:
    """How many classes of :data:`_PROBE_ROWS` a product of ``m`` rows needs probed: those up to the first count of
    at least ``m`` (every class past the last count)."""
    return min(bisect.bisect_left(_PROBE_ROWS, m), len(_PROBE_ROWS) - 1) + 1


def _rows_covered(classes: int) -> float:
    """The most rows ``classes`` probed classes stand for (every count once all are)."""
    return math.inf if classes >= len(_PROBE_ROWS) else _PROBE_ROWS[classes - 1] if classes > 0 else 0


class ReorderedLinear:
    """``x [M, K] -> F.linear(x, weight, bias) [M, N]`` bit for bit, bf16 CPU rows multiplied by the weight
    reordered once (module docstring), made at the first such call; a class of row counts goes through it once the
    weight's shape was probed for that class (at the first product of that many rows), every other input by
    ``F.linear`` of the plain weight. A class that does not agree sends the shape's every count to ``F.linear`` from
    then on (the counts of the classes that agreed gave its bits before: the same bits either way)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 rest: Callable[[], None] | None = None) -> None:
        if weight.dim() != 2 or (bias is not None and bias.shape != weight.shape[:1]):
            raise ValueError(f"dense_linear needs a weight [N, K] and a bias [N], got {tuple(weight.shape)} and "
                             f"{None if bias is None else tuple(bias.shape)}")
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self._plain: Callable[[], torch.Tensor] | None = None  # makes the plain weight again once it is released
        self.rest = rest  # called before each product: the extension's spinning workers sleep (module docstring)
        self.reordered: torch.Tensor | None = None  # made at the first bf16 product
        self._rows_ok: float = 0  # products of up to this many rows take the reordered weight (their classes probed)
        self._ok = (weight.dtype is torch.bfloat16 and weight.device.type == "cpu"
                    and (bias is None or (bias.dtype is torch.bfloat16 and bias.device.type == "cpu")))
        if self._ok:
            _pending.add(self)

    def _reordered_for(self, m: int) -> torch.Tensor | None:
        """The reordered weight a product of ``m`` rows multiplies, or None for ``F.linear`` (:meth:`_probe`). The
        caller multiplies the tensor returned: another thread may drop ``self.reordered`` meanwhile."""
        reordered = self.reordered
        if reordered is not None and m <= self._rows_ok:
            return reordered
        with _probing:
            return self._probe(m)

    def _probe(self, m: int) -> torch.Tensor | None:
        """Under ``_probing``: the reordered weight (made now if not yet) where this shape's row classes up to ``m``'s
        were probed (once a shape, class and process) and every one gave ``F.linear``'s bits; else None, and the shape
        keeps ``F.linear`` for every count (the plain weight made again and kept where it was released); so does a
        CPU where oneDNN cannot reorder a bf16 weight."""
        if not self._ok:
            return None
        key = (self.out_features, self.in_features, self.bias is not None)
        need, done = _row_classes(m), _probed.get(key, 0)
        weight = None
        if done >= 0:
            if done < need or self.reordered is None:
                weight = self._plain_weight().detach().contiguous()  # [N, K]
            if self.reordered is None:
                try:
                    self.reordered = _reorder(weight)
                except RuntimeError:  # oneDNN has no bf16 product on this CPU (no AVX512-BW or AVX-NE-CONVERT)
                    self.reordered = None
            if self.reordered is not None and (
                    done >= need or _agrees(weight, self.bias, self.reordered, _PROBE_ROWS[done:need])):
                _probed[key] = max(need, done)
                self._rows_ok = _rows_covered(_probed[key])
                return self.reordered
            _probed[key] = -1
        self._ok, self.reordered, self._rows_ok = False, None, 0
        if self.weight is None:  # released: held plain again, for F.linear of every count
            self.weight = weight if weight is not None else self._plain()
        return None

    def _plain_weight(self) -> torch.Tensor:
        """The plain weight ``[N, K]``: held, or made again where it was released (read once: another thread may
        hold it again meanwhile)."""
        weight = self.weight
        return weight if weight is not None else self._plain()

    def release(self, plain: Callable[[], torch.Tensor]) -> None:
        """Drop the plain weight (its owner drops its own reference: the weight is then held once, reordered);
        ``plain()`` makes it again, equal, to probe a row class not yet probed and for an input the reordered product
        does not take. Made first if not yet; raises where this shape's reordered product of one row does not agree
        (the plain weight is then the only one)."""
        if self._reordered_for(1) is None:
            raise ValueError("release: no reordered weight agrees for this shape")
        self.weight, self._plain = None, plain

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rest is not None:
            self.rest()
        if (self._ok and x.dtype is torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu"
                and x.shape[0] > 0 and x.shape[1] == self.in_features):
            reordered = self._reordered_for(x.shape[0])
            if reordered is not None:
                return _product(x, reordered, self.bias)  # [M, N]
        return F.linear(x, self._plain_weight(), self.bias)


def onednn_dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                        rest: Callable[[], None] | None = None) -> Product:
    """The op where oneDNN multiplies bf16 here (the registry asks :func:`onednn_agrees`): a
    :class:`ReorderedLinear` for a bf16 CPU weight, the reference for any other; ``rest`` called before each CPU
    product."""
    if weight.dtype is torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2:
        return ReorderedLinear(weight, bias, rest)
    return resting_dense_linear(weight, bias, rest)


class SharedColumns:
    """The product of a joined weight (q, k and v side by side; gate and up) whose parts' layers each take their
    columns, ``x [M, K] -> [M, N_i]``, computed once for the parts called on the same rows.

    Why: a fused pass multiplies the joined weight, HF's modules (a prompt's states, a shared prefix) the parts, one
    after the other on the same rows. Where the joined weight is kept once, reordered, the parts have no weight of
    their own; computing the joined product for each part would triple q/k/v's work. The product is kept until every
    part took its columns (then dropped), or until other rows come: the rows are recognized by their storage, shape,
    strides and version counter (they are held meanwhile, so their storage cannot be reused; an inference-mode tensor
    has no version counter, and HF's modules change no rows between the parts' calls). Each part's columns are
    ``F.linear`` of its own rows of the weight bit for bit where :func:`columns_agree` says so (the caller checks)."""

    def __init__(self, product: Product, edges: list[tuple[int, int]]) -> None:
        self.product, self.edges = product, edges
        self._lock = threading.Lock()  # two threads' HF forwards on one model: neither takes the other's product
        self._rows: torch.Tensor | None = None
        self._key: tuple | None = None
        self._y: torch.Tensor | None = None
        self._taken: set[int] = set()
        self._waiting = set(range(len(edges)))  # the parts that take columns (a part given its own copy leaves)

    def part(self, i: int) -> _Part:
        """The product of part ``i`` (``edges[i]`` of the joined columns)."""
        return _Part(self, i)

    def _leave(self, i: int) -> None:
        with self._lock:
            self._waiting.discard(i)
            self._rows = self._key = self._y = None

    def _columns(self, i: int, x: torch.Tensor) -> torch.Tensor:
        key = (x.data_ptr(), x.dtype, x.device, tuple(x.shape), x.stride(), None if x.is_inference() else x._version)
        with self._lock:
            if self._rows is None or key != self._key or i in self._taken:
                self._rows, self._key, self._y, self._taken = x, key, self.product(x), set()  # [M, N]
            y = self._y
            self._taken.add(i)
            if self._taken >= self._waiting:  # every part has its columns: nothing kept between passes
                self._rows = self._key = self._y = None
        start, end = self.edges[i]
        return y[:, start:end].contiguous()  # [M, N_i]


class _Part:
    """Part ``i``'s product of a :class:`SharedColumns`; ``detach()`` when the part holds its own copy again."""

    def __init__(self, shared: SharedColumns, i: int) -> None:
        self.shared, self.i = shared, i

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared._columns(self.i, x)  # [M, N_i]

    def detach(self) -> None:
        self.shared._leave(self.i)


def columns_agree(weight: torch.Tensor, edges: list[tuple[int, int]]) -> bool:
    """Whether ``F.linear`` of each row block ``weight[start:end]`` gives the columns ``start:end`` of
    ``F.linear(x, weight)`` bit for bit, on random rows of :data:`_PROBE_ROWS` (probed once a shape and process)."""
    key = (*weight.shape, weight.dtype, tuple(edges))
    if key not in _columns_agree:
        gen = torch.Generator().manual_seed(1)
        ok = True
        for m in _PROBE_ROWS:
            x = torch.randn((m, weight.shape[1]), generator=gen).to(weight.dtype)  # [M, K]
            y = F.linear(x, weight)  # [M, N]
            ok = ok and all(torch.equal(F.linear(x, weight[s:e]), y[:, s:e]) for s, e in edges)
        _columns_agree[key] = ok
    return _columns_agree[key]


class OnednnDense:
    """The op ``dense_linear`` where oneDNN multiplies bf16 here (the registry asks :func:`onednn_agrees`):
    ``op(weight, bias)`` is :func:`onednn_dense_linear`'s product, ``rest`` called before each CPU product, and
    :meth:`adopt` hands a quantized layer's kept copy to the reordered weight so the layer holds it once."""

    def __init__(self, rest: Callable[[], None] | None = None, adopts: bool = True) -> None:
        self.rest = rest
        self.adopts = adopts  # False: the layers' copies stay plain (a compiled step traces HF's modules)

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Product:
        return onednn_dense_linear(weight, bias, self.rest)

    def keeping_copies(self) -> OnednnDense:
        """This op, adopting nothing."""
        return OnednnDense(self.rest, adopts=False)

    def adopt(self, layer) -> Product | None:
        """The product of ``layer``'s kept bf16 copy (``layer.dense [N, K]``, :class:`fastgate.assets.quant.Int8Linear`
        or ``Int4Linear``) with the plain copy dropped: the layer, and the layers whose copies are row blocks of it
        (``layer.kept_parts``: ``(part, start, end)``, a fused pass's join), compute with the reordered weight from
        now on (:meth:`ReorderedLinear.release`, :class:`SharedColumns`), the same bits. None where the copy stays
        plain (not a bf16 CPU copy, this shape's reordered product or its columns do not agree): bind the op itself.

        Why: the plain copy stayed the layer's beside the reordered one, made at the first product of many rows:
        qwen2.5-0.5b in ``auto`` held 942 MB of bf16 weights twice."""
        if not self.adopts:
            return None
        with _adopting:  # two first binds at once: one adopts, the other finds the copy gone and takes its product
            if layer._kept(torch.bfloat16) is None and layer.has_kept(torch.bfloat16):
                return layer._kept_product
            return self._adopt(layer)

    def _adopt(self, layer) -> Product | None:
        dense = layer._kept(torch.bfloat16)
        if dense is None or dense.device.type != "cpu" or dense.dim() != 2 or not dense.is_contiguous():
            return None
        parts = list(getattr(layer, "kept_parts", ()))
        if parts:
            edges = [(start, end) for _, start, end in parts]
            views = [p._kept(torch.bfloat16) for p, _, _ in parts]
            if (any(v is None or v.data_ptr() != dense[s:e].data_ptr() or v.shape != dense[s:e].shape
                    for v, (s, e) in zip(views, edges)) or not columns_agree(dense, edges)):
                return None
        product = ReorderedLinear(dense, None, self.rest)
        try:
            product.release(functools.partial(layer._weight_in, torch.bfloat16))
        except ValueError:
            return None
        if parts:
            shared = SharedColumns(product, edges)
            for i, (part, _, _) in enumerate(parts):
                part.release_dense(shared.part(i))
        layer.release_dense(product)
        return product


def resting_dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                         rest: Callable[[], None] | None = None) -> Product:
    """The reference's ``F.linear`` with ``rest`` called before each product of a CPU weight (the extension's pool
    sleeps while torch's threads multiply: module docstring); the reference itself without ``rest``. The op where the
    extension is built and oneDNN's bf16 product is not bound (float32 products alternate with the C++ float32 norm
    and rotary embedding there too)."""
    product = torch_dense_linear(weight, bias)
    if rest is None or weight.device.type != "cpu":
        return product

    def rested(x: torch.Tensor) -> torch.Tensor:
        rest()
        return product(x)  # [M, N]

    return rested


@functools.cache
def onednn_agrees() -> bool:
    """Whether torch here has oneDNN's bf16 product and its reordered weight gives ``F.linear``'s bits (a probe of
    one SmolLM2-like shape, with and without a bias; ~9 ms, made once a process: the registry asks at every build)."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        gen = torch.Generator().manual_seed(1)
        weight = (torch.randn((96, 576), generator=gen) * 0.05).to(torch.bfloat16)  # [N, K]
        bias = torch.randn((96,), generator=gen).to(torch.bfloat16)  # [N]
        reordered = _reorder(weight)
        return _agrees(weight, None, reordered) and _agrees(weight, bias, reordered)
    except (RuntimeError, AttributeError):
        return False
