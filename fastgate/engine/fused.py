"""The packed pass without HF's module tree: the same arithmetic in a few host operations a layer.

A batch-1 decode step of SmolLM2-135M through HF's modules dispatched ~8,200 torch operations (30 layers, each a
dozen modules calling ~270 operations, views included) around 211 matrix products: at one thread on a Zen 4 EPYC the
host's share was ~9 ms of a 20.6 ms step with int8 weights. :class:`FusedForward` runs the packed pass of
:mod:`fastgate.engine.packed` (decode rows and prompt chunks alike) over the model's own weights with:

* one product for ``q``, ``k``, ``v`` and one for ``gate``, ``up`` (the weights concatenated once, the projections'
  own weights becoming views of them: no second copy), with biases where the model has them (Qwen2);
* RoPE from a table of ``cos`` / ``sin`` per position computed once by the model's own rotary module (rows gathered
  by position: HF recomputes them every pass), applied to ``q`` and ``k`` in one go;
* the norm and the rotary embedding as the runner's ops ``rms_norm`` and ``rope`` (:mod:`fastgate.ops.layer`: one
  C++ call each for bf16 rows on a CPU where the extension is built, and float32 rows where it has AVX2 and FMA,
  bitwise; the torch references otherwise);
* the packed attention function itself (:func:`fastgate.engine.packed._packed_attention`), so the slot store, the
  prefill buffers and the float32 attention of bf16 caches are the very same; a pass of decode rows only on a CPU
  (bf16, or float32 with quantized weights) writes the store and attends in one C++ call a layer instead
  (:meth:`FusedForward._decode_layers`, op ``decode_attention_step``), the norms inside the products' calls; with
  float32 rows of int4 weights, all its layers between two taps in one call (op ``decode_layers``,
  :mod:`fastgate.ops.decoder`: bitwise the same);
* the taps written directly (no forward hooks): layer 0 the embeddings, layer ``i`` decoder layer ``i - 1``'s output,
  layer ``n`` the final norm's, as :class:`fastgate.engine.model_runner.Taps` keeps them.

The arithmetic is HF's, operation for operation: the RMS norm as ``LlamaRMSNorm`` computes it (float32 statistics, the
product in the model's dtype), the residual sums in the same order, ``act(gate) * up``, the rotary formula
``x * cos + rotate_half(x) * sin``; a concatenated product equals its parts bitwise on the EPYCs' BLAS (each output
column is its own dot product; checked in tests), so float32 tokens equal the module tree's there
(``tests/test_fused.py``; the golden answers). A 16-thread Xeon's MKL (a lent GPU machine's host) joins them within
float32 rounding only, at some row counts: the same tokens, log-probs that differ in the last bits. Models it does not
cover (another layer structure, a rotary type whose frequencies change with the length) keep HF's forward:
:func:`fusable` says which.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgate.assets.models import return_freed_memory
from fastgate.assets.quant import Int4Linear, Int8Linear, packed_rows_split
from fastgate.errors import UnknownNameError
from fastgate.ops import reference
from fastgate.ops.decoder import DecoderLayerWeights, is_silu
from fastgate.ops.dense import torch_dense_linear
from fastgate.ops.quant import torch_int4_matmul, torch_int8_matmul
from fastgate.ops.threads import serial_torch

__all__ = ["FORWARDS", "FusedForward", "canonical_forward", "fusable", "fused_forward"]

FORWARDS = ("auto", "hf", "fused")  # how the packed pass runs the model: auto is fused wherever fusable
_STATIC_ROPE = frozenset({"default", "linear", "llama3", None})  # rotary types whose table never changes
_ATTR = "_fastgate_fused"  # where a model keeps its FusedForward (built once, shared by every runner on it)


def canonical_forward(name: str) -> str:
    """``name`` checked against :data:`FORWARDS`."""
    if name not in FORWARDS:  # a bare ValueError before; step= gave the project's error
        raise UnknownNameError("forward", name, list(FORWARDS))
    return name


def _rope_type(config) -> str | None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"


def fusable(model) -> bool:
    """Whether :class:`FusedForward` covers ``model``: a Llama / Qwen2 / Mistral decoder (norm, attention with
    q/k/v/o projections, gated MLP) whose linear layers are ``nn.Linear``, :class:`Int8Linear` or :class:`Int4Linear`
    (q/k/v of one kind, gate/up of one kind: each is joined into one product) and whose rotary frequencies are
    fixed."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(model.config, "model_type", "") not in ("llama", "qwen2", "mistral"):
        return False
    if _rope_type(model.config) not in _STATIC_ROPE or not hasattr(inner, "rotary_emb"):
        return False
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(p) not in (nn.Linear, Int8Linear, Int4Linear) for p in projections):
            return False
        if len({type(p) for p in projections[:3]}) != 1 or len({type(p) for p in projections[4:6]}) != 1:
            return False
    return True


