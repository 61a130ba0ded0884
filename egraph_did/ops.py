"""The op table: every fact about an op, stated once in its entry, and the queries that read them.

An entry is one `@op(...)` on the op's shape rule (its signature is the op's signature in `fd.ops`).
Beside the shape rule it states:

- kind: what the op computes: pointwise | mask | reduction | scan (a running reduction along an axis:
  cumsum) | normalization | matmul | attention | gather | view | join (tensors laid side by side: cat) |
  opaque (an ATen op run as torch runs it, on whole operands: only the replicated rule applies) |
  constant (no operand: full) | random (elementwise, from a seed and each element's global position:
  dropout; never fused, its shards need their global offsets). Rules, the problem and the lowering select ops
  by kind (`ops_where(kind="view")`), never by a list of names;
- reference: its torch evaluation; decompose (composites): its expansion into other ops, rfactor: a
  decomposition that splits the reduction in blocks;
- the facts a later stage needs: arity (pointwise), template (the Triton form of a kernel primitive),
  identity (a reduction's), fuses (a composite a Triton kernel runs through its decomposition),
  metadata_only and permutation (views), local_attrs (attributes that are shapes, made local on a
  rank), flops, indexes (the index operand of a gather) and local_kernels: the rank-local variants
  sharding rules name (LocalKernel, declared beside the op they belong to);
- vjp: its backward as fusion ops (egraph_did.grad reads it), or no_grad: why it has none;
  differentiated_as: the op a gradient runs in its place in the forward, whose extra outputs the backward
  reads (sdpa -> sdpa_lse, the logsumexp sdpa_backward needs).

Adding a pointwise op is one line here: `_unary("sin", torch.sin, template="tl.sin({x})")`; its
sharding rules, kernel support and fusion follow from its kind. Shape rules raise ShapeError at the op
that is wrong, naming the tensor and the axis.

Shape rules see TensorSpec values (name, shape, dtype, axis names); references see torch tensors bound
to the same parameter names; decompositions see the TensorViews of a fusion being built and an `ops`
namespace to emit primitives with; local kernels see one rank's tensors (egraph_did.local.run_local).
"""
from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .collectives import (EXCHANGES, exchange_run, exchange_simulate, ring_attention_backward_kernel,
                          ring_attention_kernel, ring_kernel)
from .errors import DtypeError, PlanError, ShapeError
from .shards import RankContext

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INT_DTYPES = (torch.int64, torch.int32)
SUPPORTED_DTYPES = FLOAT_DTYPES + INT_DTYPES + (torch.bool,)
KINDS = ("pointwise", "mask", "reduction", "scan", "normalization", "matmul", "attention", "gather", "view",
         "join", "opaque", "constant", "random")


@dataclass(frozen=True)
class TensorSpec:
    """What a shape rule knows of a tensor operand."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    axes: tuple[str, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class OutSpec:
    """What a shape rule returns for each output."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    axes: tuple[str, ...]

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


@dataclass(frozen=True)
class LocalKernel:
    """A rank-local variant of an op: what one rank computes when the identity a sharding rule states
    needs the rank's place in the mesh (a bias added on one rank only, a mean divided by the global
    count, a lookup masked to the rows the rank holds). Declared beside its op and listed in the op's
    entry; a rule passes the object (`e.strategy(out=P, x=S(a), local=MEAN_GLOBAL_COUNT)`), a plan
    stores its `name`, and egraph_did.local.run_local calls `fn(args, operands, outputs, ctx, axes)`
    instead of the op's reference: args are the rank's tensors and literals by parameter, operands and
    outputs the global Operands (shape, layout), ctx the RankContext, axes the mesh axes the rule
    applies it on. A variant computes the whole op, so a step runs one: the reference or one variant.

    >>> MEAN_GLOBAL_COUNT.name, MEAN_GLOBAL_COUNT.doc.splitlines()[0]
    ('global_count', 'mean over a sharded axis as one summand of a partial: the local sum over the global count')
    """

    name: str
    fn: Callable[..., Any]

    @property
    def doc(self) -> str:
        """What the kernel computes (its function's docstring)."""
        return inspect.getdoc(self.fn) or ""

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Indexing:
    """The index operand of an indexing op: `index` holds positions along `axis` (an int, or the
    parameter holding it) of `table`, which counts `counts`; `fix` is the advice of an out-of-range
    message ({index} and {table} name the tensors)."""

    index: str
    table: str
    axis: int | str
    counts: str
    fix: str = "fix {index}"
    # the parameter holding an index value that marks "no entry" (cross_entropy's ignore_index): allowed
    # anywhere; None (the parameter's value or no such parameter): every index must be in range
    skip: str | None = None


@dataclass(frozen=True)
class OpDef:
    """One op's facts (see the module docstring); `ops_where` selects ops by them."""

    name: str
    kind: str
    infer: Callable[..., list[OutSpec]]
    reference: Callable[..., Any]
    decompose: Callable[..., Any] | None
    signature: inspect.Signature
    rfactor: Callable[..., Any] | None = None  # rfactor(ops, blocks, **args): the reduction split in blocks
    arity: int | None = None  # pointwise: how many operands (a tensor or a Python number each)
    # The Triton form of a kernel primitive, over fp32 operand values by parameter name: "tl.exp({x})";
    # for a reduction, how two partial results {a} and {b} combine, starting from `identity`.
    template: str | None = None
    identity: float | None = None
    fuses: bool = False  # a composite whose decomposition is made of kernel primitives
    metadata_only: bool = False  # a view whose local result needs no kernel: no time, no memory
    permutation: Callable[[dict, int], tuple[int, ...]] | None = None  # (args, ndim) -> p: out axis i is in axis p[i]
    local_attrs: Callable[[dict, list[tuple[int, ...]]], dict] | None = None  # (args, local out shapes) -> attrs
    flops: Callable[[list, list, dict], float] | None = None  # (in shapes, out shapes, args); None: one per element
    indexes: Indexing | None = None
    local_kernels: tuple[LocalKernel, ...] = ()
    # vjp(ops, g, out, **args) -> {param: gradient}: the op's backward emitted as fusion ops (see
    # "Gradients" below); no_grad: why an op has none (its outputs are not real-valued, ...)
    vjp: Callable[..., dict] | None = None
    no_grad: str | None = None
    # differentiated_as: in a gradient, the op this one runs as in the forward: its outputs first, then
    # what the backward reads (sdpa -> sdpa_lse: the logsumexp), computed once there; that op's vjp applies
    differentiated_as: str | None = None

    def __post_init__(self):
        assert self.kind in KINDS, f"op {self.name}: kind {self.kind!r} is none of {KINDS}"
        names = [k.name for k in self.local_kernels]
        assert len(set(names)) == len(names), f"op {self.name}: local kernels {names} share a name"
        assert self.vjp is None or self.no_grad is None, f"op {self.name}: a vjp and a no_grad reason"

    @property
    def is_composite(self) -> bool:
        return self.decompose is not None

    @property
    def in_kernels(self) -> bool:
        """A primitive a Triton kernel computes directly (pointwise, reduction or permutation)."""
        return self.template is not None or self.permutation is not None

    @property
    def permutes(self) -> bool:
        """A view that reorders axes (a Triton transpose moves its data)."""
        return self.permutation is not None

    @property
    def fusible(self) -> bool:
        """A fused segment may hold it: a kernel primitive, or a composite made of them."""
        return self.in_kernels or self.fuses

    @property
    def reduces(self) -> bool:
        """It reduces over an axis (so a sharded reduced axis leaves a partial)."""
        return self.kind in ("reduction", "normalization")

    @property
    def empty_shards(self) -> bool:
        """Its local kernel is right on a shard that holds no elements, so its strategies may take layouts
        that leave a rank empty (5 rows over 4 ranks: 2, 2, 1, 0): an elementwise op or a view maps an empty
        shard to an empty one. A reduction, a matmul or a normalization of an empty shard would have to
        produce the reduction's identity (torch's amax refuses an empty axis), so they keep to layouts
        where every rank holds data.

        >>> OPS["relu"].empty_shards, OPS["reshape"].empty_shards, OPS["sum"].empty_shards
        (True, True, False)
        """
        return self.kind in ("pointwise", "view")

    def count_flops(self, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], args: dict) -> float:
        """Floating-point work on these (local) shapes; by default one operation per element read or
        written.

        >>> OPS["linear"].count_flops([(8, 16), (64, 16)], [(8, 64)], {}), OPS["exp"].count_flops([(4,)], [(4,)], {})
        (16384.0, 8.0)
        """
        if self.flops is not None:
            return self.flops(ins, outs, args)
        return float(sum(math.prod(s) for s in ins) + math.prod(outs[0]))

    def local_kernel(self, name: str) -> LocalKernel:
        """The rank-local variant called `name` (as a plan names it).

        >>> OPS["linear"].local_kernel("bias_once") is LINEAR_BIAS_ONCE
        True
        """
        for k in self.local_kernels:
            if k.name == name:
                return k
        known = ", ".join(k.name for k in self.local_kernels) or "none"
        raise PlanError(f"a step of {self.name} names the local kernel {name!r}, which {self.name} does not "
                        f"declare (it has: {known}); the plan was made by another version of egraph-did")


OPS: dict[str, OpDef] = {}
_FACTS = {f.name for f in fields(OpDef)} - {"name", "kind", "infer", "reference", "decompose", "signature"}


def op(name: str, kind: str, reference: Callable, decompose: Callable | None = None, **facts):
    """Register an op whose shape rule is the decorated function; `facts` are OpDef's optional fields."""
    unknown = set(facts) - _FACTS
    assert not unknown, f"op {name}: unknown facts {sorted(unknown)}; OpDef has {sorted(_FACTS)}"

    def register(infer):
        assert name not in OPS, f"op {name} registered twice"
        OPS[name] = OpDef(name, kind, infer, reference, decompose, inspect.signature(infer), **facts)
        return infer
    return register


def ops_where(**facts) -> tuple[str, ...]:
    """The ops whose facts (OpDef fields or properties) equal those given, in table order: every list
    of ops is one of these queries.

    >>> ops_where(kind="view", metadata_only=False)
    ('permute', 'transpose', 'slice')
    >>> ops_where(kind="reduction", in_kernels=True)
    ('sum', 'amax')
    """
    return tuple(n for n, d in OPS.items() if all(getattr(d, k) == v for k, v in facts.items()))


# ------------------------------------------------------------------ helpers for shape rules

def complex_message(dtype, tensors=()) -> str:
    """What a DtypeError says of a complex dtype: egraph-did holds real tensors only; `tensors` names them.

    >>> complex_message(torch.complex64, ["x", "w"])
    'x, w: complex64 is a complex dtype, which egraph-did does not take (its ops, kernels and collectives are real); hold each complex tensor as its real pairs (torch.view_as_real gives [..., 2] of float32) and compute with the real and imaginary parts'
    """
    name = str(dtype).replace("torch.", "")
    real = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}.get(name, "a real dtype")
    who = f"{', '.join(tensors)}: " if tensors else ""
    return (f"{who}{name} is a complex dtype, which egraph-did does not take (its ops, kernels and collectives are "
            f"real); hold each complex tensor as its real pairs (torch.view_as_real gives [..., 2] of {real}) and "
            f"compute with the real and imaginary parts")


def canonical_dtype(dtype) -> torch.dtype:
    """A torch dtype from a torch dtype or its name ('bf16', 'bfloat16', 'float32', ...); DtypeError for
    another (a complex one says how to hold it as reals).

    >>> canonical_dtype("bf16"), canonical_dtype(torch.int32)
    (torch.bfloat16, torch.int32)
    >>> canonical_dtype(torch.complex128)
    Traceback (most recent call last):
    ...
    egraph_did.errors.DtypeError: complex128 is a complex dtype, which egraph-did does not take (its ops, kernels and collectives are real); hold each complex tensor as its real pairs (torch.view_as_real gives [..., 2] of float64) and compute with the real and imaginary parts
    """
    aliases = {"fp32": torch.float32, "float": torch.float32, "fp16": torch.float16, "half": torch.float16,
               "bf16": torch.bfloat16, "fp64": torch.float64, "double": torch.float64, "long": torch.int64,
               "int": torch.int32}
    found = aliases.get(dtype, getattr(torch, dtype, None)) if isinstance(dtype, str) else dtype
    if isinstance(found, torch.dtype) and found.is_complex:
        raise DtypeError(complex_message(found))
    if found not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise DtypeError(f"unknown or unsupported dtype {dtype!r}; use one of {names}")
    return found


def _is_tensor(v) -> bool:
    return isinstance(v, TensorSpec)


def _desc(v) -> str:
    return v.name if _is_tensor(v) else repr(v)


def _need_tensor(op_name: str, arg: str, v) -> TensorSpec:
    if not _is_tensor(v):
        raise ShapeError(f"{op_name}: argument {arg} must be a tensor of the fusion, got {v!r}")
    return v


def _need_float(op_name: str, v: TensorSpec) -> None:
    if v.dtype not in FLOAT_DTYPES:
        raise DtypeError(f"{op_name}({v.name}): needs a floating-point tensor, but {v.name} is "
                         f"{str(v.dtype).replace('torch.', '')}; cast it first (fd.ops.cast)")


def norm_axis(op_name: str, v: TensorSpec, axis: int, ndim: int | None = None) -> int:
    """A non-negative axis of v (ndim overrides v.ndim for ops that add an axis)."""
    n = v.ndim if ndim is None else ndim
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ShapeError(f"{op_name}({v.name}): axis must be an int (a position; negative counts from the end), "
                         f"got {axis!r}")
    if not -n <= axis < n:
        raise ShapeError(f"{op_name}({v.name}): axis {axis} out of range; {v.name} has {n} axes "
                         f"(shape {v.shape}): pass an axis in [{-n}, {n})")
    return axis % n


def norm_axes(op_name: str, v: TensorSpec, dims) -> tuple[int, ...]:
    """Sorted distinct non-negative axes; None means every axis."""
    if dims is None:
        return tuple(range(v.ndim))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if not dims:
        raise ShapeError(f"{op_name}({v.name}): dims=() is ambiguous (torch reduces every axis); pass "
                         f"dims=None to reduce every axis")
    out = sorted(norm_axis(op_name, v, d) for d in dims)
    if len(set(out)) != len(out):
        raise ShapeError(f"{op_name}({v.name}): axes {dims} repeat an axis")
    return tuple(out)


