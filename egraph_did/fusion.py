"""Fusion (the logical program, single-device semantics) and FusionDefinition, its builder.

>>> import torch, egraph_did as ed
>>> with ed.FusionDefinition() as fd:
...     x = fd.define_tensor((4, 8), name="x")
...     w = fd.define_tensor((16, 8), name="w")
...     fd.add_output(fd.ops.relu(fd.ops.linear(x, w)), name="y")
>>> [str(e) for e in fd.fusion.exprs]
['linear_0 = linear(x, w)', 'y = relu(linear_0)']
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from .errors import PlanError, ShapeError, UnknownNameError
from .ir import TensorView
from .ops import OPS, OpDef, TensorSpec, canonical_dtype, check_literals

# Every TensorView ever built, so a test can check that no logical domain carries a device axis.
ALL_TENSORS: "weakref.WeakSet[TensorView]" = weakref.WeakSet()


@dataclass(frozen=True)
class Expr:
    """One op application: `outputs = op(args)`. args keeps every bound argument by parameter name;
    tensor arguments are TensorViews, the rest literals.

    >>> from egraph_did.models import mlp
    >>> e = mlp(tokens=8, hidden=16).fusion.exprs[1]
    >>> str(e), [t.name for t in e.inputs], e.attrs
    ('gelu_1 = gelu(linear_0)', ['linear_0'], {'approximate': 'none'})
    """

    op: OpDef
    args: tuple[tuple[str, Any], ...]
    outputs: tuple[TensorView, ...]

    @property
    def inputs(self) -> tuple[TensorView, ...]:
        """The tensor operands, in argument order."""
        return tuple(v for _, v in self.args if isinstance(v, TensorView))

    @property
    def attrs(self) -> dict[str, Any]:
        """The non-tensor arguments."""
        return {k: v for k, v in self.args if not isinstance(v, TensorView)}

    @property
    def output(self) -> TensorView:
        """The only output (an op with several outputs has none)."""
        assert len(self.outputs) == 1, f"{self.op.name} has {len(self.outputs)} outputs"
        return self.outputs[0]

    def __str__(self) -> str:
        def show(v):
            return v.name if isinstance(v, TensorView) else repr(v)
        params = list(self.op.signature.parameters.values())
        parts = []
        for p, (k, v) in zip(params, self.args):
            if isinstance(v, TensorView) or p.default is inspect.Parameter.empty:
                parts.append(show(v))
            elif v != p.default:
                parts.append(f"{k}={show(v)}")
        outs = ", ".join(o.name for o in self.outputs)
        return f"{outs} = {self.op.name}({', '.join(parts)})"


class Fusion:
    """A DAG of ops over TensorViews, in definition (topological) order.

    >>> from egraph_did.models import mlp
    >>> fusion = mlp(tokens=8, hidden=16).fusion
    >>> print(fusion)
    inputs: x[8, 16], w1[64, 16], w2[16, 64]
      linear_0 = linear(x, w1)
      gelu_1 = gelu(linear_0)
      y = linear(gelu_1, w2)
    outputs: y
    >>> str(fusion.producer(fusion["y"])), [str(e) for e in fusion.consumers(fusion["x"])]
    ('y = linear(gelu_1, w2)', ['linear_0 = linear(x, w1)'])
    """

    def __init__(self):
        self.inputs: list[TensorView] = []
        self.exprs: list[Expr] = []
        self.outputs: dict[str, TensorView] = {}
        self.tensors: dict[str, TensorView] = {}
        self._producer: dict[int, Expr] = {}
        self._counter = 0

    # ------------------------------------------------------------ building
    def _fresh_name(self, base: str) -> str:
        while True:
            name = f"{base}_{self._counter}"
            self._counter += 1
            if name not in self.tensors:
                return name

    def _add_tensor(self, tv: TensorView) -> TensorView:
        if tv.name in self.tensors:
            raise ShapeError(f"a tensor named {tv.name!r} already exists in this fusion; pick another name")
        self.tensors[tv.name] = tv
        ALL_TENSORS.add(tv)
        return tv

    def define_tensor(self, shape: Sequence[int], dtype=torch.float32, name: str | None = None,
                      axis_names: Sequence[str] | None = None) -> TensorView:
        """A new input of the given logical shape (see FusionDefinition.define_tensor)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        label = name or f"input {len(self.inputs)}"
        for i, e in enumerate(shape):
            if not isinstance(e, int) or isinstance(e, bool) or e < 0:
                raise ShapeError(f"define_tensor({label}): axis {i} has extent {e!r}; extents are non-negative ints")
        if axis_names is not None and len(axis_names) != len(shape):
            raise ShapeError(f"define_tensor({label}): {len(axis_names)} axis names for {len(shape)} axes; give "
                             f"one name per axis")
        if name is not None and (not isinstance(name, str) or not name):
            raise ShapeError(f"define_tensor: name must be a non-empty string, got {name!r}")
        try:
            dt = canonical_dtype(dtype)
        except ShapeError as e:
            raise type(e)(f"define_tensor({label}): {e}") from None
        tv = TensorView(name or self._fresh_name("in"), shape, dt, axis_names, self)
        self.inputs.append(self._add_tensor(tv))
        return tv

    def emit(self, op_name: str, *args, **kwargs):
        """Apply a registered op; returns its output TensorView (or a tuple for several outputs)."""
        opdef = OPS.get(op_name)
        if opdef is None:
            raise UnknownNameError(f"unknown op {op_name!r}{_did_you_mean(op_name, OPS)}; known ops: "
                                   f"{', '.join(sorted(OPS))}")
        try:
            bound = opdef.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ShapeError(f"{op_name}: {e}") from None
        bound.apply_defaults()
        check_literals(opdef, bound.arguments)
        for k, v in bound.arguments.items():
            if isinstance(v, TensorView) and v.fusion is not self:
                raise ShapeError(f"{op_name}: argument {k} ({v.name}) belongs to another fusion")
        specs = {k: (TensorSpec(v.name, v.shape, v.dtype, tuple(d.name for d in v.logical_domain))
                     if isinstance(v, TensorView) else v)
                 for k, v in bound.arguments.items()}
        outs = opdef.infer(**specs)
        tvs = tuple(self._add_tensor(TensorView(self._fresh_name(op_name), o.shape, o.dtype, o.axes, self))
                    for o in outs)
        expr = Expr(opdef, tuple(bound.arguments.items()), tvs)
        self.exprs.append(expr)
        for tv in tvs:
            self._producer[id(tv)] = expr
        return tvs[0] if len(tvs) == 1 else tvs

    def add_output(self, tv: TensorView, name: str | None = None) -> TensorView:
        """Mark tv as an output, renamed to `name` if given; returns tv."""
        if not isinstance(tv, TensorView) or tv.fusion is not self:
            raise ShapeError(f"add_output: {tv!r} is not a tensor of this fusion")
        name = name or tv.name
        for other, t in self.outputs.items():
            if t is tv:
                raise ShapeError(f"add_output: {tv.name} is already the output {other!r}; "
                                 f"output a copy (fd.ops.cast(t, t.dtype)) under a second name")
        if name in self.outputs:
            raise ShapeError(f"add_output: an output named {name!r} already exists; pick another name")
        if name != tv.name:
            if tv in self.inputs:
                raise ShapeError(f"add_output: {tv.name} is an input; it is output under its own name only")
            if name in self.tensors:
                raise ShapeError(f"add_output: the name {name!r} is taken by another tensor of this fusion")
            del self.tensors[tv.name]
            tv.name = name
            self.tensors[name] = tv
        self.outputs[name] = tv
        return tv

    # ------------------------------------------------------------ queries
    def producer(self, tv: TensorView) -> Expr | None:
        """The expr that computes tv (None for an input)."""
        return self._producer.get(id(tv))

    def consumers(self, tv: TensorView) -> list[Expr]:
        """The exprs that read tv, in order."""
        return [e for e in self.exprs if any(i is tv for i in e.inputs)]

    def needed(self) -> set[str]:
        """The names of the tensors some output reads: the outputs and everything they are computed from.

        >>> import egraph_did as ed
        >>> with ed.FusionDefinition() as fd:
        ...     x = fd.define_tensor((4,), name="x")
        ...     u = fd.define_tensor((4,), name="u")
        ...     dead = fd.ops.exp(u)  # read by no output
        ...     fd.add_output(fd.ops.relu(x), name="y")
        >>> sorted(fd.fusion.needed())
        ['x', 'y']
        """
        need = {id(t) for t in self.outputs.values()}
        for e in reversed(self.exprs):
            if any(id(o) in need for o in e.outputs):
                need.update(id(t) for t in e.inputs)
        return {t.name for t in self.tensors.values() if id(t) in need}

    def unread_inputs(self) -> list[str]:
        """The inputs no output reads, in definition order. Every entry point (ed.evaluate, ed.simulate,
        plan.run) takes them or not and ignores them; a plan lists them as plan.unread.

        >>> import egraph_did as ed
        >>> with ed.FusionDefinition() as fd:
        ...     x = fd.define_tensor((4,), name="x")
        ...     u = fd.define_tensor((4,), name="u")
        ...     fd.add_output(fd.ops.relu(x), name="y")
        >>> fd.fusion.unread_inputs()
        ['u']
        """
        needed = self.needed()
        return [t.name for t in self.inputs if t.name not in needed]

    def all_tensors(self) -> Iterator[TensorView]:
        """Every tensor: inputs, intermediates and outputs."""
        return iter(self.tensors.values())

    def __getitem__(self, name: str) -> TensorView:
        if name not in self.tensors:
            raise UnknownNameError(f"no tensor named {name!r}{_did_you_mean(name, self.tensors)}; tensors are "
                                   f"{', '.join(self.tensors)}")
        return self.tensors[name]

    def __str__(self) -> str:
        lines = [f"inputs: {', '.join(f'{t.name}{list(t.shape)}' for t in self.inputs)}"]
        lines += [f"  {e}" for e in self.exprs]
        lines.append(f"outputs: {', '.join(self.outputs)}")
        return "\n".join(lines)