def fused_forward(model) -> FusedForward:
    """``model``'s :class:`FusedForward`, built on first use and kept on the model (its weights are shared)."""
    fused = getattr(model, _ATTR, None)
    if fused is None:
        fused = FusedForward(model)
        object.__setattr__(model, _ATTR, fused)  # not a submodule: the model's state dict stays HF's
    return fused


def _fuse(parts: list[nn.Module]) -> nn.Module:
    """One linear layer computing ``parts`` side by side; each part's weight (and bias, scales) becomes a view of the
    fused one, so the model holds each weight once and HF's modules still compute with the same values. Int4 parts
    join their plain codes, then the join is packed for the kernel once; the parts keep views of that packed weight
    where the layout splits at their row boundaries (multiples of 64 rows, :func:`packed_rows_split`), else pack their
    own. A kept de-quantized copy (``int4-dense``) is made once for the join, the parts holding views of it."""
    if type(parts[0]) in (Int4Linear, Int8Linear):
        dense = parts[0].dense
        for p in parts:
            p.keep_dense(None)  # so the parts' refresh in the join does not make it again
        fused = _join_int4(parts) if type(parts[0]) is Int4Linear else _join_int8(parts)
        if dense is not None:
            fused.keep_dense(dense.dtype)
            start, kept_parts = 0, []
            for p in parts:
                p.keep_dense(dense.dtype, fused.dense[start:start + p.out_features])
                kept_parts.append((p, start, start + p.out_features))
                start += p.out_features
            fused.kept_parts = kept_parts  # the op dense_linear may hold the join's copy for them too (adopt)
        return fused
    weight = torch.cat([p.weight.detach() for p in parts])  # [sum N, K]
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for p in parts:
        n = p.out_features
        p.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return fused


def _join_int4(parts: list[Int4Linear]) -> Int4Linear:
    """The Int4Linear of ``parts``' codes side by side, the parts' codes and packed weights views of it
    (:func:`_fuse`)."""
    q = torch.cat([p.q for p in parts])  # [sum N, K / 2] uint8
    scale, zero = torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts])  # [sum N, K / 32]
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    fused = Int4Linear(q, scale, zero, bias, parts[0].kernel_rows, parts[0].source)
    fused.bf16_products = parts[0].bf16_products
    views = packed_rows_split() and all(p.out_features % 64 == 0 for p in parts) and q.device.type == "cpu"
    start = 0
    for p in parts:
        n = p.out_features
        p.q, p.scale, p.zero = q[start:start + n], scale[start:start + n], zero[start:start + n]
        p.refresh((fused.packed[start:start + n], fused.scale_zeros[:, start:start + n].contiguous())
                  if views else None)
        if bias is not None:
            p.bias = nn.Parameter(fused.bias.detach()[start:start + n], requires_grad=False)
        start += n
    return fused


def _join_int8(parts: list[Int8Linear]) -> Int8Linear:
    """The Int8Linear of ``parts``' weights side by side, the parts' weights and scales views of it (:func:`_fuse`)."""
    q = torch.cat([p.q for p in parts])  # [sum N, K] int8
    scale = torch.cat([p.scale for p in parts])  # [sum N]
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    fused = Int8Linear(q, scale, bias, parts[0].kernel_rows)
    fused.bf16_products = parts[0].bf16_products
    start = 0
    for p in parts:
        n = p.out_features
        p.q, p.scale = fused.q[start:start + n], fused.scale[start:start + n]
        p.refresh()
        if bias is not None:
            p.bias = nn.Parameter(fused.bias.detach()[start:start + n], requires_grad=False)
        start += n
    return fused