def _probe(dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """A tensor of dtype standing in for an operand in torch's promotion, which treats 0-D tensors as
    numbers: float32 x[3, 7] ** float64 e[] is float32 (fuzz issue 12, seed 7 case 4693)."""
    return torch.zeros((), dtype=dtype) if ndim == 0 else torch.empty(0, dtype=dtype)


def _result_dtype(op_name: str, *vals) -> torch.dtype:
    probes = [_probe(v.dtype, len(v.shape)) if _is_tensor(v) else v for v in vals]
    try:
        if len(probes) == 1:
            return probes[0].dtype
        dt = torch.result_type(probes[0], probes[1])
        dims = any(isinstance(p, torch.Tensor) and p.ndim for p in probes[:2])
        for p in probes[2:]:
            dt = torch.result_type(_probe(dt, int(dims)), p)
            dims = dims or (isinstance(p, torch.Tensor) and p.ndim > 0)
        return dt
    except (TypeError, RuntimeError) as e:
        raise DtypeError(f"{op_name}({', '.join(_desc(v) for v in vals)}): {e}") from None


def broadcast_specs(op_name: str, *vals) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Numpy broadcasting of the tensor operands; errors name both tensors and the axis."""
    tensors = [v for v in vals if _is_tensor(v)]
    if not tensors:
        raise ShapeError(f"{op_name}: needs at least one tensor operand, got {vals}")
    n = max(t.ndim for t in tensors)
    shape, axes = [1] * n, [""] * n
    owner: list[TensorSpec | None] = [None] * n
    for t in tensors:
        off = n - t.ndim
        for i, (e, a) in enumerate(zip(t.shape, t.axes)):
            k = off + i
            if e == 1 and shape[k] != 1:
                continue
            if shape[k] != 1 and e != shape[k]:
                o = owner[k]
                raise ShapeError(
                    f"{op_name}({', '.join(_desc(v) for v in vals)}): axis {i} of {t.name} has extent {e} but "
                    f"axis {k - (n - o.ndim)} of {o.name} has {shape[k]}; they must be equal or 1 (broadcast)")
            if e != 1 or owner[k] is None:
                shape[k], axes[k], owner[k] = e, a, t
    return tuple(shape), tuple(axes)


def _scalar_check(op_name: str, vals) -> None:
    for v in vals:
        if not _is_tensor(v) and not isinstance(v, (int, float, bool)):
            raise ShapeError(f"{op_name}: operand {v!r} is neither a tensor of the fusion nor a Python number")


# ------------------------------------------------------------------ gradients: what a vjp is, and its helpers
#
# A vjp states an op's backward beside it: `vjp(ops, g, out, **args) -> {param: gradient}`. g is the
# gradient of the loss with respect to the op's output and out the output (for an op of several
# outputs, tuples with one entry per output, g's None where no gradient flows); args are the op's
# arguments as the forward bound them. It emits fusion ops through `ops`, as a decomposition does, and
# returns a gradient, of its operand's shape, for each tensor parameter. egraph_did.grad drops those
# no input needs, casts each to its operand's dtype and adds up the gradients of a tensor read twice.
# Fusions have no constants: a gradient that needs zeros or a mask builds them from a tensor's shape.


def _num(v) -> bool:
    return isinstance(v, (int, float, bool))


def zeros_like(ops, t):
    """Zeros of t's shape and dtype, whatever t holds: t > t is false for every value, NaN included.

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((2,), name="x")
    ...     fd.add_output(zeros_like(fd.ops, x), name="z")
    >>> ed.evaluate(fd, {"x": torch.tensor([float("nan"), 3.0])})["z"]
    tensor([0., 0.])
    """
    return ops.cast(ops.gt(t, t), t.dtype)


def sum_to(ops, g, shape):
    """g summed down to `shape`, a shape it was broadcast from (numpy rules: new leading axes, and axes
    of extent 1): the gradient of a broadcast operand.

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     g = fd.define_tensor((2, 3), name="g")
    ...     fd.add_output(sum_to(fd.ops, g, (1, 3)), name="row")
    >>> ed.evaluate(fd, {"g": torch.ones(2, 3)})["row"]
    tensor([[2., 2., 2.]])
    """
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    lead = g.ndim - len(shape)
    dims = tuple(range(lead)) + tuple(lead + i for i, e in enumerate(shape) if e == 1 and g.shape[lead + i] != 1)
    if dims:
        g = ops.sum(g, dims, keepdim=True)
    return g if tuple(g.shape) == shape else ops.reshape(g, shape)


def _reduced_axes(ndim: int, dims) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    return tuple(sorted(d % ndim for d in ((dims,) if isinstance(dims, int) else dims)))


def unreduce(ops, g, shape, dims, keepdim: bool):
    """A reduction's output (or its gradient) over `dims` of a tensor of `shape`, broadcast back to
    that shape: the gradient every reduced element receives.

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     g = fd.define_tensor((2,), name="g")
    ...     fd.add_output(unreduce(fd.ops, g, (2, 3), 1, keepdim=False), name="gx")
    >>> ed.evaluate(fd, {"g": torch.tensor([1., 2.])})["gx"]
    tensor([[1., 1., 1.],
            [2., 2., 2.]])
    """
    axes = _reduced_axes(len(shape), dims)
    kept = tuple(1 if i in axes else e for i, e in enumerate(shape))
    if tuple(g.shape) != kept:
        g = ops.reshape(g, kept)
    return g if kept == tuple(shape) else ops.expand(g, tuple(shape))


def _binary_grads(ops, a, b, ga, gb) -> dict:
    """{param: gradient summed to its operand's shape} for the operands that are tensors; ga and gb are
    thunks, so that a Python-number operand costs no ops."""
    return {p: sum_to(ops, fn(), v.shape) for p, v, fn in (("a", a, ga), ("b", b, gb)) if not _num(v)}


def _as_float(ops, cond, dtype):
    return ops.cast(cond, dtype)


def _share_of_max(ops, a, b, dtype):
    """torch's rule for maximum: 1 where a wins, 1/2 on a tie, 0 where b wins (minimum's share of a is
    _share_of_max(b, a): 1 where a is below b)."""
    return ops.add(_as_float(ops, ops.gt(a, b), dtype), ops.mul(_as_float(ops, ops.eq(a, b), dtype), 0.5))


def _vjp_pow(ops, g, out, a, b):
    def grad_a():
        if _num(b):
            return zeros_like(ops, g) if b == 0 else ops.mul(g, ops.mul(ops.pow(a, b - 1), b))
        return ops.mul(g, ops.mul(b, ops.pow(a, ops.sub(b, 1.0))))

    def grad_b():
        return ops.mul(g, ops.mul(out, math.log(a) if _num(a) else ops.log(a)))
    return _binary_grads(ops, a, b, grad_a, grad_b)


# ------------------------------------------------------------------ pointwise

def _binary(name: str, fn: Callable, template: str, vjp: Callable):
    def infer(a, b):
        _scalar_check(name, (a, b))
        if name in ("sub", "div", "pow") and any((v.dtype if _is_tensor(v) else type(v)) in (torch.bool, bool)
                                                 for v in (a, b)):
            raise DtypeError(f"{name}({_desc(a)}, {_desc(b)}): {name} of booleans is not defined; cast to a "
                             f"number type first")
        shape, axes = broadcast_specs(name, a, b)
        dt = _result_dtype(name, a, b)
        if name == "div" and dt not in FLOAT_DTYPES:
            dt = torch.float32
        return [OutSpec(shape, dt, axes)]
    infer.__name__ = name
    infer.__doc__ = f"Elementwise {name}(a, b) with numpy broadcasting; either side may be a Python number."
    op(name, "pointwise", fn, arity=2, template=template, vjp=vjp)(infer)


_binary("add", lambda a, b: a + b, "{a} + {b}",
        lambda ops, g, out, a, b: _binary_grads(ops, a, b, lambda: g, lambda: g))
_binary("sub", lambda a, b: a - b, "{a} - {b}",
        lambda ops, g, out, a, b: _binary_grads(ops, a, b, lambda: g, lambda: ops.neg(g)))
_binary("mul", lambda a, b: a * b, "{a} * {b}",
        lambda ops, g, out, a, b: _binary_grads(ops, a, b, lambda: ops.mul(g, b), lambda: ops.mul(g, a)))
_binary("div", lambda a, b: a / b, "{a} / {b}",  # d(a/b)/db = -(a/b)/b
        lambda ops, g, out, a, b: _binary_grads(ops, a, b, lambda: ops.div(g, b),
                                                lambda: ops.neg(ops.mul(g, ops.div(out, b)))))
_binary("maximum", lambda a, b: torch.maximum(*_as_tensors(a, b)),
        "tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",  # NaN wins, as torch.maximum
        lambda ops, g, out, a, b: _binary_grads(ops, a, b, lambda: ops.mul(g, _share_of_max(ops, a, b, g.dtype)),
                                                lambda: ops.mul(g, _share_of_max(ops, b, a, g.dtype))))
_binary("minimum", lambda a, b: torch.minimum(*_as_tensors(a, b)),
        "tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",  # NaN wins, as torch.minimum
        lambda ops, g, out, a, b: _binary_grads(ops, a, b, lambda: ops.mul(g, _share_of_max(ops, b, a, g.dtype)),
                                                lambda: ops.mul(g, _share_of_max(ops, a, b, g.dtype))))
_binary("pow", lambda a, b: a ** b, "_pow({a}, {b})", _vjp_pow)  # codegen specializes a scalar exponent


def _comparison(name: str, fn: Callable, template: str):
    def infer(a, b):
        _scalar_check(name, (a, b))
        shape, axes = broadcast_specs(name, a, b)
        _result_dtype(name, a, b)  # operands must compare: the same promotion as arithmetic
        return [OutSpec(shape, torch.bool, axes)]
    infer.__name__ = name
    infer.__doc__ = (f"Elementwise comparison {name}(a, b) -> bool with numpy broadcasting (a mask for a "
                     f"gradient); either side may be a Python number.")
    op(name, "pointwise", fn, arity=2, template=template,
       no_grad="a comparison: its output is boolean, so no gradient flows through it")(infer)


_comparison("gt", lambda a, b: a > b, "{a} > {b}")
_comparison("eq", lambda a, b: a == b, "{a} == {b}")
_comparison("ne", lambda a, b: a != b, "{a} != {b}")
_comparison("lt", lambda a, b: a < b, "{a} < {b}")
_comparison("le", lambda a, b: a <= b, "{a} <= {b}")
_comparison("ge", lambda a, b: a >= b, "{a} >= {b}")


def _where_ref(cond, a, b):
    """torch.where with a Python number on either side, promoted as torch promotes a and b."""
    dt = torch.result_type(a, b)
    a, b = (torch.as_tensor(v, dtype=dt, device=cond.device) for v in (a, b))
    return torch.where(cond, a, b)


def _vjp_where(ops, g, out, cond, a, b):
    """g where cond selects the operand, 0 where it selects the other; cond (bool) has none"""
    return _binary_grads(ops, a, b, lambda: ops.where(cond, g, 0.0), lambda: ops.where(cond, 0.0, g))


@op("where", "pointwise", _where_ref, arity=3, vjp=_vjp_where)
def where(cond, a, b):
    """a where cond holds, else b (torch.where), broadcasting all three; a and b may be Python numbers."""
    cond = _need_tensor("where", "cond", cond)
    _scalar_check("where", (a, b))
    if cond.dtype != torch.bool:
        raise DtypeError(f"where({cond.name}, {_desc(a)}, {_desc(b)}): the condition must be bool, got "
                         f"{str(cond.dtype).replace('torch.', '')}; compare it first (fd.ops.ne(c, 0))")
    shape, axes = broadcast_specs("where", cond, a, b)
    if not any(_is_tensor(v) for v in (a, b)):
        raise ShapeError(f"where({cond.name}, {a!r}, {b!r}): one of a and b must be a tensor of the fusion (the "
                         f"result's dtype follows it); pass fd.ops.cast of a tensor")
    return [OutSpec(shape, _result_dtype("where", a, b), axes)]


def _as_tensors(a, b):
    """Both operands as tensors of their promoted dtype (torch.maximum takes no Python numbers)."""
    dt = torch.result_type(a, b)
    like = a if isinstance(a, torch.Tensor) else b
    return tuple((v if isinstance(v, torch.Tensor) else torch.as_tensor(v, device=like.device)).to(dt)
                 for v in (a, b))


# Logic and bit ops: masks (a causal mask built from cumsum, eq, and, not; a padding mask reduced by
# any) compute on bool and integer tensors. Their outputs are not real-valued: no gradient flows.
_NOT_REAL = "its output is bool or integer (a mask, bits), so no gradient flows through it"
_INTEGRAL = (torch.bool,) + INT_DTYPES


def _bit_operands(name: str, a, b) -> None:
    """bitwise ops take bool and integer tensors and Python ints/bools, as torch does."""
    for v in (a, b):
        dt = v.dtype if _is_tensor(v) else (torch.bool if isinstance(v, bool) else
                                            torch.int64 if isinstance(v, int) else torch.float64)
        if dt not in _INTEGRAL:
            raise DtypeError(f"{name}({_desc(a)}, {_desc(b)}): {_desc(v)} is "
                             f"{str(dt).replace('torch.', '')}; {name} takes bool and integer operands (as "
                             f"torch); compare a float first (fd.ops.ne(x, 0)) or cast it to an integer type")


def _bitwise(name: str, fn: Callable):
    def infer(a, b):
        _scalar_check(name, (a, b))
        _bit_operands(name, a, b)
        shape, axes = broadcast_specs(name, a, b)
        return [OutSpec(shape, _result_dtype(name, a, b), axes)]
    infer.__name__ = name
    infer.__doc__ = (f"Elementwise {name}(a, b) of bool or integer operands with numpy broadcasting (torch's "
                     f"type promotion); either side may be a Python int or bool.")
    # No Triton template: the kernels take bool tensors only through cast (lowering/schedulers.py), and
    # models apply these to bool masks; such a step runs through torch (a mask is cheap, and replicated
    # or sharded by the pointwise rules all the same)
    op(name, "pointwise", fn, arity=2, no_grad=_NOT_REAL)(infer)


_bitwise("bitwise_and", lambda a, b: a & b)
_bitwise("bitwise_or", lambda a, b: a | b)
_bitwise("bitwise_xor", lambda a, b: a ^ b)


def _truth(v, like: torch.Tensor) -> torch.Tensor:
    """v (a tensor or a Python number) as a bool tensor: nonzero is true."""
    return v != 0 if isinstance(v, torch.Tensor) else torch.as_tensor(bool(v), device=like.device)


def _logical(name: str, fn: Callable, template: str):
    def infer(a, b):
        _scalar_check(name, (a, b))
        shape, axes = broadcast_specs(name, a, b)
        return [OutSpec(shape, torch.bool, axes)]
    infer.__name__ = name
    infer.__doc__ = (f"Elementwise {name}(a, b) -> bool of any operands (nonzero is true), numpy broadcasting; "
                     f"either side may be a Python number.")

    def ref(a, b):
        like = a if isinstance(a, torch.Tensor) else b
        return fn(_truth(a, like), _truth(b, like))
    op(name, "pointwise", ref, arity=2, template=template, no_grad=_NOT_REAL)(infer)


# the truth values combine as int32 and compare back: Triton's interpreter cannot `&` a comparison of a
# scalar load (an operand broadcast from one element) with a block of them (fuzz issue 12)
_logical("logical_and", torch.logical_and, "(((({a} != 0) * 1) & (({b} != 0) * 1)) != 0)")
_logical("logical_or", torch.logical_or, "(((({a} != 0) * 1) | (({b} != 0) * 1)) != 0)")


@op("logical_not", "pointwise", torch.logical_not, arity=1, template="{x} == 0", no_grad=_NOT_REAL)
def logical_not(x):
    """Elementwise not x -> bool (x == 0) of any dtype, as torch.logical_not; on a bool tensor it is
    torch's bitwise_not (~mask), on an integer one bitwise_not is bitwise_xor(x, -1).

    >>> logical_not(TensorSpec("x", (3,), torch.float32, ("s",)))
    [OutSpec(shape=(3,), dtype=torch.bool, axes=('s',))]
    """
    x = _need_tensor("logical_not", "x", x)
    return [OutSpec(x.shape, torch.bool, x.axes)]


def _unary(name: str, fn: Callable, template: str | None = None, float_only: bool = True, doc: str = "",
           vjp: Callable | None = None):
    def infer(x):
        x = _need_tensor(name, "x", x)
        if float_only:
            _need_float(name, x)
        elif x.dtype == torch.bool:
            raise DtypeError(f"{name}({x.name}): {x.name} is bool; cast it to a number type first")
        return [OutSpec(x.shape, x.dtype, x.axes)]
    infer.__name__ = name
    infer.__doc__ = doc or f"Elementwise {name}(x)."
    op(name, "pointwise", fn, arity=1, template=template, vjp=vjp)(infer)


# Templates compute on fp32 values (16-bit floats are loaded as fp32). libdevice is not used: the
# interpreter does not run extern calls; _tanh is a helper of lowering/codegen.py.
# A vjp is (ops, g, out, x) -> {"x": gradient}; see "gradients" above.
_unary("neg", torch.neg, "-({x})", float_only=False, vjp=lambda ops, g, out, x: {"x": ops.neg(g)})
_unary("exp", torch.exp, "tl.exp({x})", vjp=lambda ops, g, out, x: {"x": ops.mul(g, out)})
_unary("log", torch.log, "tl.log({x})", vjp=lambda ops, g, out, x: {"x": ops.div(g, x)})
_unary("tanh", torch.tanh, "_tanh({x})",
       vjp=lambda ops, g, out, x: {"x": ops.mul(g, ops.sub(1.0, ops.mul(out, out)))})
_unary("sigmoid", torch.sigmoid, "tl.sigmoid({x})",
       vjp=lambda ops, g, out, x: {"x": ops.mul(g, ops.mul(out, ops.sub(1.0, out)))})
_unary("relu", torch.relu, "tl.where({x} < 0, 0, {x})", float_only=False,  # keeps NaN, as torch.relu
       vjp=lambda ops, g, out, x: {"x": ops.mul(g, _as_float(ops, ops.gt(x, 0), g.dtype))})
_unary("rsqrt", torch.rsqrt, "tl.rsqrt({x})",  # d x^-1/2 = -x^-1/2 / (2x)
       vjp=lambda ops, g, out, x: {"x": ops.mul(g, ops.mul(ops.div(out, x), -0.5))})
_unary("sqrt", torch.sqrt, "tl.sqrt_rn({x})", vjp=lambda ops, g, out, x: {"x": ops.div(ops.mul(g, 0.5), out)})
_unary("erf", torch.erf, "tl.erf({x})",
       vjp=lambda ops, g, out, x: {"x": ops.mul(g, ops.mul(ops.exp(ops.neg(ops.mul(x, x))), 2 / math.sqrt(math.pi)))})
_unary("abs", torch.abs, "tl.abs({x})", float_only=False,  # sign(x), 0 at 0 as torch
       vjp=lambda ops, g, out, x: {"x": ops.mul(g, ops.sub(_as_float(ops, ops.gt(x, 0), g.dtype),
                                                             _as_float(ops, ops.gt(0, x), g.dtype)))})


def _decompose_gelu(ops, x, approximate="none"):
    if approximate == "tanh":
        inner = ops.mul(ops.add(x, ops.mul(ops.mul(ops.mul(x, x), x), 0.044715)), math.sqrt(2.0 / math.pi))
        return ops.mul(ops.mul(x, 0.5), ops.add(ops.tanh(inner), 1.0))
    return ops.mul(ops.mul(x, 0.5), ops.add(ops.erf(ops.mul(x, 1.0 / math.sqrt(2.0))), 1.0))


def _vjp_gelu(ops, g, out, x, approximate="none"):
    if approximate == "tanh":  # 0.5 (1 + t) + 0.5 x (1 - t^2) u', t = tanh(u), u = k (x + c x^3)
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        t = ops.tanh(ops.mul(ops.add(x, ops.mul(ops.mul(ops.mul(x, x), x), c)), k))
        du = ops.mul(ops.add(ops.mul(ops.mul(x, x), 3 * c), 1.0), k)
        d = ops.add(ops.mul(ops.add(t, 1.0), 0.5), ops.mul(ops.mul(ops.mul(x, 0.5), ops.sub(1.0, ops.mul(t, t))), du))
        return {"x": ops.mul(g, d)}
    cdf = ops.mul(ops.add(ops.erf(ops.mul(x, 1.0 / math.sqrt(2.0))), 1.0), 0.5)  # Phi(x) + x phi(x)
    pdf = ops.mul(ops.exp(ops.mul(ops.mul(x, x), -0.5)), 1.0 / math.sqrt(2.0 * math.pi))
    return {"x": ops.mul(g, ops.add(cdf, ops.mul(x, pdf)))}


@op("gelu", "pointwise", lambda x, approximate="none": F.gelu(x, approximate=approximate), _decompose_gelu,
    arity=1, fuses=True, vjp=_vjp_gelu)
def gelu(x, approximate: str = "none"):
    """GELU, exact (erf) or approximate='tanh', as torch.nn.functional.gelu."""
    x = _need_tensor("gelu", "x", x)
    _need_float("gelu", x)
    if approximate not in ("none", "tanh"):
        raise ShapeError(f"gelu({x.name}): approximate must be 'none' or 'tanh', got {approximate!r}")
    return [OutSpec(x.shape, x.dtype, x.axes)]


def _vjp_silu(ops, g, out, x):
    """g silu'(x) as one op, silu_backward(g, x): zero where g is, so expert rows (Pe) stay expert rows
    through it (rewrites/experts.py: expert_rows_sum)"""
    return {"x": ops.silu_backward(g, x)}


@op("silu", "pointwise", lambda x: F.silu(x), lambda ops, x: ops.mul(x, ops.sigmoid(x)), arity=1, fuses=True,
    vjp=_vjp_silu)
def silu(x):
    """SiLU: x * sigmoid(x)."""
    x = _need_tensor("silu", "x", x)
    _need_float("silu", x)
    return [OutSpec(x.shape, x.dtype, x.axes)]


def _vjp_silu_backward(ops, g, out, dy, x):
    """d/d dy = silu'(x); d/dx = dy silu''(x) = dy s (1 - s) (2 + x (1 - 2 s)), s = sigmoid(x): a double backward"""
    s = ops.sigmoid(x)
    d2 = ops.mul(ops.mul(s, ops.sub(1.0, s)), ops.add(ops.mul(x, ops.sub(1.0, ops.mul(s, 2.0))), 2.0))
    return {"dy": ops.silu_backward(g, x), "x": ops.mul(ops.mul(g, dy), d2)}


# silu's gradient as one op, as torch's aten.silu_backward: dy s (1 + x (1 - s)), s = sigmoid(x). One kernel
# primitive where the sigmoid form is six ops; silu_backward(0, x) = 0, so it keeps expert rows (rewrites/experts.py)
@op("silu_backward", "pointwise", lambda dy, x: torch.ops.aten.silu_backward(*_as_tensors(dy, x)), arity=2,
    template="{dy} * tl.sigmoid({x}) * (1 + {x} * (1 - tl.sigmoid({x})))", vjp=_vjp_silu_backward)
def silu_backward(dy, x):
    """silu's gradient dy * silu'(x), as torch.ops.aten.silu_backward(dy, x): dy, the gradient of silu(x), has
    x's shape.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, dy = fd.define_tensor((5,), torch.float64, name="x"), fd.define_tensor((5,), torch.float64, name="dy")
    ...     fd.add_output(fd.ops.silu_backward(dy, x), name="dx")
    >>> xv, dyv = torch.linspace(-4, 4, 5, dtype=torch.float64).requires_grad_(), torch.rand(5, dtype=torch.float64)
    >>> F.silu(xv).backward(dyv)
    >>> torch.allclose(ed.evaluate(fd, {"x": xv.detach(), "dy": dyv})["dx"], xv.grad, rtol=1e-14, atol=1e-15)
    True
    """
    dy, x = _need_tensor("silu_backward", "dy", dy), _need_tensor("silu_backward", "x", x)
    _need_float("silu_backward", dy)
    _need_float("silu_backward", x)
    if dy.shape != x.shape:
        raise ShapeError(f"silu_backward({dy.name}, {x.name}): {dy.name} is {list(dy.shape)} and {x.name} is "
                         f"{list(x.shape)}; dy, the gradient of silu(x), has x's shape (expand it first)")
    return [OutSpec(x.shape, _result_dtype("silu_backward", dy, x), x.axes)]


# "{x}": every op's value is converted to its output's compute type; codegen also rounds through a
# 16-bit destination and casts to bool as `!= 0`
@op("cast", "pointwise", lambda x, dtype: x.to(canonical_dtype(dtype)), arity=1, template="{x}",
    vjp=lambda ops, g, out, x, dtype: {"x": ops.cast(g, x.dtype)})
def cast(x, dtype):
    """Convert x to dtype."""
    x = _need_tensor("cast", "x", x)
    try:
        dt = canonical_dtype(dtype)
    except DtypeError as e:
        raise DtypeError(f"cast({x.name}): {e}") from None
    return [OutSpec(x.shape, dt, x.axes)]


# The backward reads a forward value through saved(t) (egraph_did/grad.py): the marker of "kept from the
# forward for the backward", which the memory model of a training step prices (plan.StepMemory) and the
# program rewrite recompute (rewrites/recompute.py) may replace by recomputing t. Its local result is t
# itself: no kernel, no time of its own. SAVE_OP is its name for every module that looks for the marker.
SAVE_OP = "saved"


@op(SAVE_OP, "pointwise", lambda x: x, arity=1, template="{x}", metadata_only=True,
    vjp=lambda ops, g, out, x: {"x": g})
def saved(x):
    """x, as kept from a training step's forward for its backward (an alias of x)."""
    x = _need_tensor(SAVE_OP, "x", x)
    return [OutSpec(x.shape, x.dtype, x.axes)]


def _causal_mask_ref(x, offset=0):
    s_q, s_k = x.shape[-2], x.shape[-1]
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=x.device).tril(offset)
    return x.masked_fill(~keep, float("-inf"))


def _vjp_causal_mask(ops, g, out, x, offset=0):
    """g where the mask keeps x, 0 where it fills: exp of the mask over zeros is 1 or 0, whatever x holds"""
    return {"x": ops.mul(g, ops.exp(ops.causal_mask(zeros_like(ops, x), offset)))}


@op("causal_mask", "mask", _causal_mask_ref, vjp=_vjp_causal_mask)
def causal_mask(x, offset: int = 0):
    """Fill x[..., i, j] with -inf where j > i + offset (the causal attention mask)."""
    x = _need_tensor("causal_mask", "x", x)
    _need_float("causal_mask", x)
    if x.ndim < 2:
        raise ShapeError(f"causal_mask({x.name}): needs at least 2 axes, got shape {x.shape}")
    return [OutSpec(x.shape, x.dtype, x.axes)]


# ------------------------------------------------------------------ reductions

def _reduced(x: TensorSpec, axes: tuple[int, ...], keepdim: bool, dtype=None) -> OutSpec:
    if keepdim:
        shape = tuple(1 if i in axes else e for i, e in enumerate(x.shape))
        names = tuple("1" if i in axes else a for i, a in enumerate(x.axes))
    else:
        shape = tuple(e for i, e in enumerate(x.shape) if i not in axes)
        names = tuple(a for i, a in enumerate(x.axes) if i not in axes)
    return OutSpec(shape, dtype or x.dtype, names)