def _did_you_mean(name, known) -> str:
    """' (did you mean 'x'?)' for the closest known name, or ''."""
    import difflib
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Ops:
    """`fd.ops.NAME(...)`: every op of the op table, with the signature of its shape rule.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((4, 8), name="x")
    ...     y = fd.ops.sum(fd.ops.relu(x), 1)
    >>> str(fd.fusion.producer(y)), "softmax" in dir(fd.ops)
    ('sum_1 = sum(relu_0, dims=1)', True)
    """

    def __init__(self, fusion: Fusion):
        self._fusion = fusion

    def __getattr__(self, name: str):
        opdef = OPS.get(name)
        if opdef is None:
            if name.startswith("__"):  # copy, pickle and friends probe for dunders: plain AttributeError
                raise AttributeError(name)
            raise UnknownNameError(f"fd.ops has no op {name!r}{_did_you_mean(name, OPS)}; known ops: "
                                   f"{', '.join(sorted(OPS))}")
        fusion = self._fusion

        def apply(*args, **kwargs):
            return fusion.emit(name, *args, **kwargs)
        apply.__name__, apply.__doc__, apply.__signature__ = name, opdef.infer.__doc__, opdef.signature
        return apply

    def __dir__(self):
        return sorted(OPS)


class FusionDefinition:
    """Build a fusion once, as for one device.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((2, 3), name="x")
    ...     fd.add_output(fd.ops.exp(x), name="y")
    >>> fd.fusion.outputs["y"].shape
    (2, 3)
    """

    def __init__(self):
        self.fusion = Fusion()
        self.ops = Ops(self.fusion)

    def __enter__(self) -> "FusionDefinition":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        return None

    def define_tensor(self, shape: Sequence[int], dtype=torch.float32, name: str | None = None,
                      axis_names: Sequence[str] | None = None) -> TensorView:
        """A fusion input of the given logical shape; axis_names label axes in loop-domain strings."""
        return self.fusion.define_tensor(shape, dtype, name, axis_names)

    def add_output(self, tv: TensorView, name: str | None = None) -> None:
        """Mark tv as an output, renamed to `name` if given."""
        self.fusion.add_output(tv, name)

    def __getitem__(self, name: str) -> TensorView:
        return self.fusion[name]

    def __str__(self) -> str:
        return str(self.fusion)