class _Layer:
    """One decoder layer's pieces for the fused pass."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn  # the packed attention function reads its layer_idx and num_key_value_groups
        self.ln1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = attn.o_proj
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        self.act = mlp.act_fn
        self.silu = is_silu(self.act)  # its activation may run as the op swiglu (silu(gate) * up)
        self.scaling = attn.scaling
        self.index = attn.layer_idx  # its key / value store layer
        self.linears = (self.qkv, self.o, self.gate_up, self.down)
        # the four products as bare calls for the rows of a bf16 decode step on a CPU, each (small, rows, large):
        # up to rows, and beyond (None: none); products None where one has no bare call. Bound here to torch's
        # quantized products; FusedForward binds them to the runner's ops (the same rows)
        self.product_rows = _bare_rows([_row_products(m) for m in self.linears])
        self.quantized = any(type(m) in (Int4Linear, Int8Linear) for m in self.linears)

    def activation(self, gu: torch.Tensor, swiglu=reference.swiglu) -> torch.Tensor:
        """The MLP's activation of ``gu [T, 2 I]`` (the gate and up products side by side): the op ``swiglu`` for a
        SiLU layer, else the layer's own activation of the gate times up. ``[T, I]``."""
        if self.silu:
            return swiglu(gu)  # [T, I]
        inter = gu.shape[-1] // 2
        return self.act(gu[:, :inter]) * gu[:, inter:]  # [T, I]


def _kernel_rows(products: list[tuple]) -> int:
    """Rows every product of ``products`` takes through its kernel (its ``small`` call; 0: some has none)."""
    return 0 if any(p is None for p, _, _ in products) else min(r for _, r, _ in products)


def _bare_rows(products: list[tuple]) -> int:
    """Rows every product of ``products`` (:func:`_row_products`' triples) takes as a bare call: any where each has
    its many-rows call, else its kernels' least (0: some product has no bare call)."""
    if any(p is None for p, _, _ in products):
        return 0
    return 1 << 30 if all(large is not None for _, _, large in products) else min(r for _, r, _ in products)


def _op_takes(op, dtype: torch.dtype) -> bool:
    """Whether the quantized product ``op`` has a kernel for CPU rows of ``dtype``: bf16 rows always (torch's or the
    extension's), float32 rows where the op says so (``op.float32``: the registry's C++ op on an AVX2 CPU; torch's
    kernels run a scalar loop on float32 rows)."""
    return dtype is torch.bfloat16 or (dtype is torch.float32 and getattr(op, "float32", False))


def _op_rows(layer: Int4Linear | Int8Linear, op, dtype: torch.dtype) -> int:
    """The most ``dtype`` rows ``layer`` multiplies through its kernel, the op ``op``: the layer's kernel rows, and
    where it keeps a copy in the rows' dtype (int4-dense) up to the op's own ``float32_rows`` / ``bf16_rows`` (the C++
    kernels beat streaming the copy further: fastgate.ops.quant.F32_KERNEL_ROWS, F32_INT8_ROWS, BF16_KERNEL_ROWS)."""
    rows = layer.kernel_rows
    if dtype is torch.float32 and layer.has_kept(torch.float32):
        rows = max(rows, getattr(op, "float32_rows", 0))
    elif dtype is torch.bfloat16 and layer.has_kept(torch.bfloat16):
        rows = max(rows, getattr(op, "bf16_rows", 0))
    return rows


_QUANT = (Int4Linear, Int8Linear)


def _kept_product(layer: Int4Linear | Int8Linear, dtype: torch.dtype, dense_linear):
    """The product of ``layer``'s kept copy in ``dtype`` (None: it keeps none) by the op ``dense_linear``: the product
    already holding the copy (the op adopted it before), else the op's adoption of it where the op adopts (the
    plain copy then dropped: :meth:`fastgate.ops.dense.OnednnDense.adopt`), else the op's product of the plain copy."""
    if not layer.has_kept(dtype):
        return None
    dense = layer._kept(dtype)
    if dense is None:
        return layer._kept_product
    adopt = getattr(dense_linear, "adopt", None)
    adopted = adopt(layer) if adopt is not None else None
    return adopted if adopted is not None else dense_linear(dense)