@op("sum", "reduction", lambda x, dims=None, keepdim=False:
    torch.sum(x, dim=tuple(range(x.ndim)) if dims is None else dims, keepdim=keepdim),
    template="{a} + {b}", identity=0.0,
    vjp=lambda ops, g, out, x, dims=None, keepdim=False: {"x": unreduce(ops, g, x.shape, dims, keepdim)})
def sum_(x, dims=None, keepdim: bool = False):
    """Sum over `dims` (an int, a tuple, or None for all axes)."""
    x = _need_tensor("sum", "x", x)
    dtype = torch.int64 if x.dtype in INT_DTYPES + (torch.bool,) else x.dtype  # torch.sum widens integers
    return [_reduced(x, norm_axes("sum", x, dims), keepdim, dtype)]


def _vjp_amax(ops, g, out, x, dims=None, keepdim=False):
    """torch's rule: the gradient splits evenly between the elements that attain the maximum"""
    hit = _as_float(ops, ops.eq(x, unreduce(ops, out, x.shape, dims, keepdim)), g.dtype)
    share = ops.div(hit, ops.sum(hit, dims, keepdim=True))
    return {"x": ops.mul(unreduce(ops, g, x.shape, dims, keepdim), share)}


@op("amax", "reduction", lambda x, dims=None, keepdim=False:
    torch.amax(x, dim=tuple(range(x.ndim)) if dims is None else dims, keepdim=keepdim),
    template="tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)", identity=-math.inf, vjp=_vjp_amax)
def amax(x, dims=None, keepdim: bool = False):
    """Maximum over `dims`."""
    x = _need_tensor("amax", "x", x)
    return [_reduced(x, norm_axes("amax", x, dims), keepdim)]


# Reductions with no partial placement (no pending product or or): sharded only along the axes they
# keep (rewrites/scans.py); a sharded reduced axis is gathered first. They run through torch (their
# kind's Triton form combines sums and maxima only). amin has no pending min of its own: over floats it
# decomposes to -amax(-x), so a min over a sharded axis is a local max of the negation, a pending max
# (one allreduce(max)), and a negation.

def _dims_arg(x, dims) -> tuple[int, ...]:
    """dims as torch's dim argument: every axis for None."""
    return tuple(range(x.ndim)) if dims is None else dims


def _decompose_amin(ops, x, dims=None, keepdim=False):
    """amin(x) = -amax(-x) for floats: negation is exact, keeps NaN and orders the values backwards.
    Integers and bools decline (None: the op stays as it is): -x overflows at an integer type's least
    value."""
    if x.dtype not in FLOAT_DTYPES:
        return None
    return ops.neg(ops.amax(ops.neg(x), dims, keepdim=keepdim))


@op("amin", "reduction", lambda x, dims=None, keepdim=False: torch.amin(x, dim=_dims_arg(x, dims), keepdim=keepdim),
    _decompose_amin,
    vjp=_vjp_amax)  # the same rule: the gradient splits evenly between the elements that attain the minimum
def amin(x, dims=None, keepdim: bool = False):
    """Minimum over `dims` (an int, a tuple, or None for all axes), as torch.amin (torch.min's values).
    Over floats the optimizer also holds it as -amax(-x), where a sharded reduced axis is a pending max.

    >>> amin(TensorSpec("x", (3, 4), torch.float32, ("s", "h")), -1, keepdim=True)
    [OutSpec(shape=(3, 1), dtype=torch.float32, axes=('s', '1'))]
    """
    x = _need_tensor("amin", "x", x)
    return [_reduced(x, norm_axes("amin", x, dims), keepdim)]


def _prod_ref(x, dims=None, keepdim=False):
    """torch.prod over several axes: torch's takes one, so one axis at a time (the last first, so that
    the axes left keep their positions)."""
    if dims is None:
        out = torch.prod(x)
        return out.reshape((1,) * x.ndim) if keepdim else out
    nd = x.ndim  # each axis against the input's rank: x loses one per step (without keepdim)
    for d in sorted({d % nd for d in ((dims,) if isinstance(dims, int) else dims)}, reverse=True):
        x = torch.prod(x, d, keepdim=keepdim)
    return x


def _vjp_prod(ops, g, out, x, dims=None, keepdim=False):
    """d prod / d x_i = the product of the others: out / x_i where x_i != 0; where x_i is the only zero of
    its slice, the product of the non-zeros; 0 where its slice holds another zero (as torch)"""
    zero = ops.eq(x, 0.0)
    n_zeros = ops.sum(_as_float(ops, zero, x.dtype), dims, keepdim=True)
    others = ops.prod(ops.where(zero, 1.0, x), dims, keepdim=True)
    at_zero = ops.where(ops.eq(n_zeros, 1.0), others, 0.0)
    share = ops.where(zero, at_zero, ops.div(unreduce(ops, out, x.shape, dims, keepdim), x))
    return {"x": ops.mul(unreduce(ops, g, x.shape, dims, keepdim), share)}


@op("prod", "reduction", _prod_ref, vjp=_vjp_prod)
def prod(x, dims=None, keepdim: bool = False):
    """Product over `dims` (an int, a tuple, or None for all axes); integers and bools widen to int64, as
    torch.prod.

    >>> prod(TensorSpec("x", (3, 4), torch.int32, ("s", "h")), (0, 1))
    [OutSpec(shape=(), dtype=torch.int64, axes=())]
    """
    x = _need_tensor("prod", "x", x)
    dtype = torch.int64 if x.dtype in _INTEGRAL else x.dtype
    return [_reduced(x, norm_axes("prod", x, dims), keepdim, dtype)]


def _truth_reduction(name: str, fn: Callable):
    def infer(x, dims=None, keepdim: bool = False):
        x = _need_tensor(name, "x", x)
        return [_reduced(x, norm_axes(name, x, dims), keepdim, torch.bool)]
    infer.__name__ = name
    infer.__doc__ = (f"Whether {'any element' if name == 'any' else 'every element'} over `dims` (an int, a "
                     f"tuple, or None for all axes) is nonzero -> bool, as torch.{name}.")
    op(name, "reduction", lambda x, dims=None, keepdim=False: fn(x, dim=_dims_arg(x, dims), keepdim=keepdim),
       no_grad=_NOT_REAL)(infer)


_truth_reduction("any", torch.any)
_truth_reduction("all", torch.all)


# ------------------------------------------------------------------ scans

def _vjp_cumsum(ops, g, out, x, dim):
    """the reversed cumulative sum of g: sum(g) - cumsum(g) + g along dim"""
    d = dim % max(x.ndim, 1)
    if not x.ndim:
        return {"x": g}
    return {"x": ops.add(ops.sub(ops.sum(g, d, keepdim=True), ops.cumsum(g, d)), g)}


@op("cumsum", "scan", lambda x, dim: torch.cumsum(x, dim), vjp=_vjp_cumsum)
def cumsum(x, dim: int):
    """Cumulative sum along `dim`, as torch.cumsum: integers and bools widen to int64 (positions from a
    mask: cumsum(mask, -1) - 1).

    >>> cumsum(TensorSpec("mask", (2, 5), torch.bool, ("b", "s")), -1)
    [OutSpec(shape=(2, 5), dtype=torch.int64, axes=('b', 's'))]
    """
    x = _need_tensor("cumsum", "x", x)
    norm_axis("cumsum", x, dim, ndim=max(x.ndim, 1))  # a 0-d tensor scans its one element, as torch
    dtype = torch.int64 if x.dtype in _INTEGRAL else x.dtype
    return [OutSpec(x.shape, dtype, x.axes)]


def _count(x, dims) -> int:
    axes = range(len(x.shape)) if dims is None else ((dims,) if isinstance(dims, int) else dims)
    return math.prod(x.shape[d] for d in axes)


def _decompose_mean(ops, x, dims=None, keepdim=False):
    return ops.div(ops.sum(x, dims, keepdim), float(_count(x, dims)))


def _mean_global_count(args, operands, outputs, ctx, axes):
    """mean over a sharded axis as one summand of a partial: the local sum over the global count
    (the ranks' summands add up to the mean; a local mean would weigh uneven shards wrongly)"""
    x, dims = args["x"], args["dims"]
    n = _count(operands["x"], dims)
    dims = range(x.ndim) if dims is None else ((dims,) if isinstance(dims, int) else dims)
    return torch.sum(x, dim=tuple(d % x.ndim for d in dims), keepdim=args["keepdim"]) / n


MEAN_GLOBAL_COUNT = LocalKernel("global_count", _mean_global_count)


@op("mean", "reduction", lambda x, dims=None, keepdim=False:
    torch.mean(x, dim=tuple(range(x.ndim)) if dims is None else dims, keepdim=keepdim), _decompose_mean,
    fuses=True, local_kernels=(MEAN_GLOBAL_COUNT,),
    vjp=lambda ops, g, out, x, dims=None, keepdim=False:
    {"x": ops.div(unreduce(ops, g, x.shape, dims, keepdim), float(_count(x, dims)))})
def mean(x, dims=None, keepdim: bool = False):
    """Mean over `dims`."""
    x = _need_tensor("mean", "x", x)
    _need_float("mean", x)
    return [_reduced(x, norm_axes("mean", x, dims), keepdim)]


def _var_mean_ref(x, dims=None, correction=1, keepdim=False):
    return torch.var_mean(x, dim=tuple(range(x.ndim)) if dims is None else dims, correction=correction,
                          keepdim=keepdim)


def _decompose_var_mean(ops, x, dims=None, correction=1, keepdim=False):
    n = _count(x, dims)
    m = ops.mean(x, dims, keepdim=True)
    centered = ops.sub(x, m)
    var = ops.div(ops.sum(ops.mul(centered, centered), dims, keepdim), float(max(n - correction, 0)))
    if keepdim:
        return var, m
    return var, ops.reshape(m, var.shape)