def replay(src: Fusion, apply) -> tuple[Fusion, Ops, dict[int, TensorView]]:
    """A new fusion with src's inputs (same names and axes), then apply(ops, expr, args) for each of
    src's exprs, args holding the new tensors; apply returns the new output(s) of that expr. Returns
    (fusion, ops, {id(old tensor): new tensor}); outputs are left to the caller.

    >>> from egraph_did.models import mlp
    >>> same = lambda ops, e, args: ops._fusion.emit(e.op.name, **args)  # re-emit each op unchanged
    >>> dst, ops, new = replay(mlp(tokens=8, hidden=16).fusion, same)
    >>> [str(e) for e in dst.exprs]  # fresh names for the outputs, which the caller may rename
    ['linear_0 = linear(x, w1)', 'gelu_1 = gelu(linear_0)', 'linear_2 = linear(gelu_1, w2)']
    """
    dst = Fusion()
    ops = Ops(dst)
    new: dict[int, TensorView] = {}
    for tv in src.inputs:
        new[id(tv)] = dst.define_tensor(tv.shape, tv.dtype, tv.name, [d.name for d in tv.logical_domain])
    for e in src.exprs:
        outs = apply(ops, e, {k: new[id(v)] if isinstance(v, TensorView) else v for k, v in e.args})
        for old, tv in zip(e.outputs, outs if isinstance(outs, tuple) else (outs,)):
            new[id(old)] = tv
    return dst, ops, new


def as_fusion(f, where: str = "") -> Fusion:
    """A Fusion from a Fusion or a FusionDefinition; PlanError for anything else, `where` naming the call.

    >>> fd = FusionDefinition()
    >>> as_fusion(fd) is fd.fusion, as_fusion(fd.fusion) is fd.fusion
    (True, True)
    >>> as_fusion("fd", "evaluate")
    Traceback (most recent call last):
    ...
    egraph_did.errors.PlanError: evaluate: expected a FusionDefinition (or Fusion), got the str 'fd'; build one with `with ed.FusionDefinition() as fd: ...`
    """
    if isinstance(f, FusionDefinition):
        return f.fusion
    if isinstance(f, Fusion):
        return f
    hint = ("; a Plan runs with ed.simulate(plan, inputs) or plan.run(inputs)" if type(f).__name__ == "Plan"
            else "; build one with `with ed.FusionDefinition() as fd: ...`")
    raise PlanError(f"{where + ': ' if where else ''}expected a FusionDefinition (or Fusion), got the "
                    f"{type(f).__name__} {f!r:.40}{hint}")