def _row_products(linear: nn.Module, int4_matmul=torch_int4_matmul, int8_matmul=torch_int8_matmul,
                  dense_linear=torch_dense_linear, dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[object | None, int, object | None]:
    """``linear``'s product of ``dtype`` CPU rows as bare operator calls: ``(small, rows, large)``, ``small`` for at
    most ``rows`` rows and ``large`` beyond (None: not available). They are the calls :class:`Int4Linear` and
    :class:`Int8Linear` make for such rows (the weight-only kernel, then the kept de-quantized copy of ``int4-dense``),
    the kernel being the op ``int4_matmul`` / ``int8_matmul`` given (torch's by default: the layers' own), or
    ``F.linear`` of an ``nn.Linear`` in ``dtype``, with the bias added as the layers add it; every dense product
    (a kept copy's, an ``nn.Linear``'s) bound by the op ``dense_linear`` given (``F.linear``'s bits either way: the
    runner's may multiply a weight reordered once, :mod:`fastgate.ops.dense`). They skip
    ``nn.Module.__call__`` and the layers' checks: a decode step makes four a layer (120 for SmolLM2). float32 rows
    (``dtype`` float32) take a quantized layer's kernel only where the op has one for them (``op.float32``: the
    registry's C++ op on an AVX2 CPU); torch's kernels run a scalar loop there, so the layer's own call stays."""
    bias = None if linear.bias is None else linear.bias.detach()
    if type(linear) in (Int4Linear, Int8Linear) and bias is not None:
        bias = bias.to(dtype)  # the layers add bias.to(y.dtype), y in the rows' dtype
    if (type(linear) is Int4Linear and linear.scale_zeros.shape[1] == linear.out_features
            and _op_takes(int4_matmul, dtype)):
        if linear.packed.device.type != "cpu":
            return None, 0, None
        bind = getattr(int4_matmul, "bind", None)  # the op for this one layer, its checks made once
        product = bind(linear) if bind is not None else (lambda x: int4_matmul(x, linear))
        rows = _op_rows(linear, int4_matmul, dtype)
        if bias is None:
            small = product  # [M, N]
        else:
            small = lambda x: product(x) + bias  # noqa: E731
        dense_product = _kept_product(linear, dtype, dense_linear)
        if dense_product is None:
            large = None
        elif bias is None:
            large = dense_product  # [M, N]
        else:
            # the layer adds it after (its roundings); in place: a new [M, N] tensor a call cost page faults
            large = lambda x: dense_product(x).add_(bias)  # noqa: E731
        return small, rows, large
    if type(linear) is Int8Linear and linear._k_ok and linear.q.device.type == "cpu" and _op_takes(int8_matmul, dtype):
        scale = linear.scale if dtype is torch.float32 else linear.scale_bf16
        dense_product = _kept_product(linear, dtype, dense_linear)
        # the scale and bias in place, the bits of ``y * scale + bias``: the products' outputs are fresh tensors, and a
        # new [M, N] one per operation cost a 440-token chunk of qwen2.5-0.5b ~1 ms a layer in page faults
        if bias is None:
            small = lambda x: int8_matmul(x, linear)  # noqa: E731  [M, N]
            large = lambda x: dense_product(x).mul_(scale)  # noqa: E731
        else:
            small = lambda x: int8_matmul(x, linear).add_(bias)  # noqa: E731
            large = lambda x: dense_product(x).mul_(scale).add_(bias)  # noqa: E731
        return small, linear.kernel_rows, None if dense_product is None else large
    if type(linear) is nn.Linear and linear.weight.dtype is dtype:
        product = dense_linear(linear.weight.detach(), bias)  # [M, N]
        return product, 1 << 30, product
    return None, 0, None


class FusedForward:
    """The packed pass of one model in few host operations (module docstring). Build through
    :func:`fused_forward`; :meth:`__call__` takes what :func:`fastgate.engine.packed.packed_forward` takes."""

    def __init__(self, model) -> None:
        if not fusable(model):
            raise ValueError(f"{type(model).__name__} is not covered by the fused forward")
        self.model = model
        inner = model.model
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.n = len(inner.layers)
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.embed, self.head = inner.embed_tokens, model.lm_head
        # the final norm runs through the runner's rms_norm op (HF's arithmetic, in C++ where bound: ~8 torch
        # operations a step fewer)
        self.norm_w, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.rotary = inner.rotary_emb
        # the most rows _decode_layers takes: any where every layer has bare products for many rows, else within
        # every layer's kernels (0: some layer has no bare product)
        self._row_limit = min(layer.product_rows for layer in self.layers)
        self._kernel_limits: dict[tuple, int] = {}  # (matmuls, dtype) -> rows through every kernel (_kernel_limit)
        self._head_limits: dict[tuple, int] = {}  # (int8 op, dtype, device) -> the head's kernel rows (_head_rows)
        self._cos = self._sin = None  # [P, D] in the model's dtype, grown on demand
        # every layer's products bound to the ops (int4_matmul, int8_matmul[, dense_linear]): once (a runner's ops)
        self._bound: dict[tuple, list[list[tuple]]] = {}
        self._selections: dict[tuple, list[tuple]] = {}  # (matmuls, rows, dtype) -> each layer's calls (_selected)
        self._stacks: dict[object, object] = {}  # a decode_layers op -> its stack of these layers (None: none)

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[T, D]`` at ``positions [T]`` (rows of a table the model's rotary module computed)."""
        need = int(positions.max()) + 1
        if self._cos is None or self._cos.shape[0] < need or self._cos.dtype != like.dtype:
            size = max(need, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            pos = torch.arange(size, device=like.device)[None]  # [1, P]
            cos, sin = self.rotary(like, pos)  # [1, P, D] each, in like's dtype
            self._cos, self._sin = cos[0], sin[0]
        # index_select: the same gather as indexing by a tensor, in fewer host operations
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, plan, keep: torch.Tensor, attention,
                 tap_layers=(), rms_norm=reference.rms_norm, rope=reference.rope, attention_step=None,
                 matmuls=(torch_int4_matmul, torch_int8_matmul),
                 decode_layers=None, swiglu=reference.swiglu) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run ``ids [T]`` at ``positions [T]`` through the packed ``plan`` with the packed pass's HF attention
        function ``attention`` (``fastgate.engine.packed._packed_attention``); the float32 logits ``[len(keep), V]``
        of pack positions ``keep`` and the outputs ``[1, T, d]`` of ``tap_layers`` (as the taps' hooks keep them).
        ``rms_norm``, ``rope``, ``attention_step``: the runner's ops of those names (the references by default;
        ``attention_step`` None: every pass through ``attention``); ``matmuls``: its ops ``int4_matmul`` and
        ``int8_matmul`` (torch's kernels by default, the layers' own). A pass of decode rows only over a bf16 store
        whose attention runs in C++ (``plan.attend``), of rows few enough for the layers' kernels, goes through
        :meth:`_decode_layers` (its products, and an int8 head's for as many rows, through ``matmuls``): the same
        arithmetic in fewer host operations. ``decode_layers``: the runner's op of that name (None: none); where it
        binds this model's layers (:mod:`fastgate.ops.decoder`: float32 rows of int4 weights) such a pass runs its
        layers in one call of it, between the taps, bitwise the same. ``swiglu``: the runner's op of that name, the
        SwiGLU of a SiLU model's layers in a pass of any other path (its reference by default)."""
        wanted = set(tap_layers)
        outputs: dict[int, torch.Tensor] = {}
        t = ids.shape[0]
        h = self.embed(ids)  # [T, d]
        if 0 in wanted:
            outputs[0] = h[None]
        cos, sin = self.rope(positions, h)  # [T, D]
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, D]
        # bf16 rows over a store whose attention runs in C++ (plan.attend), float32 rows where the step op runs them
        # in C++ (AVX2 and FMA: float32 set on it)
        decode = (attention_step is not None and not plan.segs and plan.m == t and h.device.type == "cpu"
                  and (plan.attend is not None and t <= self._row_limit if h.dtype is torch.bfloat16
                       else h.dtype is torch.float32 and getattr(attention_step, "float32", False)
                       and t <= self._kernel_limit(matmuls, torch.float32)))
        stack = self._stack(decode_layers) if decode else None
        if (stack is not None and stack.takes(h)
                and (h.dtype is not torch.bfloat16 or t <= self._kernel_limit(matmuls, torch.bfloat16))):
            h = self._stacked_layers(stack, h, cos, sin, plan, wanted, outputs)
        elif decode:
            h = self._decode_layers(h, cos, sin, plan, rms_norm, rope, attention_step, wanted, outputs, matmuls,
                                    swiglu)
        else:
            h = self._layers(h, cos, sin, plan, attention, rms_norm, rope, wanted, outputs, matmuls, swiglu)
        h = rms_norm(h, self.norm_w, self.norm_eps)  # the final norm: the layers' norm op (HF's arithmetic)
        if self.n in wanted:
            outputs[self.n] = h[None]
        if keep.shape[0] <= self._head_rows(matmuls[1], h):
            logits = matmuls[1](h[keep], self.head)  # [K, V]
        else:
            logits = self.head(h[keep])  # [K, V]
        with serial_torch(logits, logits.shape[0]):  # a cast of [K, V] torch splits over its threads: see the op
            logits = logits.to(torch.float32)  # [K, V]
        return logits, outputs

    def _head_rows(self, int8_matmul, h: torch.Tensor) -> int:
        """The most rows an int8 head multiplies through the op ``int8_matmul`` for rows like ``h`` (-1: none, the
        head's own forward), kept a (op, dtype, device): a step's host operations run ~10x slower than alone after
        its layers stream the weights through the caches."""
        key = (int8_matmul, h.dtype, h.device.type)
        rows = self._head_limits.get(key)
        if rows is None:
            head = self.head
            ok = (type(head) is Int8Linear and h.device.type == "cpu" and head.bias is None and head._k_ok
                  and _op_takes(int8_matmul, h.dtype))
            rows = self._head_limits[key] = _op_rows(head, int8_matmul, h.dtype) if ok else -1
        return rows

    def _layers(self, h, cos, sin, plan, attention, rms_norm, rope, wanted, outputs,
                matmuls=(torch_int4_matmul, torch_int8_matmul), swiglu=reference.swiglu) -> torch.Tensor:
        """The decoder layers over ``h [T, d]`` (any pass: decode rows and prompt chunks). bf16 rows on a CPU few
        enough for a quantized layer's kernel go through ``matmuls`` as in :meth:`_decode_layers`, so a pass's
        products do not depend on the path it takes; every other product is the layer's own."""
        t = h.shape[0]
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        rows_ok = h.dtype in (torch.bfloat16, torch.float32) and h.device.type == "cpu"
        pause = plan.pause  # between two layers nothing of this pass is in flight: another loop's pass may run there
        for i, (layer, products) in enumerate(zip(self.layers, self._products(matmuls, h.dtype))):
            if pause is not None and i:
                pause()
            # the kernel up to its rows, the kept copy's bare product beyond (the layer's own calls, without its
            # module call and checks), else the layer
            qkv_p, o_p, gate_up_p, down_p = (
                (small if t <= rows else large or linear) if rows_ok and small is not None else linear
                for (small, rows, large), linear in zip(products, layer.linears))
            x = rms_norm(h, layer.ln1, layer.eps1)
            qkv = qkv_p(x).view(t, hq + 2 * hk, d)  # [T, Hq + 2 Hkv, D]
            qk = rope(qkv[:, :hq + hk], cos, sin)  # [T, Hq + Hkv, D]
            q = qk[:, :hq].transpose(0, 1)[None]  # [1, Hq, T, D]
            k = qk[:, hq:].transpose(0, 1)[None]  # [1, Hkv, T, D]
            v = qkv[:, hq + hk:].transpose(0, 1)[None]  # [1, Hkv, T, D]
            o, _ = attention(layer.attn, q, k, v, None, scaling=layer.scaling, fastgate_plan=plan)
            h = h + o_p(o.reshape(t, hq * d))  # o [1, T, Hq, D]
            x = rms_norm(h, layer.ln2, layer.eps2)
            gu = gate_up_p(x)  # [T, 2 I]
            h = h + down_p(layer.activation(gu, swiglu))
            if i + 1 in wanted and i + 1 < self.n:
                outputs[i + 1] = h[None]
        return h

    def _kernel_limit(self, matmuls: tuple, dtype: torch.dtype) -> int:
        """The most ``dtype`` rows every layer's products of ``matmuls`` take through their kernels (for rows of a
        dtype the layer keeps a copy in, the op's own ``float32_rows`` / ``bf16_rows``: :func:`_op_rows`; more rows
        multiply the kept copy), and 0 where a layer has no quantized product: a float32 model of float weights keeps
        torch's attention (its SDPA; the C++ loop sums in another order), the arithmetic its recorded answers were made
        with. float32 rows take :meth:`_decode_layers` only up to it; a layer stack, bitwise the per-op path only
        where every product runs its kernel, takes bf16 rows only up to it."""
        key = (matmuls, dtype)
        rows = self._kernel_limits.get(key)
        if rows is None:
            rows = self._kernel_limits[key] = min(
                _kernel_rows(products) if layer.quantized else 0
                for layer, products in zip(self.layers, self._products(matmuls, dtype)))
        return rows

    def _selected(self, matmuls: tuple, t: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple]:
        """Each layer's calls for a decode pass of ``t`` rows of ``dtype`` (kept a ``(matmuls, t, dtype)``):
        ``(qkv, qkv_normed, o, o_added, gate_up, gate_up_normed, down, down_added)``, each product as its layer runs
        ``t`` rows (the
        kernel up to its rows, the kept copy beyond), the fused forms (the norm before, the residual sum after, in the
        kernel's call) where the kernel takes the rows and the op binds them, else None."""
        key = (matmuls, t, dtype)
        selected = self._selections.get(key)
        if selected is None:
            selected = []
            for products in self._products(matmuls, dtype):
                (qkv, qkv_rows, qkv_large), (o, o_rows, o_large), (gu, gu_rows, gu_large), (dn, dn_rows, dn_large) = \
                    products
                selected.append((
                    qkv if t <= qkv_rows else qkv_large, getattr(qkv, "normed", None) if t <= qkv_rows else None,
                    o if t <= o_rows else o_large, getattr(o, "added", None) if t <= o_rows else None,
                    gu if t <= gu_rows else gu_large, getattr(gu, "normed", None) if t <= gu_rows else None,
                    dn if t <= dn_rows else dn_large, getattr(dn, "added", None) if t <= dn_rows else None))
            self._selections[key] = selected
        return selected

    def _plain_copies(self) -> int:
        """How many of the layers' products and the head keep a plain de-quantized copy (int4-dense)."""
        linears = [m for layer in self.layers for m in layer.linears] + [self.head]
        return sum(m.dense is not None for m in linears if isinstance(m, _QUANT))

    def _products(self, matmuls: tuple, dtype: torch.dtype = torch.bfloat16) -> list[list[tuple]]:
        """Every layer's four products (:func:`_row_products`) of ``dtype`` rows with the quantized ones through
        ``matmuls``."""
        key = (matmuls, dtype)
        bound = self._bound.get(key)
        if bound is None:
            plain = self._plain_copies()
            bound = self._bound[key] = [[_row_products(m, *matmuls, dtype=dtype) for m in layer.linears]
                                        for layer in self.layers]
            adopt = getattr(matmuls[2], "adopt", None) if len(matmuls) > 2 else None
            if adopt is not None and isinstance(self.head, _QUANT):
                # the head's own forward (past its kernel's rows: a step of 33-80 rows) multiplies the reordered
                # weight, not F.linear's reorder of the plain copy each call: qwen2.5-0.5b's, 33 rows, 44 -> 27 ms
                adopt(self.head)
            if self._plain_copies() < plain:
                # kept copies handed to reordered weights (fastgate.ops.dense.OnednnDense.adopt): products bound
                # before with another op hold the plain copies, so they are bound again when asked; the copies'
                # pages go back to the OS now (glibc keeps them otherwise: qwen2.5-0.5b 3.43 -> 2.86 GB resident)
                self._bound = {key: bound}
                self._selections.clear()
                return_freed_memory()
        return bound

    def _stack(self, decode_layers):
        """The op ``decode_layers``' stack of this model's layers (built once an op; None: the op takes none)."""
        if decode_layers is None:
            return None
        stack = self._stacks.get(decode_layers, False)
        if stack is False:
            weights = [DecoderLayerWeights(layer.qkv, layer.o, layer.gate_up, layer.down, layer.ln1, layer.eps1,
                                           layer.ln2, layer.eps2, layer.scaling, layer.act) for layer in self.layers]
            stack = self._stacks[decode_layers] = decode_layers(weights, self.heads, self.kv_heads, self.head_dim)
        return stack

    def _stacked_layers(self, stack, h, cos, sin, plan, wanted, outputs) -> torch.Tensor:
        """:meth:`_decode_layers` through ``stack`` (one call from one tapped layer to the next): bitwise the same."""
        store = plan.store
        first = 0
        for end in sorted({i for i in wanted if 0 < i < self.n} | {self.n}):
            h = stack(h, cos, sin, store.keys, store.values, plan.pos, first, end)  # [T, d]
            if end < self.n:
                outputs[end] = h[None]
            first = end
        return h

    def _decode_layers(self, h, cos, sin, plan, rms_norm, rope, attention_step, wanted, outputs,
                       matmuls=(torch_int4_matmul, torch_int8_matmul), swiglu=reference.swiglu) -> torch.Tensor:
        """:meth:`_layers` for a pass of ``T`` decode rows only (row ``r`` is store row ``r``, its token at column
        ``plan.pos[r]``), bf16 on a CPU (or float32 of quantized weights, where the step op takes float32 rows:
        :meth:`_kernel_limit`): the products as bare calls (:func:`_row_products`: the kernels up to their
        rows, the kept de-quantized or float weights beyond) and each layer's store writes and attention as one call
        of ``attention_step``. The operations and their order are :meth:`_layers`'; only the host's share shrinks."""
        t = h.shape[0]
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        store, pos = plan.store, plan.pos
        roped = getattr(attention_step, "roped", None)
        for i, (layer, calls) in enumerate(zip(self.layers, self._selected(matmuls, t, h.dtype))):
            qkv_p, qkv_n, o_p, o_a, gate_up_p, gate_up_n, down_p, down_a = calls
            # the norm and the product after it in one call where the kernel takes these rows (bitwise the two)
            if qkv_n is not None:
                qkv = qkv_n(h, layer.ln1, layer.eps1, rms_norm)
            else:
                qkv = qkv_p(rms_norm(h, layer.ln1, layer.eps1))
            qkv = qkv.view(t, hq + 2 * hk, d)  # [T, Hq + 2 Hkv, D]
            if roped is not None:  # the rotary embedding in the attention's call (bitwise the two)
                o = roped(qkv, hq, cos, sin, store.keys[layer.index], store.values[layer.index], pos, layer.scaling,
                          rope)  # [T, Hq, D]
            else:
                qk = rope(qkv[:, :hq + hk], cos, sin)  # [T, Hq + Hkv, D]
                o = attention_step(qk[:, :hq], qk[:, hq:], qkv[:, hq + hk:], store.keys[layer.index],
                                   store.values[layer.index], pos, layer.scaling)  # [T, Hq, D]
            # the residual sum in the product's call where the kernel takes these rows (bitwise h + product)
            h = o_a(o.view(t, hq * d), h) if o_a is not None else h + o_p(o.view(t, hq * d))
            if gate_up_n is not None:
                gu = gate_up_n(h, layer.ln2, layer.eps2, rms_norm)  # [T, 2 I]
            else:
                gu = gate_up_p(rms_norm(h, layer.ln2, layer.eps2))  # [T, 2 I]
            act = layer.activation(gu, swiglu)  # [T, I]
            h = down_a(act, h) if down_a is not None else h + down_p(act)
            if i + 1 in wanted and i + 1 < self.n:
                outputs[i + 1] = h[None]
        return h