def _block_bounds(n: int, blocks: int) -> list[tuple[int, int]]:
    """torch.chunk's pieces of n into `blocks`: ceil-sized, the last smaller, trailing ones empty."""
    c = -(-n // blocks) if blocks else 0
    return [(min(g * c, n), min((g + 1) * c, n)) for g in range(blocks)]


def _welford_blocks_ref(x, dim, blocks):
    dim = dim % x.ndim
    stats = []
    for lo, hi in _block_bounds(x.shape[dim], blocks):
        piece = x.narrow(dim, lo, hi - lo)
        n = torch.full_like(x.narrow(dim, 0, 1) if x.shape[dim] else x.sum(dim, keepdim=True), float(hi - lo))
        if hi > lo:
            m = piece.mean(dim, keepdim=True)
            m2 = ((piece - m) ** 2).sum(dim, keepdim=True)
        else:
            m, m2 = torch.zeros_like(n), torch.zeros_like(n)
        stats.append(torch.stack([n, m, m2], dim=-1))
    return torch.cat(stats, dim=dim)


def _local_blocks(args, out_shapes):
    """On a rank, `blocks` is the rank's extent of the blocks axis (one block per rank when it is sharded)."""
    out = out_shapes[0]
    return {"blocks": out[args["dim"] % (len(out) - 1)]}


_RFACTOR_HALF = ("a half of var_mean split by the optimizer's rfactor, which runs after differentiation: a "
                 "fusion differentiates var_mean, whose vjp it has")


@op("welford_blocks", "reduction", _welford_blocks_ref, local_attrs=_local_blocks, no_grad=_RFACTOR_HALF)
def welford_blocks(x, dim: int, blocks: int):
    """Welford statistics (count, mean, M2) of `blocks` torch.chunk pieces of x along dim: x's shape with
    dim of extent `blocks`, plus a trailing axis of 3. The first half of an rfactor'ed var_mean."""
    x = _need_tensor("welford_blocks", "x", x)
    _need_float("welford_blocks", x)
    d = norm_axis("welford_blocks", x, dim)
    if not isinstance(blocks, int) or blocks < 1:
        raise ShapeError(f"welford_blocks({x.name}): blocks must be a positive int, got {blocks!r}")
    return [OutSpec(x.shape[:d] + (blocks,) + x.shape[d + 1:] + (3,), x.dtype,
                    x.axes[:d] + (f"{x.axes[d]}/blk",) + x.axes[d + 1:] + ("stat",))]


def _welford_merge_ref(stats, dim, correction=1, keepdim=False):
    dim = dim % (stats.ndim - 1)
    n, m, m2 = stats[..., 0], stats[..., 1], stats[..., 2]
    total = n.sum(dim, keepdim=True)
    mean = (n * m).sum(dim, keepdim=True) / total
    var = (m2 + n * (m - mean) ** 2).sum(dim, keepdim=True) / (total - correction).clamp_min(0)
    if not keepdim:
        mean, var = mean.squeeze(dim), var.squeeze(dim)
    return var, mean


@op("welford_merge", "reduction", _welford_merge_ref, no_grad=_RFACTOR_HALF)
def welford_merge(stats, dim: int, correction: int = 1, keepdim: bool = False):
    """(variance, mean) from Welford blocks along dim (Chan's parallel merge). The second half of an
    rfactor'ed var_mean."""
    stats = _need_tensor("welford_merge", "stats", stats)
    if stats.ndim < 2 or stats.shape[-1] != 3:
        raise ShapeError(f"welford_merge({stats.name}): expects Welford stats with a trailing axis of 3, got "
                         f"{stats.shape}")
    inner = TensorSpec(stats.name, stats.shape[:-1], stats.dtype, stats.axes[:-1])
    d = norm_axis("welford_merge", inner, dim)
    out = _reduced(inner, (d,), keepdim)
    return [out, out]


def _rfactor_var_mean(ops, blocks, x, dims=None, correction=1, keepdim=False):
    dims = tuple(range(x.ndim)) if dims is None else ((dims,) if isinstance(dims, int) else tuple(dims))
    if len(dims) != 1:
        return None  # the Welford pair splits one reduced axis
    stats = ops.welford_blocks(x, dims[0], blocks)
    return ops.welford_merge(stats, dims[0], correction, keepdim)


def _vjp_var_mean(ops, g, out, x, dims=None, correction=1, keepdim=False):
    """d var = 2 (x - mean) / (n - correction), d mean = 1 / n, each broadcast over the reduced axes"""
    (g_var, g_mean), n = g, _count(x, dims)
    terms = []
    if g_var is not None:
        centered = ops.sub(x, unreduce(ops, out[1], x.shape, dims, keepdim))
        scale = 2.0 / (n - correction) if n > correction else math.inf  # as torch: var of too few is inf/nan
        terms.append(ops.mul(unreduce(ops, g_var, x.shape, dims, keepdim), ops.mul(centered, scale)))
    if g_mean is not None:
        terms.append(ops.div(unreduce(ops, g_mean, x.shape, dims, keepdim), float(n)))
    return {"x": terms[0] if len(terms) == 1 else ops.add(*terms)}


@op("var_mean", "reduction", _var_mean_ref, _decompose_var_mean, rfactor=_rfactor_var_mean, vjp=_vjp_var_mean)
def var_mean(x, dims=None, correction: int = 1, keepdim: bool = False):
    """(variance, mean) over `dims`, as torch.var_mean; correction=1 is Bessel's."""
    x = _need_tensor("var_mean", "x", x)
    _need_float("var_mean", x)
    out = _reduced(x, norm_axes("var_mean", x, dims), keepdim)
    return [out, out]


def _decompose_softmax(ops, x, dim=-1):
    shifted = ops.sub(x, ops.amax(x, dim, keepdim=True))
    e = ops.exp(shifted)
    return ops.div(e, ops.sum(e, dim, keepdim=True))


def _vjp_softmax(ops, g, out, x, dim=-1):
    """y (g - sum(g y)) along dim"""
    return {"x": ops.mul(out, ops.sub(g, ops.sum(ops.mul(g, out), dim, keepdim=True)))}


@op("softmax", "normalization", lambda x, dim=-1: torch.softmax(x, dim), _decompose_softmax, fuses=True,
    vjp=_vjp_softmax)
def softmax(x, dim: int = -1):
    """Softmax along `dim`."""
    x = _need_tensor("softmax", "x", x)
    _need_float("softmax", x)
    norm_axis("softmax", x, dim)
    return [OutSpec(x.shape, x.dtype, x.axes)]


def _norm_shape(op_name, x: TensorSpec, normalized_shape, weight, bias) -> tuple[int, ...]:
    given = normalized_shape is not None
    if not given:
        normalized_shape = weight.shape if _is_tensor(weight) else (x.shape[-1],)
    elif not isinstance(normalized_shape, int) and not (
            isinstance(normalized_shape, (tuple, list)) and all(isinstance(e, int) for e in normalized_shape)):
        raise ShapeError(f"{op_name}({x.name}): normalized_shape must be an int or a tuple of ints (the trailing "
                         f"extents of {x.name} to normalize over), got {normalized_shape!r}")
    normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(normalized_shape)
    if k == 0 or k > x.ndim or tuple(x.shape[x.ndim - k:]) != normalized_shape:
        if not given:  # the user passed a weight, not normalized_shape: blame the weight
            w = weight
            raise ShapeError(f"{op_name}({x.name}): weight {w.name} has shape {w.shape}, which must match the "
                             f"trailing axes of {x.name} {x.shape} it normalizes over; pass a weight of shape "
                             f"{x.shape[max(x.ndim - w.ndim, 0):]} (normalized_shape, not given, is taken from "
                             f"the weight)")
        raise ShapeError(f"{op_name}({x.name}): normalized_shape {normalized_shape} must match the trailing "
                         f"axes of {x.name}, whose shape is {x.shape}; pass normalized_shape={x.shape[-1:]} to "
                         f"normalize over the last axis")
    for arg, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        p = _need_tensor(op_name, arg, p)
        if p.shape != normalized_shape:
            raise ShapeError(f"{op_name}({x.name}): {arg} {p.name} has shape {p.shape} but normalizes "
                             f"{x.name}'s trailing axes {normalized_shape}; pass a {arg} of shape {normalized_shape}")
    return normalized_shape


def _layer_norm_ref(x, normalized_shape=None, weight=None, bias=None, eps=1e-5):
    shape = normalized_shape or (weight.shape if weight is not None else x.shape[-1:])
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return F.layer_norm(x, shape, weight, bias, eps)


def _decompose_layer_norm(ops, x, normalized_shape=None, weight=None, bias=None, eps=1e-5):
    k = len(weight.shape) if normalized_shape is None and weight is not None else (
        1 if normalized_shape is None else (1 if isinstance(normalized_shape, int) else len(normalized_shape)))
    dims = tuple(range(x.ndim - k, x.ndim))
    var, m = ops.var_mean(x, dims, correction=0, keepdim=True)
    y = ops.mul(ops.sub(x, m), ops.rsqrt(ops.add(var, eps)))
    if weight is not None:
        y = ops.mul(y, weight)
    if bias is not None:
        y = ops.add(y, bias)
    return y


def _norm_axes(x, normalized_shape, weight) -> tuple[int, ...]:
    """The trailing axes a layer or rms norm normalizes over (normalized_shape, or weight's, or the last)."""
    k = len(weight.shape) if normalized_shape is None and weight is not None else (
        1 if normalized_shape is None else (1 if isinstance(normalized_shape, int) else len(normalized_shape)))
    return tuple(range(x.ndim - k, x.ndim))


def _affine_grads(ops, g, xhat, weight, bias) -> dict:
    """The gradients of a norm's weight and bias: g xhat and g, summed over the leading axes."""
    grads = {}
    if weight is not None:
        grads["weight"] = sum_to(ops, ops.mul(g, xhat), weight.shape)
    if bias is not None:
        grads["bias"] = sum_to(ops, g, bias.shape)
    return grads


def _vjp_layer_norm(ops, g, out, x, normalized_shape=None, weight=None, bias=None, eps=1e-5):
    """x: rstd (gh - mean(gh) - xhat mean(gh xhat)), gh = g weight; the statistics are recomputed"""
    dims = _norm_axes(x, normalized_shape, weight)
    var, m = ops.var_mean(x, dims, correction=0, keepdim=True)
    rstd = ops.rsqrt(ops.add(var, eps))
    xhat = ops.mul(ops.sub(x, m), rstd)
    grads = _affine_grads(ops, g, xhat, weight, bias)
    gh = ops.mul(g, weight) if weight is not None else g
    centered = ops.sub(gh, ops.mean(gh, dims, keepdim=True))
    grads["x"] = ops.mul(ops.sub(centered, ops.mul(xhat, ops.mean(ops.mul(gh, xhat), dims, keepdim=True))), rstd)
    return grads


@op("layer_norm", "normalization", _layer_norm_ref, _decompose_layer_norm, fuses=True, vjp=_vjp_layer_norm)
def layer_norm(x, normalized_shape=None, weight=None, bias=None, eps: float = 1e-5):
    """Layer norm over the trailing axes (normalized_shape, or weight's shape, or the last axis)."""
    x = _need_tensor("layer_norm", "x", x)
    _need_float("layer_norm", x)
    _norm_shape("layer_norm", x, normalized_shape, weight, bias)
    return [OutSpec(x.shape, x.dtype, x.axes)]


def _rms_norm_ref(x, normalized_shape=None, weight=None, eps=1e-6):
    shape = normalized_shape or (weight.shape if weight is not None else x.shape[-1:])
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return F.rms_norm(x, shape, weight, eps)


def _decompose_rms_norm(ops, x, normalized_shape=None, weight=None, eps=1e-6):
    k = len(weight.shape) if normalized_shape is None and weight is not None else (
        1 if normalized_shape is None else (1 if isinstance(normalized_shape, int) else len(normalized_shape)))
    dims = tuple(range(x.ndim - k, x.ndim))
    y = ops.mul(x, ops.rsqrt(ops.add(ops.mean(ops.mul(x, x), dims, keepdim=True), eps)))
    return ops.mul(y, weight) if weight is not None else y


def _vjp_rms_norm(ops, g, out, x, normalized_shape=None, weight=None, eps=1e-6):
    """x: r (gh - xhat mean(gh xhat)), r = rsqrt(mean(x^2) + eps), xhat = x r, gh = g weight"""
    dims = _norm_axes(x, normalized_shape, weight)
    r = ops.rsqrt(ops.add(ops.mean(ops.mul(x, x), dims, keepdim=True), eps))
    xhat = ops.mul(x, r)
    grads = _affine_grads(ops, g, xhat, weight, None)
    gh = ops.mul(g, weight) if weight is not None else g
    grads["x"] = ops.mul(ops.sub(gh, ops.mul(xhat, ops.mean(ops.mul(gh, xhat), dims, keepdim=True))), r)
    return grads


@op("rms_norm", "normalization", _rms_norm_ref, _decompose_rms_norm, fuses=True, vjp=_vjp_rms_norm)
def rms_norm(x, normalized_shape=None, weight=None, eps: float = 1e-6):
    """RMS norm over the trailing axes, as torch.nn.functional.rms_norm (eps given explicitly)."""
    x = _need_tensor("rms_norm", "x", x)
    _need_float("rms_norm", x)
    _norm_shape("rms_norm", x, normalized_shape, weight, None)
    return [OutSpec(x.shape, x.dtype, x.axes)]


# ------------------------------------------------------------------ aten: linear, matmul, sdpa, embedding

def _same_float(op_name, *vals):
    for v in vals:
        if v is not None:
            _need_float(op_name, v)
    dts = {v.dtype for v in vals if v is not None}
    if len(dts) > 1:
        raise DtypeError(f"{op_name}({', '.join(v.name for v in vals if v is not None)}): operands have "
                         f"dtypes {sorted(str(d).replace('torch.', '') for d in dts)}; cast them to one dtype")


def _matmul_flops(ins, outs, args) -> float:
    """2 m n k: a multiply and an add per term of each output's dot product."""
    return 2.0 * math.prod(outs[0]) * ins[0][-1]


def _linear_bias_once(args, operands, outputs, ctx, axes):
    """linear whose output is one summand of a partial: the bias is added on the first rank of the mesh
    axes only, so that the sum over ranks adds it once"""
    bias = args.get("bias") if ctx.on_first(axes) else None
    return F.linear(args["x"], args["weight"], bias)


LINEAR_BIAS_ONCE = LocalKernel("bias_once", _linear_bias_once)


def _vjp_linear(ops, g, out, x, weight, bias=None):
    """x: g weight; weight: g^T x over every leading axis (flattened to rows); bias: g summed"""
    def rows(t):
        return ops.reshape(t, (-1, t.shape[-1]))
    grads = {"x": ops.linear(g, ops.transpose(weight, 0, 1)),
             "weight": ops.matmul(ops.transpose(rows(g), 0, 1), rows(x))}
    if bias is not None:
        grads["bias"] = sum_to(ops, g, bias.shape)
    return grads


# collective matmuls (rewrites/collective_matmul.py): a ring step's kernel communicates (collectives.RINGS)
LINEAR_RINGS = (LocalKernel("ag_ring", ring_kernel("linear", "allgather_matmul")),
                LocalKernel("rs_ring", ring_kernel("linear", "matmul_reduce_scatter")))
MATMUL_RINGS = (LocalKernel("ag_ring", ring_kernel("matmul", "allgather_matmul")),
                LocalKernel("rs_ring", ring_kernel("matmul", "matmul_reduce_scatter")))


@op("linear", "matmul", lambda x, weight, bias=None: F.linear(x, weight, bias), flops=_matmul_flops,
    local_kernels=(LINEAR_BIAS_ONCE, *LINEAR_RINGS), vjp=_vjp_linear)
def linear(x, weight, bias=None):
    """x @ weight.T + bias; weight is [out, in] as in torch."""
    x, weight = _need_tensor("linear", "x", x), _need_tensor("linear", "weight", weight)
    what = f"linear({x.name}, {weight.name})"
    if x.ndim < 1:
        raise ShapeError(f"{what}: {x.name} is 0-D; linear needs at least one axis")
    if weight.ndim != 2:
        raise ShapeError(f"{what}: {weight.name} must be 2-D [out, in] as in torch, got shape {weight.shape}")
    if weight.shape[1] != x.shape[-1]:
        raise ShapeError(f"{what}: {weight.name} has in-features {weight.shape[1]} but {x.name}'s last axis "
                         f"is {x.shape[-1]} ({weight.name} is [out, in], as in torch)")
    if bias is not None:
        bias = _need_tensor("linear", "bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ShapeError(f"{what}: bias {bias.name} has shape {bias.shape}, expected ({weight.shape[0]},) "
                             f"= {weight.name}'s out-features")
    _same_float("linear", x, weight, bias)
    return [OutSpec(x.shape[:-1] + (weight.shape[0],), x.dtype, x.axes[:-1] + (weight.axes[0],))]


@op("matmul", "matmul", lambda a, b: torch.matmul(a, b), flops=_matmul_flops, local_kernels=MATMUL_RINGS,
    vjp=lambda ops, g, out, a, b: {"a": sum_to(ops, ops.matmul(g, ops.transpose(b, -2, -1)), a.shape),
                                   "b": sum_to(ops, ops.matmul(ops.transpose(a, -2, -1), g), b.shape)})
def matmul(a, b):
    """torch.matmul: batched, with broadcasting of the batch axes (both operands at least 2-D)."""
    a, b = _need_tensor("matmul", "a", a), _need_tensor("matmul", "b", b)
    what = f"matmul({a.name}, {b.name})"
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError(f"{what}: both operands need at least 2 axes, got {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"{what}: {a.name}'s last axis is {a.shape[-1]} but {b.name}'s axis -2 is "
                         f"{b.shape[-2]}; they contract and must be equal")
    _same_float("matmul", a, b)
    ba = TensorSpec(a.name, a.shape[:-2], a.dtype, a.axes[:-2])
    bb = TensorSpec(b.name, b.shape[:-2], b.dtype, b.axes[:-2])
    batch, names = broadcast_specs("matmul", ba, bb) if (ba.ndim or bb.ndim) else ((), ())
    return [OutSpec(batch + (a.shape[-2], b.shape[-1]), a.dtype, names + (a.axes[-2], b.axes[-1]))]


def attention(q, k, v, **kwargs):
    """F.scaled_dot_product_attention; on the CPU through its math backend, whatever the shapes: torch picks
    a CPU backend by shape, and they disagree on a row with no finite score (the fused one gives 0, the math
    one nan), so a rank's slice of v (sdpa_value_dim) would differ from the whole tensor's. The math
    backend is the decomposition's (softmax of the scaled scores, times v); on a GPU torch's choice stands.

    >>> q = torch.tensor([1.0, -math.inf, -math.inf], dtype=torch.float64).view(1, 1, 1, 3)
    >>> k = torch.tensor([[1.0, -1, 1], [1, 1, -1], [-1, 1, 1]], dtype=torch.float64).view(1, 1, 3, 3)
    >>> v = torch.ones(1, 1, 3, 3, dtype=torch.float64)  # every score is nan: torch's fused CPU kernel gives 0
    >>> F.scaled_dot_product_attention(q, k, v).flatten().tolist(), attention(q, k, v).isnan().all().item()
    ([0.0, 0.0, 0.0], True)
    >>> attention(q, k, v[..., :2]).isnan().all().item()  # as the rank holding two columns of v computes
    True
    """
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _sdpa_ref(q, k, v, is_causal=False, scale=None):
    return attention(q, k, v, is_causal=is_causal, scale=scale)


def _decompose_sdpa(ops, q, k, v, is_causal=False, scale=None):
    d = q.shape[-1]
    s = ops.mul(ops.matmul(q, ops.transpose(k, -2, -1)), scale if scale is not None else 1.0 / math.sqrt(d))
    if is_causal:
        s = ops.causal_mask(s)
    return ops.matmul(ops.softmax(s, -1), v)


def _causal_pairs(sq: int, sk: int) -> float:
    """Query-key pairs a causal mask leaves of an sq x sk block of the busiest rank: sq sk - min(sq, sk)^2 / 2.
    A whole square is half of it; a shard of the queries (or of the keys) beside all the keys (queries) is
    priced at the last (first) shard, which meets nearly all of them: the ranks wait for it, so the others'
    lighter shares do not make the step shorter (the even share sq sk / 2 priced 8 ranks' query split at
    half of what its last rank does, so ring attention, priced at its busiest rank, looked dearer).

    >>> _causal_pairs(8, 8), _causal_pairs(2, 8), _causal_pairs(8, 2)
    (32.0, 14.0, 14.0)
    """
    return sq * sk - min(sq, sk) ** 2 / 2


def _sdpa_flops(ins, outs, args) -> float:
    """q k^T and p v (the pairs a causal mask leaves: _causal_pairs), and the softmax's few operations per score."""
    b, h, sq, d = ins[0]
    sk = ins[1][2]
    pairs = _causal_pairs(sq, sk) if args.get("is_causal") else sq * sk
    return 4.0 * b * h * pairs * d + 4.0 * b * h * sq * sk


def _sdpa_query_offset(args, operands, outputs, ctx, axes):
    """causal attention for the rank's shard of the queries: query i of the shard is global row
    start + i, so it attends to keys 0..start + i"""
    lo, _ = ctx.shard_range(operands["q"].shape[2], operands["q"].layout, 2)
    q, k = args["q"], args["k"]
    rows = torch.arange(q.shape[2], device=q.device).unsqueeze(1) + lo
    keep = torch.arange(k.shape[2], device=q.device).unsqueeze(0) <= rows
    return attention(q, k, args["v"], attn_mask=keep, scale=args.get("scale"))


SDPA_QUERY_OFFSET = LocalKernel("q_offset", _sdpa_query_offset)


def ring_attention_block(q, k, v, diagonal: bool, scale=None):
    """One step of ring attention (collectives.ring_attention_run): (out, lse) of the query block against
    the key block the rank holds, by sdpa_lse's reference (torch's fused kernels on a GPU). diagonal: the
    key block at the queries' own positions (equal blocks of a causal sequence), masked causally; the
    blocks before it are attended whole, those after it skipped by the ring."""
    return _sdpa_lse_ref(q, k, v, is_causal=diagonal, scale=scale)


# ring attention (rewrites/ring_attention.py): q split on the sequence, k and v passed round the ring
SDPA_RING = LocalKernel("kv_ring", ring_attention_kernel(ring_attention_block, with_lse=False))
SDPA_LSE_RING = LocalKernel("kv_ring", ring_attention_kernel(ring_attention_block, with_lse=True))


def _vjp_sdpa(ops, g, out, q, k, v, is_causal=False, scale=None):
    """sdpa_backward from the logsumexp of a second forward (sdpa_lse); a gradient runs sdpa as sdpa_lse
    instead (differentiated_as), which computes it once"""
    lse = ops.sdpa_lse(q, k, v, is_causal=is_causal, scale=scale)[1]
    return _vjp_sdpa_lse(ops, (g, None), (out, lse), q, k, v, is_causal, scale)


def _rfactor_attention(ops, blocks, q, k, v, is_causal=False, scale=None, with_lse=True):
    """Attention as a reduction over the keys, split in `blocks` pieces of the key sequence (the online
    softmax merge, exact): each block's attention o_r and logsumexp l_r (attention_blocks), m = max_r l_r,
    w_r = exp(l_r - m), out = sum_r w_r o_r / sum_r w_r, lse = m + log(sum_r w_r). With the keys split
    over the ranks, one block each, the max is a pending max and both sums pending sums: only [b, h, sq]
    statistics and the output's summands move, never k and v."""
    o_b, l_b = ops.attention_blocks(q, k, v, blocks, is_causal=is_causal, scale=scale)
    m = ops.amax(l_b, 2)
    w = ops.exp(ops.sub(l_b, ops.unsqueeze(m, 2)))
    den = ops.sum(w, 2)
    # cast back from the logsumexp's dtype even where it is q's (a copy, fused into the division's kernel):
    # one program for every dtype, so that a plan replays on another (optimize(like=) matches tensor names)
    out = ops.cast(ops.div(ops.sum(ops.mul(o_b, ops.unsqueeze(w, -1)), 2), ops.unsqueeze(den, -1)), q.dtype)
    return (out, ops.add(m, ops.log(den))) if with_lse else out


def _rfactor_sdpa(ops, blocks, q, k, v, is_causal=False, scale=None):
    return _rfactor_attention(ops, blocks, q, k, v, is_causal, scale, with_lse=False)


@op("sdpa", "attention", _sdpa_ref, _decompose_sdpa, flops=_sdpa_flops, local_kernels=(SDPA_QUERY_OFFSET, SDPA_RING),
    rfactor=_rfactor_sdpa, vjp=_vjp_sdpa, differentiated_as="sdpa_lse")
def sdpa(q, k, v, is_causal: bool = False, scale: float | None = None):
    """Scaled dot-product attention on [batch, heads, seq, head_dim] operands (torch's sdpa)."""
    q, k, v = (_need_tensor("sdpa", n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    what = f"sdpa({q.name}, {k.name}, {v.name})"
    for t in (q, k, v):
        if t.ndim != 4:
            raise ShapeError(f"{what}: {t.name} must be 4-D [batch, heads, seq, head_dim], got {t.shape}")
    for i, axis in ((0, "batch"), (1, "heads")):
        if not q.shape[i] == k.shape[i] == v.shape[i]:
            raise ShapeError(f"{what}: axis {i} ({axis}) differs: {q.shape[i]}, {k.shape[i]}, {v.shape[i]}")
    if q.shape[3] != k.shape[3]:
        raise ShapeError(f"{what}: head_dim of {q.name} ({q.shape[3]}) and {k.name} ({k.shape[3]}) differ")
    if k.shape[2] != v.shape[2]:
        raise ShapeError(f"{what}: seq of {k.name} ({k.shape[2]}) and {v.name} ({v.shape[2]}) differ")
    if is_causal and q.shape[2] != k.shape[2]:
        raise ShapeError(f"{what}: is_causal needs equal query and key lengths, got {q.shape[2]} and {k.shape[2]}")
    _same_float("sdpa", q, k, v)
    return [OutSpec(q.shape[:3] + (v.shape[3],), q.dtype, q.axes[:3] + (v.axes[3],))]


# Flash attention as ops: sdpa_lse gives the output and the logsumexp of each query's scores, which is all
# the backward needs of the forward; sdpa_backward recomputes the probabilities block by block from it (in
# torch's fused kernels on a GPU), so no [seq, seq] tensor is ever a value of the program.

def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The logsumexp's dtype: float32 for 16-bit operands (as torch's fused kernels keep it), else theirs.

    >>> lse_dtype(torch.bfloat16), lse_dtype(torch.float64)
    (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _attention_scores(q, k, is_causal, scale, offset=0, key_offset=0):
    """The scaled scores q k^T in the logsumexp's dtype, -inf above the causal diagonal (offset and
    key_offset: the global positions of the first query row and of the first key)."""
    dt = lse_dtype(q.dtype)
    s = torch.matmul(q.to(dt), k.to(dt).transpose(-2, -1)) * _attention_scale(q, scale)
    if is_causal:
        rows = torch.arange(q.shape[2], device=q.device).unsqueeze(1) + offset
        keys = torch.arange(k.shape[2], device=q.device).unsqueeze(0) + key_offset
        s = s.masked_fill(keys > rows, -math.inf)
    return s


def _attention_scale(q, scale) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _cudnn_attention(q, k) -> bool:
    """Whether to call cuDNN's fused attention: on Hopper and newer, where F.scaled_dot_product_attention
    (and so torch.compile's graph) runs it for a training step (measured on an H200 at GPT-3's per-rank
    shape: forward 50 vs flash's 105 us, backward 133 vs 236 us), with as many keys as queries (a causal
    block of another shape keeps flash, whose top-left mask the block tests check)."""
    return (torch.backends.cuda.cudnn_sdp_enabled() and torch.cuda.get_device_capability(q.device)[0] >= 9
            and q.shape[2] == k.shape[2])


def _fused_forward(q, k, v, is_causal, scale):
    """(out, lse) from torch's cuDNN (16-bit, v's head_dim q's, as many keys as queries, Hopper and newer),
    flash (16-bit, v's head_dim q's) or memory-efficient (float32, or another head_dim of v) kernel on a GPU;
    None where none takes the operands (float64, the CPU, a head_dim it refuses). sdpa_backward picks the
    same kernel's backward."""
    aten = torch.ops.aten
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    try:
        if q.dtype != torch.float32 and q.shape[-1] == v.shape[-1]:
            if _cudnn_attention(q, k):
                out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False,
                                                                    scale=scale)[:2]
                return out, lse.reshape(q.shape[:3])  # cuDNN's softmax statistics are [b, h, s, 1]
            out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
        else:
            out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal,
                                                                    scale=scale)[:2]
        return out, lse[..., :q.shape[2]].contiguous()  # the efficient kernel pads rows to 32
    except RuntimeError:
        return None


def _sdpa_lse_ref(q, k, v, is_causal=False, scale=None):
    fused = _fused_forward(q, k, v, is_causal, scale)
    if fused is not None:
        return fused
    return attention(q, k, v, is_causal=is_causal, scale=scale), torch.logsumexp(_attention_scores(q, k, is_causal, scale), -1)


def _sdpa_lse_query_offset(args, operands, outputs, ctx, axes):
    """causal attention and its logsumexp for the rank's shard of the queries: query i of the shard is
    global row start + i, so it attends to keys 0..start + i"""
    lo, _ = ctx.shard_range(operands["q"].shape[2], operands["q"].layout, 2)
    q, k, v, scale = args["q"], args["k"], args["v"], args.get("scale")
    s = _attention_scores(q, k, True, scale, lo)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)).to(v.dtype), v), lse


SDPA_LSE_QUERY_OFFSET = LocalKernel("q_offset", _sdpa_lse_query_offset)


def _vjp_sdpa_lse(ops, g, out, q, k, v, is_causal=False, scale=None):
    """sdpa_backward(g, q, k, v, out, lse). A gradient of the logsumexp too adds p_ij g_lse_i to each
    score's: dp - delta + g_lse, which is the backward of v and g with a column of ones and of g_lse
    appended (out with a column of zeros, so delta is unchanged); dv drops the extra column."""
    (g_out, g_lse), (o, lse) = g, out
    if g_out is None:
        g_out = zeros_like(ops, o)
    dv = v.shape[-1]
    if g_lse is not None:
        col = q.shape[:3] + (1,)
        g_out = ops.cat(g_out, ops.cast(ops.reshape(g_lse, col), g_out.dtype), 3)
        v = ops.cat(v, ops.full(tuple(v.shape[:3]) + (1,), 1.0, v.dtype), 3)
        o = ops.cat(o, ops.full(col, 0.0, o.dtype), 3)
    dq, dk, dvv = ops.sdpa_backward(g_out, q, k, v, o, lse, is_causal=is_causal, scale=scale)
    return {"q": dq, "k": dk, "v": dvv if g_lse is None else ops.slice(dvv, 3, 0, dv)}


def _sdpa_lse_flops(ins, outs, args) -> float:
    return _sdpa_flops(ins, outs, args) + float(math.prod(outs[1]))


@op("sdpa_lse", "attention", _sdpa_lse_ref, flops=_sdpa_lse_flops, local_kernels=(SDPA_LSE_QUERY_OFFSET, SDPA_LSE_RING),
    rfactor=_rfactor_attention, vjp=_vjp_sdpa_lse)
def sdpa_lse(q, k, v, is_causal: bool = False, scale: float | None = None):
    """sdpa that also gives the logsumexp of each query's scaled scores, [batch, heads, seq_q] (float32 for
    16-bit operands): (out, lse), torch's flash attention forward. A gradient of sdpa runs it, so that the
    backward (sdpa_backward) reads lse and never the [seq, seq] probabilities.

    >>> q = TensorSpec("q", (2, 4, 16, 8), torch.bfloat16, ("b", "h", "s", "d"))
    >>> [(o.shape, o.dtype) for o in sdpa_lse(q, q, q, is_causal=True)]
    [((2, 4, 16, 8), torch.bfloat16), ((2, 4, 16), torch.float32)]
    """
    (out,) = sdpa(q, k, v, is_causal, scale)
    return [out, OutSpec(q.shape[:3], lse_dtype(q.dtype), q.axes[:3])]


def _fused_backward(g, q, k, v, out, lse, is_causal, scale):
    """(dq, dk, dv) from torch's flash (16-bit) or memory-efficient (float32) backward on a GPU; None
    where neither takes the operands."""
    aten = torch.ops.aten
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or lse.dtype != torch.float32:
        return None
    sq, sk = q.shape[2], k.shape[2]
    try:
        if q.dtype != torch.float32 and q.shape[-1] == v.shape[-1]:
            if _cudnn_attention(q, k):
                seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: its seed and offset unread
                return tuple(aten._scaled_dot_product_cudnn_attention_backward(  # cum_seq None: not a ragged batch
                    g, q, k, v, out, lse.reshape(lse.shape + (1,)), seed, seed, None, None, None, sq, sk, 0.0,
                    is_causal, scale=scale))
            return tuple(aten._scaled_dot_product_flash_attention_backward(
                g, q, k, v, out, lse, None, None, sq, sk, 0.0, is_causal, None, None, scale=scale))
        padded = F.pad(lse, (0, -sq % 32)).contiguous()  # the efficient kernel reads rows in blocks of 32
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], is_causal, scale=scale)
        return dq, dk, dv
    except RuntimeError:
        return None


def _sdpa_backward_math(g, q, k, v, out, lse, is_causal=False, scale=None, offset=0, key_offset=0):
    """The backward from the logsumexp, in its dtype: p = exp(s - lse) (0 where masked); dv = p^T g;
    ds = p (g v^T - rowsum(g out)) c; dq = ds k; dk = ds^T q."""
    dt = lse.dtype
    p = torch.exp(_attention_scores(q, k, is_causal, scale, offset, key_offset) - lse.unsqueeze(-1))
    g_, q_, k_, v_, o_ = (t.to(dt) for t in (g, q, k, v, out))
    ds = p * (torch.matmul(g_, v_.transpose(-2, -1)) - (g_ * o_).sum(-1, keepdim=True)) * _attention_scale(q, scale)
    return (torch.matmul(ds, k_).to(q.dtype), torch.matmul(ds.transpose(-2, -1), q_).to(k.dtype),
            torch.matmul(p.transpose(-2, -1), g_).to(v.dtype))


def _sdpa_backward_ref(g, q, k, v, output, lse, is_causal=False, scale=None):
    fused = _fused_backward(g, q, k, v, output, lse, is_causal, scale)
    return fused if fused is not None else _sdpa_backward_math(g, q, k, v, output, lse, is_causal, scale)


def _causal_offsets(operands, ctx) -> tuple[int, int]:
    """The global positions of the rank's first query row and first key (0 where q or k is whole on the
    sequence axis): where its causal diagonal lies."""
    q, k = operands["q"], operands["k"]
    return ctx.shard_range(q.shape[2], q.layout, 2)[0], ctx.shard_range(k.shape[2], k.layout, 2)[0]


def _causal_pieces(sq: int, n: int, is_causal: bool, offset: int, key_offset: int) -> list:
    """How attention of sq query rows (global positions offset..) to n keys (key_offset..) splits into
    calls of torch's fused kernels, which mask only a square causal diagonal: (first row, end row, [(first
    key, end key, causal)]). Global row offset + i sees key key_offset + j where j <= r_i = offset + i -
    key_offset: rows with r_i < 0 see nothing (no piece), rows with r_i >= n - 1 every key, and the rows
    between (r_i = r0, r0 + 1, ..) see keys [0, r0) whole and keys [r0, r0 + rows) as a square causal mask.

    >>> _causal_pieces(4, 6, True, 0, 0)  # the diagonal: 4 rows see keys 0..i
    [(0, 4, [(0, 4, True)])]
    >>> _causal_pieces(4, 2, True, 4, 2)  # rows 4..7 against keys 2..3: rows 4..7 see both
    [(0, 4, [(0, 2, False)])]
    >>> _causal_pieces(3, 4, True, 5, 4)  # rows 5..7, keys 4..7: rows 5, 6 see key 4 and a diagonal; 7 all
    [(0, 2, [(0, 1, False), (1, 3, True)]), (2, 3, [(0, 4, False)])]
    """
    if not is_causal:
        return [(0, sq, [(0, n, False)])]
    first = min(max(key_offset - offset, 0), sq)  # rows before it see nothing
    whole = min(max(n - 1 - offset + key_offset, first), sq)  # rows from it see the whole block
    r0, m = offset + first - key_offset, whole - first
    spans = [(first, whole, ([(0, r0, False)] if r0 else []) + [(r0, r0 + m, True)]), (whole, sq, [(0, n, False)])]
    return [span for span in spans if span[1] > span[0]]


def _fused_backward_pieces(g, q, k, v, out, lse, is_causal, scale, offset, key_offset, backward=None):
    """(dq, dk, dv) from torch's fused backward on the pieces of _causal_pieces (no [sq, n] tensor), each
    piece's with the rows' whole output and logsumexp, so exact for its keys: dq summed over a row's pieces,
    dk and dv over a key's; None where the kernels refuse (`backward`: _fused_backward's signature)."""
    if backward is None and not q.is_cuda:
        return None
    backward = backward or _fused_backward
    acc = lse.dtype
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    for lo, hi, pieces in _causal_pieces(q.shape[2], k.shape[2], is_causal, offset, key_offset):
        for a, b, causal in pieces:
            got = backward(g[:, :, lo:hi], q[:, :, lo:hi], k[:, :, a:b], v[:, :, a:b], out[:, :, lo:hi],
                           lse[:, :, lo:hi].contiguous(), causal, scale)
            if got is None:
                return None
            dq[:, :, lo:hi] += got[0].to(acc)
            dk[:, :, a:b] += got[1].to(acc)
            dv[:, :, a:b] += got[2].to(acc)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _sdpa_backward_causal_offsets(args, operands, outputs, ctx, axes):
    """the causal backward for the rank's shard of the queries (global rows start..) and of the keys and
    values (global keys kstart..): dq of those rows (a summand of it, where the keys are sharded), and
    their summands of dk and dv (those keys' own, where the keys are sharded); on a GPU in torch's fused
    backward, piece by piece"""
    lo, k_lo = _causal_offsets(operands, ctx)
    a = args
    operands_ = (a["g"], a["q"], a["k"], a["v"], a["output"], a["lse"], True, a.get("scale"), lo, k_lo)
    return _fused_backward_pieces(*operands_) or _sdpa_backward_math(*operands_)


SDPA_BACKWARD_CAUSAL_OFFSETS = LocalKernel("causal_offsets", _sdpa_backward_causal_offsets)


def ring_attention_backward_block(g, q, k, v, out, lse, diagonal: bool, scale=None):
    """One step of ring attention's backward (collectives.ring_attention_backward_run): (dq, dk, dv) of the
    query block against the key block the rank holds, exact from the rows' whole output and logsumexp, by
    sdpa_backward's reference (torch's fused backward on a GPU); diagonal: the block at the queries' own
    positions, masked causally."""
    return _sdpa_backward_ref(g, q, k, v, out, lse, is_causal=diagonal, scale=scale)


# ring attention's backward (rewrites/ring_attention.py): k and v travel with their dk, dv accumulators
SDPA_BACKWARD_RING = LocalKernel("dkv_ring", ring_attention_backward_kernel(ring_attention_backward_block))


def _sdpa_backward_flops(ins, outs, args) -> float:
    """the scores again, then dv, dp, dq and dk: five GEMMs of the forward's size (the pairs a causal mask
    leaves: _causal_pairs)"""
    b, h, sq, d = ins[1]
    sk = ins[2][2]
    pairs = _causal_pairs(sq, sk) if args.get("is_causal") else sq * sk
    return 10.0 * b * h * pairs * d + 6.0 * b * h * sq * sk


@op("sdpa_backward", "attention", _sdpa_backward_ref, flops=_sdpa_backward_flops,
    local_kernels=(SDPA_BACKWARD_CAUSAL_OFFSETS, SDPA_BACKWARD_RING),
    no_grad="the backward of attention: a gradient of a gradient (double backward) is not supported")
def sdpa_backward(g, q, k, v, output, lse, is_causal: bool = False, scale: float | None = None):
    """The gradients (dq, dk, dv) of sdpa from the output's gradient g, the operands, sdpa's output and the
    logsumexp sdpa_lse gave: torch's fused flash / memory-efficient attention backward on a GPU (the math
    on the CPU), recomputing the probabilities from lse.

    >>> q = TensorSpec("q", (2, 4, 16, 8), torch.float32, ("b", "h", "s", "d"))
    >>> lse = TensorSpec("lse", (2, 4, 16), torch.float32, ("b", "h", "s"))
    >>> [o.shape for o in sdpa_backward(q, q, q, q, q, lse)]
    [(2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8)]
    """
    g, out, lse = (_need_tensor("sdpa_backward", n, t) for n, t in (("g", g), ("output", output), ("lse", lse)))
    (o,) = sdpa(q, k, v, is_causal, scale)
    what = f"sdpa_backward({g.name}, {q.name}, {k.name}, {v.name}, {out.name}, {lse.name})"
    for t in (g, out):
        if t.shape != o.shape or t.dtype != o.dtype:
            raise ShapeError(f"{what}: {t.name} is {t.shape} {t.dtype}; it must be sdpa's output's, {o.shape} "
                             f"{o.dtype}")
    if lse.shape != q.shape[:3] or lse.dtype != lse_dtype(q.dtype):
        raise ShapeError(f"{what}: {lse.name} is {lse.shape} {lse.dtype}; it must be sdpa_lse's logsumexp, "
                         f"{q.shape[:3]} {lse_dtype(q.dtype)}")
    return [OutSpec(t.shape, t.dtype, t.axes) for t in (q, k, v)]


# Attention as a reduction over the keys (sdpa's and sdpa_lse's rfactor, _rfactor_attention): the first half,
# each block's attention and logsumexp; the merge is made of ops that have partial rules (amax, sum).

def _attention_blocks(q, k, v, blocks, is_causal, scale, offset=0, key_offset=0):
    """(out, lse) of q against each of `blocks` torch.chunk pieces of k and v (global positions from
    offset and key_offset), stacked on axis 2; a row that sees no key of a block (a causal mask, an empty
    block) gets lse -inf and out 0, so that its weight exp(lse - m) is 0 and adds nothing. On a GPU each
    block runs in torch's fused kernels where they take the operands (_fused_block), else in the math."""
    outs, lses = [], []
    for lo, hi in _block_bounds(k.shape[2], blocks):
        kb, vb = k[:, :, lo:hi], v[:, :, lo:hi]
        o, lse = _fused_block(q, kb, vb, is_causal, scale, offset, key_offset + lo) or \
            _math_block(q, kb, vb, is_causal, scale, offset, key_offset + lo)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs, 2), torch.stack(lses, 2)


def _math_block(q, k, v, is_causal, scale, offset, key_offset):
    """One block's (out, lse) in the logsumexp's dtype, from the [sq, block] scores."""
    dt = lse_dtype(q.dtype)
    s = _attention_scores(q, k, is_causal, scale, offset, key_offset)
    lse = torch.logsumexp(s, -1)
    seen = torch.where(torch.isfinite(lse), lse, torch.zeros((), dtype=dt, device=q.device))
    return torch.matmul(torch.exp(s - seen.unsqueeze(-1)), v.to(dt)), lse


def _fused_block(q, k, v, is_causal, scale, offset, key_offset, forward=None):
    """One block's (out, lse) from torch's fused kernels (no [sq, block] tensor; out rounded to q's dtype
    before it is widened, as torch's own merge of ring attention's blocks does); None where they refuse.
    Each piece of _causal_pieces is one fused call (`forward`, _fused_forward's signature), the pieces of
    a row merged by their logsumexps."""
    dt, sq, n = lse_dtype(q.dtype), q.shape[2], k.shape[2]
    if n == 0 or (forward is None and not q.is_cuda):
        return None
    forward = forward or _fused_forward
    out = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=dt, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=dt, device=q.device)
    for lo, hi, pieces in _causal_pieces(sq, n, is_causal, offset, key_offset):
        parts = [forward(q[:, :, lo:hi], k[:, :, a:b], v[:, :, a:b], causal, scale) for a, b, causal in pieces]
        if any(p is None for p in parts):
            return None
        ls = torch.stack([p[1].to(dt) for p in parts])
        top = ls.amax(0)
        w = torch.exp(ls - top)
        out[:, :, lo:hi] = sum(wi.unsqueeze(-1) * p[0].to(dt) for wi, p in zip(w, parts)) / w.sum(0).unsqueeze(-1)
        lse[:, :, lo:hi] = top + torch.log(w.sum(0))
    return out, lse


def _attention_blocks_ref(q, k, v, blocks, is_causal=False, scale=None):
    return _attention_blocks(q, k, v, blocks, is_causal, scale)


def _attention_blocks_causal_offsets(args, operands, outputs, ctx, axes):
    """causal attention of the rank's queries (global rows start..) against its blocks of the keys (global
    keys kstart..: one block where the keys are split one block per rank), each block's mask offset by
    both positions"""
    lo, k_lo = _causal_offsets(operands, ctx)
    a = args
    return _attention_blocks(a["q"], a["k"], a["v"], a["blocks"], True, a.get("scale"), lo, k_lo)


ATTENTION_BLOCKS_CAUSAL_OFFSETS = LocalKernel("causal_offsets", _attention_blocks_causal_offsets)


def _attention_blocks_flops(ins, outs, args) -> float:
    """attention's over the rank's keys (sdpa's count), and the block outputs' weighting"""
    return _sdpa_flops(ins, outs, args) + float(math.prod(outs[1]))


@op("attention_blocks", "attention", _attention_blocks_ref, flops=_attention_blocks_flops,
    local_attrs=lambda args, outs: {"blocks": outs[0][2]}, local_kernels=(ATTENTION_BLOCKS_CAUSAL_OFFSETS,),
    no_grad="a half of attention split over the keys by the optimizer's rfactor, which runs after "
            "differentiation: a fusion differentiates sdpa or sdpa_lse, whose vjp it has")
def attention_blocks(q, k, v, blocks: int, is_causal: bool = False, scale: float | None = None):
    """Attention of q against `blocks` torch.chunk pieces of the key sequence of k and v, each on its own:
    (out [batch, heads, blocks, seq_q, head_dim_v], lse [batch, heads, blocks, seq_q]), both in the
    logsumexp's dtype (float32 for 16-bit operands, as torch's merge of blocks keeps them); a row that sees
    no key of a block has lse -inf and out 0. The first half of attention split over the keys (the second:
    m = amax(lse, 2), w = exp(lse - m), out = sum(w out, 2) / sum(w, 2), lse = m + log(sum(w, 2))).

    >>> q = TensorSpec("q", (2, 4, 16, 8), torch.bfloat16, ("b", "h", "s", "d"))
    >>> [(o.shape, o.dtype) for o in attention_blocks(q, q, q, 4, is_causal=True)]
    [((2, 4, 4, 16, 8), torch.float32), ((2, 4, 4, 16), torch.float32)]
    """
    (out,) = sdpa(q, k, v, is_causal, scale)
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ShapeError(f"attention_blocks({q.name}, {k.name}, {v.name}): blocks must be a positive int, got "
                         f"{blocks!r}")
    dt, blk = lse_dtype(q.dtype), (blocks,)
    return [OutSpec(q.shape[:2] + blk + out.shape[2:], dt, q.axes[:2] + (f"{k.axes[2]}/blk",) + out.axes[2:]),
            OutSpec(q.shape[:2] + blk + q.shape[2:3], dt, q.axes[:2] + (f"{k.axes[2]}/blk",) + q.axes[2:3])]


def _masked_take(table: torch.Tensor, index: torch.Tensor, lo: int, hi: int, take) -> torch.Tensor:
    """take(table, index - lo) where index falls in [lo, hi), else 0 (a summand of a partial). Selected
    with where, not multiplied: an inf or nan the clamped lookup lands on must not leak as 0 * inf."""
    inside = (index >= lo) & (index < hi)
    picked = take(table, (index - lo).clamp(0, max(hi - lo - 1, 0)))
    mask = inside.unsqueeze(-1) if picked.ndim > inside.ndim else inside
    return torch.where(mask, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def _embedding_vocab_parallel(args, operands, outputs, ctx, axes):
    """embedding from the rank's rows of the table as one summand of a partial: the rows of ids the rank
    holds, zeros for the others (ids are global)"""
    w = operands["weight"]
    lo, hi = ctx.shard_range(w.shape[0], w.layout, 0)
    return _masked_take(args["weight"], args["indices"], lo, hi, lambda t, i: t[i])


EMBEDDING_VOCAB_PARALLEL = LocalKernel("vocab_parallel", _embedding_vocab_parallel)


def _vjp_embedding(ops, g, out, indices, weight):
    """weight: the rows' gradients scatter-added into zeros at their ids (an id picked twice gets both)"""
    n, d = math.prod(indices.shape), weight.shape[1]
    ids = indices if indices.dtype == torch.int64 else ops.cast(indices, torch.int64)
    ids = ops.expand(ops.reshape(ids, (n, 1)), (n, d))
    return {"weight": ops.scatter_add(zeros_like(ops, weight), 0, ids, ops.reshape(g, (n, d)))}


@op("embedding", "gather", lambda indices, weight: weight[indices],
    indexes=Indexing("indices", "weight", 0, "rows", "fix {index}, or give {table} more rows"),
    local_kernels=(EMBEDDING_VOCAB_PARALLEL,), vjp=_vjp_embedding)
def embedding(indices, weight):
    """weight[indices]: rows of an embedding table [vocab, dim] picked by integer indices."""
    indices, weight = _need_tensor("embedding", "indices", indices), _need_tensor("embedding", "weight", weight)
    if indices.dtype not in INT_DTYPES:
        raise DtypeError(f"embedding({indices.name}, {weight.name}): indices must be int32 or int64, got "
                         f"{str(indices.dtype).replace('torch.', '')}")
    if weight.ndim != 2:
        raise ShapeError(f"embedding({indices.name}, {weight.name}): {weight.name} must be 2-D [vocab, dim], "
                         f"got {weight.shape}")
    return [OutSpec(indices.shape + (weight.shape[1],), weight.dtype, indices.axes + (weight.axes[1],))]


def _take_along_masked(args, operands, outputs, ctx, axes):
    """take_along_axis from the rank's part of x along dim as one summand of a partial: the entries
    whose (global) index the rank holds, zeros for the others"""
    x = operands["x"]
    dim = args["dim"] % len(x.shape)
    lo, hi = ctx.shard_range(x.shape[dim], x.layout, dim)
    return _masked_take(args["x"], args["index"], lo, hi, lambda t, i: torch.take_along_dim(t, i, dim))


TAKE_ALONG_MASKED = LocalKernel("masked_gather", _take_along_masked)


@op("take_along_axis", "gather", lambda x, index, dim: torch.take_along_dim(x, index, dim),
    indexes=Indexing("index", "x", "dim", "entries along axis"), local_kernels=(TAKE_ALONG_MASKED,),
    vjp=lambda ops, g, out, x, index, dim: {"x": ops.scatter_add(zeros_like(ops, x), dim, index, g)})
def take_along_axis(x, index, dim: int):
    """x gathered along `dim` at `index` (same rank as x, extent along dim free), as torch.take_along_dim."""
    x, index = _need_tensor("take_along_axis", "x", x), _need_tensor("take_along_axis", "index", index)
    d = norm_axis("take_along_axis", x, dim)
    if index.dtype != torch.int64:
        raise DtypeError(f"take_along_axis({x.name}, {index.name}): index must be int64 (as torch), got "
                         f"{str(index.dtype).replace('torch.', '')}")
    if index.ndim != x.ndim or any(i != d and a != b for i, (a, b) in enumerate(zip(x.shape, index.shape))):
        raise ShapeError(f"take_along_axis({x.name}, {index.name}): index shape {index.shape} must match "
                         f"{x.shape} on every axis but {d}")
    return [OutSpec(index.shape, x.dtype, x.axes[:d] + (index.axes[d],) + x.axes[d + 1:])]


def _scatter_add_local(args, operands, outputs, ctx, axes):
    """scatter_add on a rank as one summand of a partial, or into its part of x along dim: on the mesh
    axes that split the sources, x is added on the first rank only (the sum over ranks adds it once);
    on those that split x along dim, the rank adds the sources whose (global) index it holds, at their
    local position (selected with where: 0 * inf would be nan)"""
    x = operands["x"]
    dim = args["dim"] % len(x.shape)
    replicated = [m for m in axes if x.layout.placements[m].kind == "R"]
    base = args["x"] if ctx.on_first(replicated) else torch.zeros_like(args["x"])
    lo, hi = ctx.shard_range(x.shape[dim], x.layout, dim)
    if hi <= lo:
        return base.clone()
    index, src = args["index"], args["src"]
    inside = (index >= lo) & (index < hi)
    src = torch.where(inside, src, torch.zeros((), dtype=src.dtype, device=src.device))
    return base.scatter_add(dim, (index - lo).clamp(0, hi - lo - 1), src)


SCATTER_ADD_LOCAL = LocalKernel("local_sources", _scatter_add_local)


@op("scatter_add", "gather", lambda x, dim, index, src: x.scatter_add(dim, index, src),
    indexes=Indexing("index", "x", "dim", "entries along axis"),
    local_kernels=(SCATTER_ADD_LOCAL,),
    vjp=lambda ops, g, out, x, dim, index, src: {"x": g, "src": ops.take_along_axis(g, index, dim)})
def scatter_add(x, dim: int, index, src):
    """x with src added at the positions `index` holds along `dim`, as torch.scatter_add: index and src
    share a shape that matches x's on every axis but dim. The adjoint of take_along_axis (a gradient of
    embedding, take_along_axis and cross_entropy)."""
    what = "scatter_add"
    x, index, src = (_need_tensor(what, n, t) for n, t in (("x", x), ("index", index), ("src", src)))
    d = norm_axis(what, x, dim)
    what = f"scatter_add({x.name}, {index.name}, {src.name})"
    if index.dtype != torch.int64:
        raise DtypeError(f"{what}: index must be int64 (as torch), got {str(index.dtype).replace('torch.', '')}; "
                         f"cast it")
    if src.dtype != x.dtype:
        raise DtypeError(f"{what}: src is {str(src.dtype).replace('torch.', '')} but x is "
                         f"{str(x.dtype).replace('torch.', '')}; cast src to x's dtype")
    if index.shape != src.shape or index.ndim != x.ndim or any(
            i != d and a != b for i, (a, b) in enumerate(zip(x.shape, index.shape))):
        raise ShapeError(f"{what}: index {index.shape} and src {src.shape} must have one shape, matching "
                         f"{x.name} {x.shape} on every axis but {d}")
    return [OutSpec(x.shape, x.dtype, x.axes)]


# ------------------------------------------------------------------ mixture of experts: sort, count, grouped matmul

def _argsort_ref(x, dim=-1, descending=False):
    return torch.argsort(x, dim=dim, descending=descending, stable=True)


@op("argsort", "scan", _argsort_ref,
    no_grad="its output is integer positions (a permutation), so no gradient flows through it")
def argsort(x, dim: int = -1, descending: bool = False):
    """The positions that sort x along `dim`, stable (ties keep their order), as torch.argsort(stable=True):
    int64, x's shape. Rows along other axes sort independently, so it shards on any axis but `dim`
    (rewrites/scans.py). Routers take topk as its first k; grouped experts sort tokens by expert id.

    >>> argsort(TensorSpec("ids", (6,), torch.int64, ("s",)))
    [OutSpec(shape=(6,), dtype=torch.int64, axes=('s',))]
    """
    x = _need_tensor("argsort", "x", x)
    norm_axis("argsort", x, dim, ndim=max(x.ndim, 1))
    if x.dtype == torch.bool:
        raise DtypeError(f"argsort({x.name}): x is bool; cast it to an integer or float dtype to sort it")
    return [OutSpec(x.shape, torch.int64, x.axes)]


def _histc_ref(x, bins, min=0.0, max=0.0):
    if x.dtype.is_floating_point:
        return torch.histc(x, bins=bins, min=min, max=max)
    # integers (torch's CUDA kernel takes them, its CPU one does not): counted in float64, exact below 2**53
    return torch.histc(x.to(torch.float64), bins=bins, min=min, max=max).to(x.dtype)


@op("histc", "reduction", _histc_ref,
    no_grad="its output counts elements per bin: piecewise constant, as torch (which has no derivative for it)")
def histc(x, bins: int, min: float = 0.0, max: float = 0.0):
    """How many elements of x fall in each of `bins` equal bins over [min, max] (an element equal to max in
    the last bin, elements outside none), as torch.histc: a [bins] tensor of x's dtype, float or integer (what
    transformers' experts give it off the CPU: histc(ids.int(), ...), as torch's CUDA kernel takes). min < max is
    required (torch's defaults, min == max == 0, read the range from the data, which differs per shard). A
    shard of x counts its elements, so x split on any axis gives a pending sum of counts (exact: counts are
    integers). Mixture of experts: tokens per expert, histc(ids.float(), experts, 0, experts - 1).

    >>> histc(TensorSpec("ids", (6,), torch.float32, ("s",)), 4, 0, 3)
    [OutSpec(shape=(4,), dtype=torch.float32, axes=('bins4',))]
    """
    x = _need_tensor("histc", "x", x)
    if x.dtype == torch.bool:
        raise DtypeError(f"histc({x.name}): x is bool; cast it to an integer or float dtype to count it")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ShapeError(f"histc({x.name}): bins must be an int >= 1, got {bins!r}")
    if not (isinstance(min, (int, float)) and isinstance(max, (int, float))) or not min < max:
        raise ShapeError(f"histc({x.name}): the range must be given as numbers min < max, got min={min!r}, "
                         f"max={max!r} (torch's min == max takes the range from the data, which differs per shard: "
                         f"give the range, as histc(ids, experts, 0, experts - 1))")
    return [OutSpec((bins,), x.dtype, (f"bins{bins}",))]


def _group_rows(offsets: torch.Tensor, rows: int, what: str) -> list[tuple[int, int]]:
    """[start, stop) of each group's rows: group e holds rows offsets[e-1]:offsets[e] (offsets[-1] = 0), or a
    ShapeError if offsets decrease, are negative or pass the rows (torch's kernels would read out of range)."""
    ends = [int(v) for v in offsets.tolist()]
    starts = [0] + ends[:-1]
    bad = next((e for e, (a, b) in enumerate(zip(starts, ends)) if b < a or b > rows), None)
    if bad is not None:
        raise ShapeError(f"{what}: offsets must be non-decreasing ends of row ranges within the {rows} rows, got "
                         f"{ends} (group {bad}: {starts[bad]}..{ends[bad]}); offsets are the cumsum of the rows "
                         f"per group")
    return list(zip(starts, ends))


def _one_grouped_call(*ts: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these operands in one call: on the CPU in float32 / bfloat16 / float16
    (torch's fallback, an mm per group in C++: the same numbers as the Python loop), on a CUDA device of
    compute capability 9 or later in bfloat16 with rows of 16-byte multiples (its CUTLASS kernel); otherwise
    the operands run expert by expert (float64 everywhere, older GPUs)."""
    t = ts[0]
    if not hasattr(torch, "_grouped_mm") or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if not all(_aligned(u) for u in ts):
        return False  # torch's kernels (and its CPU fallback) take 16-byte aligned matrices only
    if t.device.type == "cpu":
        return True
    return t.device.type == "cuda" and t.dtype == torch.bfloat16 and torch.cuda.get_device_capability(t.device) >= (9, 0)


def _aligned(t: torch.Tensor) -> bool:
    """t's matrices as torch._grouped_mm takes them: one of the last two strides 1, the other and any batch
    stride a multiple of 16 bytes, the data 16-byte aligned."""
    *batch, a, b = t.stride()
    lead = a if b == 1 else b if a == 1 else None
    return lead is not None and t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in (*batch, lead))


def _held_rows(spans, lo: int, hi: int, e_lo: int, e_hi: int) -> list[tuple[int, int]]:
    """Each of experts e_lo..e_hi's rows within the global rows lo..hi, as local [start, stop): consecutive
    ranges (the experts' rows are), empty where an expert has none there."""
    return [(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo) for a, b in spans[e_lo:e_hi]]


def _grouped_mm_block(x, w, offsets, start=0, total=None, e_lo=0):
    """grouped_mm on one rank's block: x holds the global rows start.. of `total` (None: x is whole), w the
    experts e_lo.. (offsets global). Rows of other experts, and past offsets[-1], are zero. The experts' rows
    the block holds are one range, run as one torch._grouped_mm where it serves (_one_grouped_call)."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    spans = _group_rows(offsets, x.shape[0] if total is None else total, "grouped_mm")
    rows = _held_rows(spans, start, start + x.shape[0], e_lo, e_lo + w.shape[0])
    if not rows or rows[-1][1] <= rows[0][0]:
        return out
    first, last = rows[0][0], rows[-1][1]
    # not on a GPU: there torch._grouped_mm's forward ran 0.90-0.95x the loop's cuBLAS GEMMs at Mixtral's
    # shapes (bench/results_grouped_mm_h100.txt; its weight gradient 1.16-2.36x faster, so that one runs)
    if not x.is_cuda and _one_grouped_call(x[first:last], w):
        ends = torch.tensor([b - first for _, b in rows], dtype=torch.int32, device=x.device)
        out[first:last] = torch._grouped_mm(x[first:last], w, offs=ends)
        return out
    for e, (a, b) in enumerate(rows):
        if b > a:
            out[a:b] = x[a:b] @ w[e]
    return out


def _first(o, ctx) -> int:
    """The first global index along axis 0 of operand or output `o` this rank holds."""
    return ctx.shard_range(o.shape[0], o.layout, 0)[0]


def _grouped_mm_ranged(args, operands, outputs, ctx, axes):
    """grouped_mm on the rank's rows of x (global row positions) and its experts of w: each row it holds
    whose expert it holds, the others zero (a shard of the rows, or with the experts split one summand of a
    partial: each row belongs to one expert)"""
    x = operands["x"]
    return _grouped_mm_block(args["x"], args["w"], args["offsets"], _first(x, ctx), x.shape[0],
                             _first(operands["w"], ctx))


GROUPED_MM_RANGED = LocalKernel("ranged", _grouped_mm_ranged)


# expert exchanges (collectives.EXCHANGES): grouped_mm with the token dispatch before it or the combine after it,
# one uneven all-to-all on one mesh axis. A step runs it as before -> exchange -> after; simulate runs every rank
# of a group at once (exchange_all_ranks), torch.distributed rank by rank (the kernel)

def _exchange_ranges(operands, outputs, offsets, mesh, rank: int, m: int, flag: str):
    """(members, me, row blocks, expert spans, this rank's first expert, the operand moved or None, the end of
    this rank's experts) on mesh
    axis m through `rank`: the rows' ceil-sized blocks (the split operand's, or the output's) and each
    member's experts' rows from the offsets; a PlanError where another mesh axis splits the rows or the
    experts (the exchange moves rows on m alone; the rules offer it nestable=False and a step runs one local
    kernel, so no plan of the optimizer's does). The experts are w's (grouped_mm) or the output's
    (grouped_mm_wgrad, whose dispatch moves x or g: the operand split on its rows)."""
    x, y = operands["x"], outputs[0]
    w = operands["w"] if "w" in operands else y
    laid = [(k, o) for k, o in operands.items() if k != "offsets"] + [("out", y)]
    for name, o in laid:
        if any(k != m for k in o.layout.sharding_axes(0)) or any(p.rows for k, p in enumerate(o.layout) if k != m):
            raise PlanError(f"{flag}: {name} is laid out {o.layout}; the exchange on mesh axis {m} needs the "
                            f"rows and the experts whole on every other mesh axis (a split of the features or a "
                            f"pending sum there is fine)")
    rows, experts = x.shape[0], w.shape[0]
    moved = next((k for k in ("x", "g") if k in operands and operands[k].layout[m].is_shard), None)
    blocked = operands[moved] if moved is not None else y
    members = mesh.ranks_along(m, rank)
    spans = _group_rows(offsets, rows, flag)
    end = spans[-1][1] if spans else 0
    blocks, ranges, held = [], [], []
    for q in members:
        ctx = RankContext(mesh, q)
        blocks.append(ctx.shard_range(rows, blocked.layout, 0))
        e_lo, e_hi = ctx.shard_range(experts, w.layout, 0)
        ranges.append((spans[e_lo][0], spans[e_hi - 1][1]) if e_hi > e_lo else (end, end))
        held.append((e_lo, e_hi))
    me = members.index(rank)
    return members, me, blocks, ranges, held[me][0], moved, held[me][1]


def _dispatch_before(args, rng):
    return args["x"]


def _dispatch_after(got, args, rng, rows):
    """grouped_mm of the rows received (the rank's expert span), placed in a whole-size buffer: expert rows."""
    _, me, _, spans, e_lo, _, _ = rng
    lo, hi = spans[me]
    out = torch.zeros(rows, args["w"].shape[2], dtype=got.dtype, device=got.device)
    out[lo:hi] = _grouped_mm_block(got, args["w"], args["offsets"], lo, rows, e_lo)
    return out


def _combine_before(args, rng):
    """grouped_mm of the rank's expert span of x (x whole or expert rows), compact."""
    _, me, _, spans, e_lo, _, _ = rng
    lo, hi = spans[me]
    return _grouped_mm_block(args["x"][lo:hi], args["w"], args["offsets"], lo, args["x"].shape[0], e_lo)


def _combine_after(got, args, rng, rows):
    """The rows received placed in the rank's block; rows past offsets[-1] (no expert's) zero."""
    _, me, blocks, _, _, _, _ = rng
    lo, hi = blocks[me]
    out = torch.zeros(hi - lo, got.shape[1], dtype=got.dtype, device=got.device)
    out[: got.shape[0]] = got
    return out


def _wgrad_dispatch_before(args, rng):
    """The rank's block of the operand split on its rows (x or g)."""
    return args[rng[5]]


def _wgrad_dispatch_after(got, args, rng, rows):
    """x_e^T g_e for the rank's experts over their rows only (its expert span): the rows received of the
    operand moved beside the same rows of the other one, expert rows (Pe: its rows outside the span, zero,
    are never read). A rank without experts computes nothing: its output shard is empty."""
    _, me, _, spans, e_lo, moved, e_hi = rng
    lo, hi = spans[me]
    other = "g" if moved == "x" else "x"
    span = {moved: got, other: args[other][lo:hi]}
    return _grouped_wgrad_block(span["x"], span["g"], args["offsets"], lo, rows, e_lo, e_hi)


_EXCHANGE_STEPS = {"ep_dispatch": (_dispatch_before, _dispatch_after), "ep_combine": (_combine_before, _combine_after),
                   "ep_wgrad": (_wgrad_dispatch_before, _wgrad_dispatch_after)}


def _exchange_parts(flag: str, rng):
    """(before, after, src ranges, dst ranges) of the exchange `flag`."""
    before, after = _EXCHANGE_STEPS[flag]
    _, _, blocks, spans, _, _, _ = rng
    return before, after, *((spans, blocks) if flag == "ep_combine" else (blocks, spans))


def exchange_all_ranks(flag: str, args_by_rank, operands, outputs, mesh, m: int) -> dict:
    """Every rank's output of a grouped_mm step under the exchange `flag` on mesh axis m, in one process
    (simulate's, and the rule tests'): per group, each member's part before the exchange, the exchange
    (collectives.exchange_simulate), each member's part after: what the kernel gives each rank under
    torch.distributed."""
    out = {}
    for group in mesh.groups(m):
        rngs = {r: _exchange_ranges(operands, outputs, args_by_rank[r]["offsets"], mesh, r, m, flag) for r in group}
        before, after, src, dst = _exchange_parts(flag, rngs[group[0]])
        got = exchange_simulate([before(args_by_rank[r], rngs[r]) for r in group], src, dst)
        for r, g in zip(group, got):
            out[r] = after(g, args_by_rank[r], rngs[r], operands["x"].shape[0])
    return out


def _exchange_kernel(flag: str):
    def kernel(args, operands, outputs, ctx, axes):
        if len(axes) != 1:
            raise PlanError(f"grouped_mm {flag}: the exchange runs on one mesh axis, the step names {list(axes)}")
        if not torch.distributed.is_initialized():
            raise PlanError(f"grouped_mm {flag}: the step communicates; run the plan under torch.distributed "
                            f"(plan.run under ed.launch) or with ed.simulate, which runs every rank at once")
        (m,) = axes
        rng = _exchange_ranges(operands, outputs, args["offsets"], ctx.mesh, ctx.rank, m, flag)
        before, after, src, dst = _exchange_parts(flag, rng)
        got = exchange_run(before(args, rng), src, dst, rng[0], rng[1])
        return after(got, args, rng, operands["x"].shape[0])
    kernel.__doc__ = next(x.identity for x in EXCHANGES.values() if x.flag == flag)
    kernel.__name__ = f"grouped_mm_wgrad_{flag}" if flag == "ep_wgrad" else f"grouped_mm_{flag}"
    return kernel


GROUPED_MM_DISPATCH = LocalKernel("ep_dispatch", _exchange_kernel("ep_dispatch"))
GROUPED_MM_COMBINE = LocalKernel("ep_combine", _exchange_kernel("ep_combine"))
GROUPED_WGRAD_DISPATCH = LocalKernel("ep_wgrad", _exchange_kernel("ep_wgrad"))


def _grouped_flops(ins, outs, args) -> float:
    """2 rows x d x f, each row meeting one expert's matrix, times the share of the experts the rank holds
    (w's or the output's experts against the offsets' count): under expert parallelism a rank computes the
    rows of its experts only, a share the cost model takes as the experts' share (balanced routing)."""
    rows, d = ins[0]
    f = outs[0][1] if len(outs[0]) == 2 else outs[0][2]
    held = ins[1][0] if len(outs[0]) == 2 else outs[0][0]
    return 2.0 * rows * d * f * held / max(ins[2][0], 1)


def _offsets_spec(what: str, offsets, groups: int) -> TensorSpec:
    offsets = _need_tensor(what.split("(")[0], "offsets", offsets)
    if offsets.dtype not in INT_DTYPES:
        raise DtypeError(f"{what}: offsets must be int32 or int64 (the cumsum of the rows per expert), got "
                         f"{str(offsets.dtype).replace('torch.', '')}")
    if offsets.shape != (groups,):
        raise ShapeError(f"{what}: offsets {offsets.name} has shape {offsets.shape}, expected ({groups},): one end "
                         f"row per expert")
    return offsets


def _vjp_grouped_mm(ops, g, out, x, w, offsets):
    """x: grouped_mm of g with each expert's matrix transposed; w: per expert x[rows]^T g[rows]"""
    return {"x": ops.grouped_mm(g, ops.transpose(w, 1, 2), offsets), "w": ops.grouped_mm_wgrad(x, g, offsets)}


@op("grouped_mm", "matmul", lambda x, w, offsets: _grouped_mm_block(x, w, offsets), flops=_grouped_flops,
    local_kernels=(GROUPED_MM_RANGED, GROUPED_MM_DISPATCH, GROUPED_MM_COMBINE), vjp=_vjp_grouped_mm)
def grouped_mm(x, w, offsets):
    """A matmul per expert over row ranges: out[offsets[e-1]:offsets[e]] = x[offsets[e-1]:offsets[e]] @ w[e]
    (offsets[-1] read as 0), rows past offsets[-1] zero; x [rows, d] sorted by expert, w [experts, d, f],
    offsets [experts] int (the cumsum of the rows per expert). As torch's _grouped_mm (2-D x, 3-D w) and
    transformers' grouped_mm_fallback. Shards on f, on d (a pending sum), on the rows, and on the experts
    (expert parallelism: each rank computes the rows of its experts, a pending sum; rewrites/experts.py).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, w = fd.define_tensor((3, 1), name="x"), fd.define_tensor((2, 1, 1), name="w")
    ...     o = fd.define_tensor((2,), dtype=torch.int64, name="offsets")
    ...     fd.add_output(fd.ops.grouped_mm(x, w, o), name="y")
    >>> w = torch.tensor([[[2.]], [[3.]]])
    >>> ed.evaluate(fd, {"x": torch.ones(3, 1), "w": w, "offsets": torch.tensor([1, 2])})["y"]
    tensor([[2.],
            [3.],
            [0.]])
    """
    x, w = _need_tensor("grouped_mm", "x", x), _need_tensor("grouped_mm", "w", w)
    what = f"grouped_mm({x.name}, {w.name})"
    if x.ndim != 2 or w.ndim != 3:
        raise ShapeError(f"{what}: x must be 2-D [rows, d] and w 3-D [experts, d, f], got {x.shape} and {w.shape}")
    if w.shape[1] != x.shape[1]:
        raise ShapeError(f"{what}: {w.name}'s axis 1 is {w.shape[1]} but {x.name}'s last axis is {x.shape[1]}; w is "
                         f"[experts, d, f] (transpose a [experts, f, d] weight: transpose(w, 1, 2))")
    _same_float("grouped_mm", x, w)
    _offsets_spec(what, offsets, w.shape[0])
    return [OutSpec((x.shape[0], w.shape[2]), x.dtype, (x.axes[0], w.axes[2]))]


def _grouped_wgrad_block(x, g, offsets, start=0, total=None, e_lo=0, e_hi=None):
    """Per expert e_lo..e_hi (None: every one), x[rows]^T g[rows] over the rows of x and g the rank holds
    (the global rows start.. of `total`; None: x and g are whole)."""
    e_hi = offsets.shape[0] if e_hi is None else e_hi
    spans = _group_rows(offsets, x.shape[0] if total is None else total, "grouped_mm_wgrad")
    rows = _held_rows(spans, start, start + x.shape[0], e_lo, e_hi)
    first, last = (rows[0][0], rows[-1][1]) if rows else (0, 0)
    if last > first and _one_grouped_call(x[first:last].transpose(0, 1), g[first:last]):
        # one call over the experts' rows: an expert with none gets zeros from it too
        ends = torch.tensor([b - first for _, b in rows], dtype=torch.int32, device=x.device)
        return torch._grouped_mm(x[first:last].transpose(0, 1), g[first:last], offs=ends)
    out = torch.zeros(e_hi - e_lo, x.shape[1], g.shape[1], dtype=x.dtype, device=x.device)
    for e, (a, b) in enumerate(rows):
        if b > a:
            out[e] = x[a:b].transpose(0, 1) @ g[a:b]
    return out


def _grouped_wgrad_ranged(args, operands, outputs, ctx, axes):
    """grouped_mm_wgrad from the rank's rows of x and g (one summand of a partial: the sum over the rows) for
    the experts of the output it holds"""
    x, out = operands["x"], outputs[0]
    return _grouped_wgrad_block(args["x"], args["g"], args["offsets"], _first(x, ctx), x.shape[0],
                                *ctx.shard_range(out.shape[0], out.layout, 0))


GROUPED_WGRAD_RANGED = LocalKernel("ranged", _grouped_wgrad_ranged)


def _vjp_grouped_wgrad(ops, gw, out, x, g, offsets):
    """out[e] = x_e^T g_e: x gets g_e gw[e]^T, g gets x_e gw[e] (grouped_mm both)"""
    return {"x": ops.grouped_mm(g, ops.transpose(gw, 1, 2), offsets), "g": ops.grouped_mm(x, gw, offsets)}


@op("grouped_mm_wgrad", "matmul",
    lambda x, g, offsets: _grouped_wgrad_block(x, g, offsets), flops=_grouped_flops,
    local_kernels=(GROUPED_WGRAD_RANGED, GROUPED_WGRAD_DISPATCH), vjp=_vjp_grouped_wgrad)
def grouped_mm_wgrad(x, g, offsets):
    """The weight gradient of grouped_mm: out[e] = x[rows of e]^T @ g[rows of e], [experts, d, f] from x
    [rows, d], g [rows, f] and offsets [experts] (as grouped_mm's); an expert with no rows gets zeros.
    Shards on d, on f, on the experts (each rank its experts' rows) and on the rows (a pending sum).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, g = fd.define_tensor((3, 1), name="x"), fd.define_tensor((3, 1), name="g")
    ...     o = fd.define_tensor((2,), dtype=torch.int64, name="offsets")
    ...     fd.add_output(fd.ops.grouped_mm_wgrad(x, g, o), name="dw")
    >>> g = torch.tensor([[1.], [2.], [4.]])
    >>> ed.evaluate(fd, {"x": torch.ones(3, 1), "g": g, "offsets": torch.tensor([2, 2])})["dw"].flatten()
    tensor([3., 0.])
    """
    x, g = _need_tensor("grouped_mm_wgrad", "x", x), _need_tensor("grouped_mm_wgrad", "g", g)
    what = f"grouped_mm_wgrad({x.name}, {g.name})"
    if x.ndim != 2 or g.ndim != 2 or x.shape[0] != g.shape[0]:
        raise ShapeError(f"{what}: x [rows, d] and g [rows, f] must be 2-D with the same rows, got {x.shape} and "
                         f"{g.shape}")
    _same_float("grouped_mm_wgrad", x, g)
    offsets = _need_tensor("grouped_mm_wgrad", "offsets", offsets)
    if offsets.ndim != 1:
        raise ShapeError(f"{what}: offsets {offsets.name} must be 1-D [experts], got {offsets.shape}")
    _offsets_spec(what, offsets, offsets.shape[0])
    return [OutSpec((offsets.shape[0], x.shape[1], g.shape[1]), x.dtype, (offsets.axes[0], x.axes[1], g.axes[1]))]


def _ce_rows(ops, target, ignore_index):
    """(mask, safe target) of cross entropy's rows: mask holds where target is not ignore_index, the safe
    target is 0 there (a class every row has), so that take_along_axis and scatter_add read in range"""
    mask = ops.ne(target, ignore_index)
    return mask, ops.where(mask, target, 0)


def _vjp_cross_entropy(ops, g, out, logits, target, reduction="mean", ignore_index=None):
    """logits: (softmax(logits) - onehot(target)) times each row's gradient (g / N for the mean); with
    ignore_index, ignored rows get 0 and the mean divides by the rows not ignored (torch: all rows ignored
    give a zero gradient)"""
    n = logits.shape[0]
    if ignore_index is None:
        if reduction == "none":
            rows = ops.unsqueeze(g, 1)
        else:
            rows = ops.expand(ops.reshape(ops.div(g, float(n)) if reduction == "mean" else g, (1, 1)), (n, 1))
        picked = ops.scatter_add(zeros_like(ops, logits), 1, ops.unsqueeze(target, 1), rows)
        return {"logits": ops.sub(ops.mul(ops.softmax(logits, -1), rows), picked)}
    mask, safe = _ce_rows(ops, target, ignore_index)
    if reduction == "none":
        rows = g
    else:
        scale = ops.div(g, ops.sum(ops.cast(mask, logits.dtype))) if reduction == "mean" else g
        rows = ops.expand(ops.reshape(scale, (1,)), (n,))
    rows = ops.unsqueeze(ops.where(mask, rows, 0.0), 1)  # where, not a product: g / 0 rows is inf
    picked = ops.scatter_add(zeros_like(ops, logits), 1, ops.unsqueeze(safe, 1), rows)
    return {"logits": ops.sub(ops.mul(ops.softmax(logits, -1), rows), picked)}


def _decompose_cross_entropy(ops, logits, target, reduction="mean", ignore_index=None):
    shifted = ops.sub(logits, ops.amax(logits, -1, keepdim=True))
    logz = ops.log(ops.sum(ops.exp(shifted), -1, keepdim=True))
    if ignore_index is None:
        picked = ops.take_along_axis(shifted, ops.unsqueeze(target, -1), -1)
        nll = ops.sum(ops.sub(logz, picked), -1)
        return {"none": lambda: nll, "sum": lambda: ops.sum(nll), "mean": lambda: ops.mean(nll)}[reduction]()
    mask, safe = _ce_rows(ops, target, ignore_index)
    picked = ops.take_along_axis(shifted, ops.unsqueeze(safe, -1), -1)
    nll = ops.where(mask, ops.sum(ops.sub(logz, picked), -1), 0.0)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return ops.sum(nll)
    return ops.div(ops.sum(nll), ops.sum(ops.cast(mask, logits.dtype)))  # all rows ignored: 0 / 0, nan as torch


def _cross_entropy_reference(logits, target, reduction="mean", ignore_index=None):
    if ignore_index is None:
        return F.cross_entropy(logits, target, reduction=reduction)
    return F.cross_entropy(logits, target, reduction=reduction, ignore_index=ignore_index)


def _cross_entropy_global_count(args, operands, outputs, ctx, axes):
    """mean cross entropy of the rank's rows as one summand of a partial: their summed loss over the
    global row count (without ignore_index only: the count of rows not ignored is not the rank's to know)"""
    if args.get("ignore_index") is not None:
        raise PlanError("cross_entropy's global_count kernel divides by the row count, but this step has "
                        f"ignore_index={args['ignore_index']}; the plan was made by another version of egraph-did")
    total = F.cross_entropy(args["logits"], args["target"], reduction="sum")
    return total / operands["target"].shape[0]


CROSS_ENTROPY_GLOBAL_COUNT = LocalKernel("global_count", _cross_entropy_global_count)


@op("cross_entropy", "reduction", _cross_entropy_reference, _decompose_cross_entropy,
    indexes=Indexing("target", "logits", 1, "classes",
                     "fix {index} (rows to leave out of the loss: pass their value as ignore_index)",
                     skip="ignore_index"),
    local_kernels=(CROSS_ENTROPY_GLOBAL_COUNT,), vjp=_vjp_cross_entropy)
def cross_entropy(logits, target, reduction: str = "mean", ignore_index: int | None = None):
    """Cross entropy of logits [N, C] against class indices [N] (reduction 'mean', 'sum' or 'none'), as
    torch.nn.functional.cross_entropy. Rows whose target is ignore_index (torch's default is -100; here
    None: every target must be a class) count 0, and the mean divides by the rows not ignored (all
    ignored: nan, as torch).

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     logits = fd.define_tensor((3, 4), torch.float64, name="logits")
    ...     t = fd.define_tensor((3,), torch.int64, name="t")
    ...     fd.add_output(fd.ops.cross_entropy(logits, t, ignore_index=-100), name="loss")
    >>> x, t = torch.randn(3, 4, dtype=torch.float64), torch.tensor([1, -100, 3])
    >>> torch.allclose(ed.evaluate(fd, {"logits": x, "t": t})["loss"], torch.nn.functional.cross_entropy(x, t))
    True
    """
    logits = _need_tensor("cross_entropy", "logits", logits)
    target = _need_tensor("cross_entropy", "target", target)
    what = f"cross_entropy({logits.name}, {target.name})"
    _need_float("cross_entropy", logits)
    if logits.ndim != 2:
        raise ShapeError(f"{what}: logits must be 2-D [N, C], got {logits.shape}; reshape the batch axes first")
    if target.dtype != torch.int64:
        raise DtypeError(f"{what}: target must hold class indices as int64 (as torch), got "
                         f"{str(target.dtype).replace('torch.', '')}; cast it")
    if target.shape != logits.shape[:1]:
        raise ShapeError(f"{what}: target has shape {target.shape}, expected ({logits.shape[0]},)")
    if reduction not in ("mean", "sum", "none"):
        raise ShapeError(f"{what}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise ShapeError(f"{what}: ignore_index must be an int (a target value to leave out, torch's -100) or "
                         f"None, got {ignore_index!r}")
    if reduction == "none":
        return [OutSpec(target.shape, logits.dtype, target.axes)]
    return [OutSpec((), logits.dtype, ())]


# ------------------------------------------------------------------ views

def _resolve_shape(op_name: str, x: TensorSpec, shape) -> tuple[int, ...]:
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    if any(not isinstance(e, int) for e in shape):
        raise ShapeError(f"{op_name}({x.name}): shape {shape} must be ints")
    total = math.prod(x.shape)
    if shape.count(-1) > 1:
        raise ShapeError(f"{op_name}({x.name}): at most one -1 in shape {shape}")
    if -1 in shape:
        known = math.prod(e for e in shape if e != -1)
        if known == 0 or total % known:
            raise ShapeError(f"{op_name}({x.name}): cannot infer -1 in {shape} for {total} elements")
        shape = tuple(total // known if e == -1 else e for e in shape)
    if any(e < 0 for e in shape) or math.prod(shape) != total:
        raise ShapeError(f"{op_name}({x.name}): cannot view shape {x.shape} ({total} elements) as {shape}; the "
                         f"new shape must hold the same {total} elements")
    return shape


def _reshape_names(x: TensorSpec, shape: tuple[int, ...]) -> tuple[str, ...]:
    """Keep an axis name where the extent of a leading group of axes is unchanged."""
    names, i, j = [], 0, 0
    while j < len(shape):
        if i < x.ndim and x.shape[i] == shape[j]:
            names.append(x.axes[i])
            i, j = i + 1, j + 1
        else:
            names.append(str(shape[j]))
            j += 1
            i = x.ndim  # past a merge or split, names no longer line up
    return tuple(names)


def _local_shape(args, out_shapes):
    """On a rank, the target shape is the rank's local output shape."""
    return {"shape": out_shapes[0]}


@op("reshape", "view", lambda x, shape: x.reshape(shape), metadata_only=True, local_attrs=_local_shape,
    vjp=lambda ops, g, out, x, shape: {"x": ops.reshape(g, x.shape)})
def reshape(x, shape):
    """View x with a new shape (one -1 allowed), as torch.reshape."""
    x = _need_tensor("reshape", "x", x)
    new = _resolve_shape("reshape", x, shape)
    return [OutSpec(new, x.dtype, _reshape_names(x, new))]


def _vjp_permute(ops, g, out, x, dims):
    """the inverse permutation: x's axis dims[i] is g's axis i"""
    inverse = [0] * x.ndim
    for i, d in enumerate(dims):
        inverse[d % x.ndim] = i
    return {"x": ops.permute(g, tuple(inverse))}


@op("permute", "view", lambda x, dims: x.permute(*dims),
    permutation=lambda args, ndim: tuple(d % ndim for d in args["dims"]), vjp=_vjp_permute)
def permute(x, dims):
    """Reorder axes: output axis i is input axis dims[i]."""
    x = _need_tensor("permute", "x", x)
    dims = tuple(norm_axis("permute", x, d) for d in dims)
    if sorted(dims) != list(range(x.ndim)):
        raise ShapeError(f"permute({x.name}): {dims} is not a permutation of {x.ndim} axes; list each axis "
                         f"0..{x.ndim - 1} once")
    return [OutSpec(tuple(x.shape[d] for d in dims), x.dtype, tuple(x.axes[d] for d in dims))]


def _swap(args, ndim) -> tuple[int, ...]:
    perm = list(range(ndim))
    a, b = args["dim0"] % ndim, args["dim1"] % ndim
    perm[a], perm[b] = perm[b], perm[a]
    return tuple(perm)


@op("transpose", "view", lambda x, dim0, dim1: x.transpose(dim0, dim1), permutation=_swap,
    vjp=lambda ops, g, out, x, dim0, dim1: {"x": ops.transpose(g, dim0, dim1)})
def transpose(x, dim0: int, dim1: int):
    """Swap two axes."""
    x = _need_tensor("transpose", "x", x)
    perm = _swap({"dim0": norm_axis("transpose", x, dim0), "dim1": norm_axis("transpose", x, dim1)}, x.ndim)
    return [OutSpec(tuple(x.shape[d] for d in perm), x.dtype, tuple(x.axes[d] for d in perm))]


@op("unsqueeze", "view", lambda x, dim: x.unsqueeze(dim), metadata_only=True,
    vjp=lambda ops, g, out, x, dim: {"x": ops.reshape(g, x.shape)})
def unsqueeze(x, dim: int):
    """Insert a broadcast axis of extent 1 at `dim`."""
    x = _need_tensor("unsqueeze", "x", x)
    d = norm_axis("unsqueeze", x, dim, ndim=x.ndim + 1)
    return [OutSpec(x.shape[:d] + (1,) + x.shape[d:], x.dtype, x.axes[:d] + ("1",) + x.axes[d:])]


def _slice_bounds(n: int, start: int, end: int | None) -> tuple[int, int]:
    """torch's bounds of x[start:end] along an axis of extent n: negatives count from the end, both clamp."""
    def clamp(v):
        return min(max(v + n if v < 0 else v, 0), n)
    lo = clamp(start)
    return lo, max(lo, clamp(n if end is None else end))


def _slice_ref(x, dim, start=0, end=None):
    lo, hi = _slice_bounds(x.shape[dim], start, end)
    return x.narrow(dim, lo, hi - lo).contiguous()


def _vjp_slice(ops, g, out, x, dim, start=0, end=None):
    """g between zeros: the slices of x before and after the kept range get no gradient"""
    d = dim % x.ndim
    lo, hi = _slice_bounds(x.shape[d], start, end)
    grad = g
    if lo > 0:
        grad = ops.cat(zeros_like(ops, ops.slice(x, d, 0, lo)), grad, d)
    if hi < x.shape[d]:
        grad = ops.cat(grad, zeros_like(ops, ops.slice(x, d, hi, x.shape[d])), d)
    return {"x": grad}


@op("slice", "view", _slice_ref, vjp=_vjp_slice)
def slice_(x, dim: int, start: int = 0, end: int | None = None):
    """x[..., start:end, ...] along `dim` (step 1), with torch's bounds: negatives count from the end,
    out-of-range bounds clamp, end=None is the end."""
    x = _need_tensor("slice", "x", x)
    d = norm_axis("slice", x, dim)
    for name, v in (("start", start), ("end", end)):
        if not (v is None and name == "end") and (not isinstance(v, int) or isinstance(v, bool)):
            raise ShapeError(f"slice({x.name}): {name} must be an int, got {v!r}")
    lo, hi = _slice_bounds(x.shape[d], start, end)
    names = x.axes[:d] + ((x.axes[d] if (lo, hi) == (0, x.shape[d]) else str(hi - lo)),) + x.axes[d + 1:]
    return [OutSpec(x.shape[:d] + (hi - lo,) + x.shape[d + 1:], x.dtype, names)]


@op("cat", "join", lambda a, b, dim: torch.cat((a, b), dim),
    vjp=lambda ops, g, out, a, b, dim: {"a": ops.slice(g, dim, 0, a.shape[dim % a.ndim]),
                                        "b": ops.slice(g, dim, a.shape[dim % a.ndim], out.shape[dim % a.ndim])})
def cat(a, b, dim: int):
    """a and b joined along `dim` (torch.cat of two tensors; chain it for more): equal extents on every
    other axis, one dtype."""
    a, b = _need_tensor("cat", "a", a), _need_tensor("cat", "b", b)
    what = f"cat({a.name}, {b.name})"
    d = norm_axis("cat", a, dim)
    if a.ndim != b.ndim or any(i != d and x != y for i, (x, y) in enumerate(zip(a.shape, b.shape))):
        raise ShapeError(f"{what}: shapes {a.shape} and {b.shape} must be equal on every axis but {d}, the one "
                         f"they join along")
    if a.dtype != b.dtype:
        raise DtypeError(f"{what}: dtypes {str(a.dtype).replace('torch.', '')} and "
                         f"{str(b.dtype).replace('torch.', '')} differ; cast one to the other's (fd.ops.cast)")
    n = a.shape[d] + b.shape[d]
    return [OutSpec(a.shape[:d] + (n,) + a.shape[d + 1:], a.dtype, a.axes[:d] + (str(n),) + a.axes[d + 1:])]


@op("expand", "view", lambda x, shape: x.expand(tuple(shape)), metadata_only=True, local_attrs=_local_shape,
    vjp=lambda ops, g, out, x, shape: {"x": sum_to(ops, g, x.shape)})
def expand(x, shape):
    """Broadcast axes of extent 1 to `shape` (-1 keeps an axis; new leading axes allowed), as torch.expand."""
    x = _need_tensor("expand", "x", x)
    shape = tuple(shape)
    if len(shape) < x.ndim:
        raise ShapeError(f"expand({x.name}): target {shape} has fewer axes than {x.name} {x.shape}")
    off = len(shape) - x.ndim
    out, names = list(shape[:off]), [str(e) for e in shape[:off]]
    if any(e < 0 for e in out):
        raise ShapeError(f"expand({x.name}): new leading axes need explicit extents, got {shape}")
    for i, (e, want) in enumerate(zip(x.shape, shape[off:])):
        if want == -1 or want == e:
            out.append(e)
            names.append(x.axes[i])
        elif e == 1:
            out.append(want)
            names.append(str(want))
        else:
            raise ShapeError(f"expand({x.name}): axis {i} has extent {e}; only extent-1 axes expand (to {want})")
    return [OutSpec(tuple(out), x.dtype, tuple(names))]


def _vjp_broadcast_in_dim(ops, g, out, x, shape, broadcast_dims):
    """g summed over the axes x did not fill (new, or broadcast from extent 1), reshaped to x"""
    spread = {i for i in range(len(shape)) if i not in broadcast_dims}
    spread |= {d for i, d in enumerate(broadcast_dims) if x.shape[i] != shape[d]}
    s = ops.sum(g, tuple(sorted(spread)), keepdim=True) if spread else g
    return {"x": s if tuple(s.shape) == tuple(x.shape) else ops.reshape(s, x.shape)}


@op("broadcast_in_dim", "view", lambda x, shape, broadcast_dims:
    x.reshape([x.shape[broadcast_dims.index(i)] if i in broadcast_dims else 1 for i in range(len(shape))]).expand(tuple(shape)),
    metadata_only=True, local_attrs=_local_shape, vjp=_vjp_broadcast_in_dim)
def broadcast_in_dim(x, shape, broadcast_dims):
    """Place x's axis i at output axis broadcast_dims[i] and broadcast the rest to `shape` (as JAX/nvFuser)."""
    x = _need_tensor("broadcast_in_dim", "x", x)
    shape, bdims = tuple(shape), tuple(broadcast_dims)
    if len(bdims) != x.ndim or list(bdims) != sorted(set(bdims)) or any(not 0 <= d < len(shape) for d in bdims):
        raise ShapeError(f"broadcast_in_dim({x.name}): broadcast_dims {bdims} must list, in increasing order, "
                         f"one output axis of {shape} per axis of {x.name} {x.shape}")
    names = [str(e) for e in shape]
    for i, d in enumerate(bdims):
        if x.shape[i] not in (1, shape[d]):
            raise ShapeError(f"broadcast_in_dim({x.name}): axis {i} of extent {x.shape[i]} cannot go to output "
                             f"axis {d} of extent {shape[d]}")
        if x.shape[i] == shape[d]:
            names[d] = x.axes[i]
    return [OutSpec(shape, x.dtype, tuple(names))]


# ------------------------------------------------------------------ constants

@op("full", "constant", lambda shape=(), value=0.0, dtype=None, device=None: torch.full(
        tuple(shape), value, dtype=canonical_dtype(dtype), device=device),
    local_attrs=lambda args, outs: {"shape": outs[0]}, vjp=lambda ops, g, out, **_: {})
def full(shape: tuple = (), value: float = 0.0, dtype=torch.float32):
    """A tensor of `shape` holding `value` everywhere (torch.full): it reads nothing, so every rank makes its
    own shard of it, and nothing is computed from another tensor (ed.grad seeds d loss / d loss with it).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     fd.add_output(fd.ops.full((2, 3), 0.5, "float64"), name="half")
    >>> ed.evaluate(fd, {})["half"]
    tensor([[0.5000, 0.5000, 0.5000],
            [0.5000, 0.5000, 0.5000]], dtype=torch.float64)
    """
    if not isinstance(shape, (tuple, list)) or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0
                                                     for e in shape):
        raise ShapeError(f"full: shape must be a tuple of extents, got {shape!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ShapeError(f"full: value must be a number, got {value!r}")
    try:
        dt = canonical_dtype(dtype)
    except DtypeError as e:
        raise DtypeError(f"full({tuple(shape)}, {value!r}): {e}") from None
    return [OutSpec(tuple(shape), dt, tuple(str(e) for e in shape))]


# ------------------------------------------------------------------ random: dropout
# A counter-based stream: the bits of an element are a hash of (seed, offset + its flat index in the logical
# tensor), so a single device, every rank of every plan and every layout draw the same mask, and nothing is
# saved for the backward (it hashes again). The hash is 32-bit arithmetic held in int64 (products < 2**48,
# never a signed overflow), made of torch integer ops that give the same bits on CPU and GPU.

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32) and c in [2**31, 2**32): with c = 2**31 + c', x * 2**31 mod 2**32
    is x's low bit moved to bit 31, so the one product, x * c', stays below 2**63 (no signed overflow)."""
    assert 2 ** 31 <= c < 2 ** 32
    return (x * (c - 2 ** 31)).add_((x & 1) << 31).bitwise_and_(_M32)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer: a bijection of [0, 2**32) whose every output bit depends on every input
    bit. Takes h over (updates it in place where it can)."""
    h = h.bitwise_xor_(h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h.bitwise_xor_(h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h.bitwise_xor_(h >> 16)


def random_bits(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """32 random bits (an int64 in [0, 2**32)) per counter, from an int64 seed: two keys k0, k1 are mixed
    from the seed's low and high words; bits = fmix32(fmix32(lo ^ k0) ^ hi ^ k1) of the counter's words.
    For one seed, counters below 2**32 give distinct values (fmix32 is a bijection); another seed gives
    another stream.

    >>> import torch
    >>> bits = random_bits(torch.tensor(7), torch.arange(4))
    >>> bits.dtype, bool(((bits >= 0) & (bits < 2**32)).all()), len(set(bits.tolist()))
    (torch.int64, True, 4)
    >>> torch.equal(bits, random_bits(torch.tensor(7), torch.arange(4))), torch.equal(bits, random_bits(torch.tensor(8), torch.arange(4)))
    (True, False)
    """
    seed = seed.to(torch.int64)
    k0 = _fmix32((seed & _M32) ^ 0x9E3779B9)
    k1 = _fmix32(((seed >> 32) & _M32) ^ k0 ^ 0x7F4A7C15)
    return _fmix32(_fmix32((counter & _M32).bitwise_xor_(k0)).bitwise_xor_((counter >> 32) ^ k1))


def keep_threshold(p: float) -> int:
    """An element is kept where its bits are >= this: round(p * 2**32), so P(keep) = 1 - p to 2**-33.

    >>> keep_threshold(0.0), keep_threshold(0.5), keep_threshold(1.0)
    (0, 2147483648, 4294967296)
    """
    return min(round(p * 2 ** 32), 2 ** 32)


def global_counters(shape, starts, offset: int, device=None) -> torch.Tensor:
    """offset + the flat (row-major) index in a tensor of the global `shape` of every element of the block
    whose first element sits at `starts` (one start per axis) and whose extents are those of the block:
    `shape` here is (global shape, block shape).

    >>> global_counters(((4, 6), (2, 3)), (2, 3), 100)  # rows 2-3, columns 3-5 of a 4 x 6 tensor
    tensor([[115, 116, 117],
            [121, 122, 123]])
    """
    full, block = shape
    counters = torch.full((), offset, dtype=torch.int64, device=device)
    stride = 1
    for axis in reversed(range(len(full))):
        idx = torch.arange(starts[axis], starts[axis] + block[axis], dtype=torch.int64, device=device) * stride
        counters = counters + idx.reshape([-1 if a == axis else 1 for a in range(len(full))])
        stride *= full[axis]
    return counters


def dropout_mask(seed: torch.Tensor, p: float, counters: torch.Tensor) -> torch.Tensor:
    """The keep-mask (bool) of dropout at these counters: random_bits(seed, counter) >= keep_threshold(p).

    >>> import torch
    >>> keep = dropout_mask(torch.tensor(3), 0.25, torch.arange(100_000))
    >>> round(keep.float().mean().item(), 2)
    0.75
    """
    return random_bits(seed.to(counters.device), counters) >= keep_threshold(p)


def _dropout_apply(x, seed, p, counters):
    """x * mask / (1 - p), as torch's dropout multiplies (0 where p = 1)."""
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * (dropout_mask(seed, p, counters).to(x.dtype) * scale)


def _dropout_ref(x, seed, p=0.5, offset=0):
    return _dropout_apply(x, seed, p, global_counters((tuple(x.shape), tuple(x.shape)), (0,) * x.ndim, offset,
                                                      x.device))


def _dropout_global_index(args, operands, outputs, ctx, axes):
    """dropout of the rank's shard: its elements' counters are their flat indices in the global tensor (each
    axis offset by where the rank's shard starts), so every rank draws the mask one device would"""
    out, x = outputs[0], args["x"]
    starts = [ctx.shard_range(out.shape[a], out.layout, a)[0] for a in range(len(out.shape))]
    counters = global_counters((tuple(out.shape), tuple(x.shape)), starts, args.get("offset", 0), x.device)
    return _dropout_apply(x, args["seed"], args.get("p", 0.5), counters)


DROPOUT_GLOBAL_INDEX = LocalKernel("global_index", _dropout_global_index)


def _vjp_dropout(ops, g, out, x, seed, p=0.5, offset=0):
    """g * mask / (1 - p): the same mask, hashed again from the same seed and offset (nothing is saved)"""
    return {"x": ops.dropout(g, seed, p, offset)}


def _dropout_flops(ins, outs, args) -> float:
    """About 30 integer operations per element (the hash) and the multiply."""
    return 32.0 * math.prod(outs[0])


@op("dropout", "random", _dropout_ref, local_kernels=(DROPOUT_GLOBAL_INDEX,), vjp=_vjp_dropout,
    flops=_dropout_flops)
def dropout(x, seed, p: float = 0.5, offset: int = 0):
    """Dropout in training mode: x * mask / (1 - p), an element kept where the hash of (seed, offset + its
    flat index in x) is at least p of the 32-bit range (random_bits, keep_threshold). `seed` is a 0-d int64
    tensor input (replays and CUDA graphs advance it, never a constant baked in); `offset` separates the
    streams of several dropouts that read one seed. Any sharding draws the single-device mask.

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, seed = fd.define_tensor((2, 4), name="x"), fd.define_tensor((), torch.int64, name="rng.seed")
    ...     fd.add_output(fd.ops.dropout(x, seed, 0.5), name="y")
    >>> y = ed.evaluate(fd, {"x": torch.ones(2, 4), "rng.seed": torch.tensor(1)})["y"]
    >>> sorted(set(y.flatten().tolist()))  # dropped, or kept and scaled by 1 / (1 - p)
    [0.0, 2.0]
    """
    x = _need_tensor("dropout", "x", x)
    _need_float("dropout", x)
    if not _is_tensor(seed) or seed.shape != () or seed.dtype != torch.int64:
        got = f"{seed.name}, {str(seed.dtype).replace('torch.', '')} of shape {seed.shape}" if _is_tensor(seed) \
            else f"the {type(seed).__name__} {seed!r:.40}"
        raise DtypeError(f"dropout({x.name}): seed must be a 0-d int64 tensor input of the fusion, got {got}; "
                         f"define it (fd.define_tensor((), torch.int64, name='rng.seed')) and feed a new value "
                         f"each step")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
        raise ShapeError(f"dropout({x.name}): p must be a probability in [0, 1], got {p!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ShapeError(f"dropout({x.name}): offset must be an int >= 0 (where its stream starts), got {offset!r}")
    return [OutSpec(x.shape, x.dtype, x.axes)]


# ------------------------------------------------------------------ opaque: an ATen op egraph-did does not map

def aten_overload(target: str):
    """The ATen overload called `target` ('aten.flip.default'), or a ShapeError naming it.

    >>> aten_overload("aten.flip.default") is torch.ops.aten.flip.default
    True
    """
    ns, _, rest = target.partition(".")
    name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
    except (AttributeError, RuntimeError):
        raise ShapeError(f"opaque: {target!r} is no ATen op of this torch ({torch.__version__}); an opaque step "
                         f"names one as namespace.op.overload, e.g. 'aten.flip.default'") from None


def opaque_call(call: str, tensors) -> tuple[list, dict]:
    """The positional and keyword arguments of an opaque step's call: its JSON template with each
    {"tensor": i} replaced by the i-th tensor operand and each {"dtype": name} by the torch dtype.

    >>> opaque_call('{"args": [{"tensor": 0}, [0, 1]], "kwargs": {"dtype": {"dtype": "float32"}}}', ["x"])
    (['x', [0, 1]], {'dtype': torch.float32})
    """
    def fill(v):
        if isinstance(v, dict) and set(v) == {"tensor"}:
            return tensors[v["tensor"]]
        if isinstance(v, dict) and set(v) == {"dtype"}:
            return getattr(torch, v["dtype"])
        if isinstance(v, list):
            return [fill(x) for x in v]
        return v
    spec = json.loads(call)
    return fill(spec.get("args", [])), {k: fill(v) for k, v in spec.get("kwargs", {}).items()}


def _opaque_ref(a, b=None, c=None, d=None, target="", call="{}", shape=(), dtype=None, source=""):
    args, kwargs = opaque_call(call, [t for t in (a, b, c, d) if t is not None])
    out = aten_overload(target)(*args, **kwargs)
    want_dtype = canonical_dtype(dtype)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != want_dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ShapeError(f"opaque {target} ({source}): gave {got}, but export recorded {tuple(shape)} {want_dtype}")
    return out


def _vjp_opaque(ops, g, out, a, b=None, c=None, d=None, target="", call="{}", shape=(), dtype=None, source=""):
    """The gradient of each floating operand: an opaque_grad step, torch's autograd of the same call."""
    tensors = [t for t in (a, b, c, d) if t is not None]
    return {name: ops.opaque_grad(*tensors, g=g, target=target, call=call, wrt=i, source=source)
            for i, (name, t) in enumerate(zip("abcd", tensors)) if t.dtype in FLOAT_DTYPES}


@op("opaque", "opaque", _opaque_ref, vjp=_vjp_opaque)
def opaque(a, b=None, c=None, d=None, target: str = "", call: str = "{}", shape: tuple = (), dtype=None,
           source: str = ""):
    """An ATen op with no fusion mapping, run as torch runs it (`target`, e.g. 'aten.flip.default') on its
    whole operands (up to 4 tensors a..d; `call`: the JSON of its arguments, see opaque_call), giving one
    tensor of the `shape` and `dtype` export recorded; `source` is its line in the model. Every rank runs
    it on replicated operands: no sharding rule applies but `replicated`. from_torch emits it.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((2, 3), name="x")
    ...     y = fd.ops.opaque(x, target="aten.flip.default", call='{"args": [{"tensor": 0}, [1]]}',
    ...                       shape=(2, 3), dtype="float32", source="model.py:7")
    ...     fd.add_output(y, name="y")
    >>> ed.evaluate(fd, {"x": torch.tensor([[1., 2., 3.], [4., 5., 6.]])})["y"]
    tensor([[3., 2., 1.],
            [6., 5., 4.]])
    """
    tensors = [t for t in (a, b, c, d) if t is not None]
    if not tensors or not all(_is_tensor(t) for t in tensors):
        raise ShapeError(f"opaque {target}: its operands a..d must be tensors of the fusion (at least a)")
    aten_overload(target)
    try:
        spec = json.loads(call)
    except (TypeError, ValueError):
        raise ShapeError(f"opaque {target}: call must be the JSON of the op's arguments, got {call!r:.60}") from None
    if not isinstance(spec, dict) or set(spec) - {"args", "kwargs"}:
        raise ShapeError(f"opaque {target}: call must be a JSON object with 'args' and 'kwargs', got {call!r:.60}")
    if not isinstance(shape, (tuple, list)) or not all(isinstance(e, int) and e >= 0 for e in shape):
        raise ShapeError(f"opaque {target}: shape must be the output's extents, got {shape!r}")
    shape = tuple(shape)
    same = next((t for t in tensors if t.shape == shape), None)  # flip, roll, ...: the operand's axes
    return [OutSpec(shape, canonical_dtype(dtype), same.axes if same else tuple(str(e) for e in shape))]


def _opaque_grad_ref(a, b=None, c=None, d=None, g=None, target="", call="{}", wrt=0, source=""):
    tensors = [t for t in (a, b, c, d) if t is not None]
    leaves = [t.detach().requires_grad_(i == wrt) for i, t in enumerate(tensors)]
    with torch.enable_grad():
        args, kwargs = opaque_call(call, leaves)
        out = aten_overload(target)(*args, **kwargs)
        if not out.requires_grad:  # torch treats this operand as a constant of the call (an index, a count)
            return torch.zeros_like(tensors[wrt])
        try:
            (grad,) = torch.autograd.grad(out, leaves[wrt], g.to(out.dtype), allow_unused=True)
        except RuntimeError as e:  # a derivative torch does not implement: say which step, and where
            raise ShapeError(f"opaque_grad {target} ({source}): torch cannot differentiate it ({e}); map the op "
                             f"in egraph_did/frontend.py onto fd.ops, or take no gradient through it") from None
    return torch.zeros_like(tensors[wrt]) if grad is None else grad


@op("opaque_grad", "opaque", _opaque_grad_ref,
    no_grad="the gradient of an opaque step: a second derivative through an ATen op egraph-did does not map "
            "is not supported; map the op in egraph_did/frontend.py (onto fd.ops)")
def opaque_grad(a, b=None, c=None, d=None, g=None, target: str = "", call: str = "{}", wrt: int = 0,
                source: str = ""):
    """The gradient of an opaque step's output with respect to its operand number `wrt` (among a..d),
    given the output's cotangent `g`: torch's autograd of the same ATen call, run on whole operands like
    the step itself (every rank, replicated). ed.grad emits it as the opaque step's vjp.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, g = fd.define_tensor((2, 3), name="x"), fd.define_tensor((2, 3), name="g")
    ...     fd.add_output(fd.ops.opaque_grad(x, g=g, target="aten.flip.default",
    ...                                      call='{"args": [{"tensor": 0}, [1]]}'), name="dx")
    >>> ed.evaluate(fd, {"x": torch.zeros(2, 3), "g": torch.tensor([[1., 2., 3.], [4., 5., 6.]])})["dx"]
    tensor([[3., 2., 1.],
            [6., 5., 4.]])
    """
    tensors = [t for t in (a, b, c, d) if t is not None]
    if not tensors or not all(_is_tensor(t) for t in tensors) or not _is_tensor(g):
        raise ShapeError(f"opaque_grad {target}: its operands a..d and the cotangent g must be tensors of the fusion")
    aten_overload(target)
    if not isinstance(wrt, int) or not 0 <= wrt < len(tensors) or tensors[wrt].dtype not in FLOAT_DTYPES:
        raise ShapeError(f"opaque_grad {target}: wrt must number a floating operand among the {len(tensors)} given, "
                         f"got {wrt!r}")
    x = tensors[wrt]
    return [OutSpec(x.shape, x.dtype, x.axes)]


# ------------------------------------------------------------------ literal arguments

_LITERALS = {"bool": ((bool,), "a bool (True or False)"), "int": ((int,), "an int"),
             "float": ((int, float), "a number"), "float | None": ((int, float, type(None)), "a number or None"),
             "str": ((str,), "a string")}


def check_literals(opdef: OpDef, arguments: dict) -> None:
    """ShapeError unless every non-tensor argument with a declared type (keepdim: bool, eps: float, ...)
    has it: keepdim="yes" would otherwise read as True, eps="1e-5" fail deep in a kernel.

    >>> check_literals(OPS["sum"], {"x": None, "dims": 1, "keepdim": "yes"})
    Traceback (most recent call last):
    ...
    egraph_did.errors.ShapeError: sum: keepdim must be a bool (True or False), got the str 'yes'
    """
    for name, p in opdef.signature.parameters.items():
        spec = _LITERALS.get(p.annotation) if isinstance(p.annotation, str) else None
        if spec is None or name not in arguments:
            continue
        v, (types, what) = arguments[name], spec
        if types == (int,) and hasattr(v, "__index__") and not isinstance(v, bool):
            continue  # numpy integers
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise ShapeError(f"{opdef.name}: {name} must be {what}, got the {type(v).__name__} {v!r:.40}")


# ------------------------------------------------------------------ index ranges (checked on data)

def check_indices(op_name: str, args: dict, names: dict, shapes: dict, where: str = "") -> None:
    """ShapeError if the index tensor of an indexing op (embedding, take_along_axis, cross_entropy) holds
    a value outside [0, n) of the axis it indexes, instead of torch's IndexError that names no tensor.
    args: parameter -> tensor or literal (tensors may be one rank's shards: indices are global ids);
    names: parameter -> tensor name; shapes: parameter -> the global shape.

    >>> import torch
    >>> check_indices("embedding", {"indices": torch.tensor([0, 7]), "weight": torch.zeros(5, 2)},
    ...               {"indices": "ids", "weight": "wte"}, {"weight": (5, 2)})
    Traceback (most recent call last):
    ...
    egraph_did.errors.ShapeError: embedding(ids, wte): ids holds 7 (at [1]), but wte has 5 rows (axis 0); every index must lie in [0, 5): fix ids, or give wte more rows
    """
    opdef = OPS.get(op_name)
    spec = opdef.indexes if opdef else None
    if spec is None:
        return
    ip, tp, axis, what = spec.index, spec.table, spec.axis, spec.counts
    idx = args.get(ip)
    if not isinstance(idx, torch.Tensor) or idx.numel() == 0 or idx.device.type == "meta":
        return
    shape = shapes[tp]
    d = args[axis] if isinstance(axis, str) else axis
    d = d % len(shape)
    n = shape[d]
    bad = (idx < 0) | (idx >= n)
    if spec.skip is not None and args.get(spec.skip) is not None:
        bad &= idx != args[spec.skip]
    if not bool(bad.any()):
        return
    pos = [int(i) for i in bad.nonzero()[0]]
    val = int(idx[tuple(pos)])
    fix = spec.fix.format(index=names[ip], table=names[tp])
    what = f"{what} {d}" if what.endswith("axis") else f"{what} (axis {d})"
    order = ", ".join(names[p] for p in OPS[op_name].signature.parameters if p in names)
    raise ShapeError(f"{op_name}({order}): {names[ip]} holds {val} (at {pos}{where}), but {names[tp]} has {n} "
                     f"{what}; every index must lie in [0, {n}): {fix}")


def op_names() -> list[str]:
    """Every registered op."""
    return sorted(OPS)


# The indexing ops by name (for callers that test membership; OPS[op].indexes is the fact).
INDEX_ARGS = {n: d.indexes for n, d in OPS.items() if d.indexes is not None}

__all__ = ["OPS", "OpDef", "LocalKernel", "Indexing", "TensorSpec", "OutSpec", "op", "ops_where", "canonical_dtype",
           "op_names", "check_indices", "check_literals", "random_bits", "keep_threshold", "global_counters",
           "dropout_mask"]
