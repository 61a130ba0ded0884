"""The reference evaluator: run a fusion on one device with torch eager. Ground truth for every numeric
test; and `decompose`, which rewrites composites (layer_norm, softmax, gelu, sdpa, ...) into primitives.
"""
from __future__ import annotations

import inspect

from typing import Mapping

import torch

from .errors import DtypeError, ShapeError
from .fusion import Fusion, FusionDefinition, as_fusion, replay
from .ir import TensorView
from .ops import check_indices, complex_message


def check_inputs(fusion: Fusion, inputs: Mapping[str, torch.Tensor]) -> None:
    """Every input some output reads present, of the declared shape and dtype; nothing unknown. An input no
    output reads (Fusion.unread_inputs) may be given or left out, and is ignored (as simulate and plan.run do).

    >>> import torch
    >>> from egraph_did.models import row_sum
    >>> check_inputs(row_sum(2, 3).fusion, {"x": torch.zeros(2, 3)})  # fine: nothing to say
    >>> check_inputs(row_sum(2, 3).fusion, {"x": torch.zeros(3, 2)})
    Traceback (most recent call last):
    ...
    egraph_did.errors.ShapeError: input 'x': declared shape (2, 3), got (3, 2); pass a tensor of the declared shape (or declare define_tensor((3, 2), ...))
    """
    names = [t.name for t in fusion.inputs]
    if not isinstance(inputs, Mapping):
        raise ShapeError(f"inputs must be a dict {{input name: tensor}} over {names}, got a {type(inputs).__name__}")
    unknown = sorted((k for k in inputs if k not in names), key=str)
    if unknown:
        raise ShapeError(f"unknown input(s) {unknown}; the fusion's inputs are {names}; drop the extra key(s) or "
                         f"fix their names")
    unread = set(fusion.unread_inputs())
    for tv in fusion.inputs:
        if tv.name in unread:
            continue
        if tv.name not in inputs:
            raise ShapeError(f"missing input {tv.name!r} of shape {tv.shape}; the fusion's inputs are {names} "
                             f"(an input no output reads may be left out: {sorted(unread)})")
        val = inputs[tv.name]
        if not isinstance(val, torch.Tensor):
            raise ShapeError(f"input {tv.name!r}: expected a torch.Tensor, got {type(val).__name__}; convert it "
                             f"(torch.as_tensor(value, dtype={tv.dtype}))")
        if tuple(val.shape) != tv.shape:
            raise ShapeError(f"input {tv.name!r}: declared shape {tv.shape}, got {tuple(val.shape)}; pass a tensor "
                             f"of the declared shape (or declare define_tensor({tuple(val.shape)}, ...))")
        if val.dtype != tv.dtype and val.dtype.is_complex:
            raise DtypeError(f"input {tv.name!r}: declared dtype {tv.dtype}, got {complex_message(val.dtype)}")
        if val.dtype != tv.dtype:
            raise DtypeError(f"input {tv.name!r}: declared dtype {tv.dtype}, got {val.dtype}; "
                             f"cast it or declare define_tensor(..., dtype={val.dtype})")


def run_expr(expr, env: dict[int, torch.Tensor], device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """Evaluate one expr's reference on tensors looked up in env (by TensorView id).

    >>> import torch
    >>> from egraph_did.models import row_sum
    >>> fusion = row_sum(2, 3).fusion
    >>> run_expr(fusion.exprs[0], {id(fusion["x"]): torch.ones(2, 3)})
    (tensor([3., 3.]),)
    """
    kwargs = {k: env[id(v)] if isinstance(v, TensorView) else v for k, v in expr.args}
    tensors = {k: v for k, v in expr.args if isinstance(v, TensorView)}
    if device is not None and not tensors and "device" in inspect.signature(expr.op.reference).parameters:
        kwargs["device"] = device  # a constant reads no tensor: make it where the inputs are
    check_indices(expr.op.name, kwargs, {k: v.name for k, v in tensors.items()},
                  {k: v.shape for k, v in tensors.items()})
    out = expr.op.reference(**kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def evaluate(fd: FusionDefinition | Fusion, inputs: Mapping[str, torch.Tensor],
             decompose_composites: bool = False) -> dict[str, torch.Tensor]:
    """Run the fusion on one device with torch eager; returns {output name: tensor}. An input no output
    reads (fusion.unread_inputs()) may be given or left out: it is ignored, as ed.simulate and plan.run do.

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((2,), name="x")
    ...     fd.add_output(fd.ops.mul(x, 3.0), name="y")
    >>> ed.evaluate(fd, {"x": torch.tensor([1., 2.])})["y"]
    tensor([3., 6.])
    >>> u = fd.define_tensor((5,), name="u")  # read by no output: it may be left out, or given and ignored
    >>> ed.evaluate(fd, {"x": torch.tensor([1., 2.]), "u": torch.zeros(5)})["y"]
    tensor([3., 6.])
    """
    fusion = as_fusion(fd, "evaluate")
    if not fusion.outputs:
        raise ShapeError("the fusion has no outputs; call fd.add_output(tensor, name=...)")
    check_inputs(fusion, inputs)
    if decompose_composites:
        fusion, rename = decompose(fusion)
        inputs = {rename.get(k, k): v for k, v in inputs.items()}
    needed = fusion.needed()
    env: dict[int, torch.Tensor] = {id(tv): inputs[tv.name] for tv in fusion.inputs if tv.name in needed}
    device = next((t.device for t in inputs.values() if isinstance(t, torch.Tensor)), None)
    for expr in fusion.exprs:
        if not any(o.name in needed for o in expr.outputs):
            continue  # read by no output (it may read an input left out)
        outs = run_expr(expr, env, device)
        for tv, val in zip(expr.outputs, outs):
            if tuple(val.shape) != tv.shape or val.dtype != tv.dtype:
                raise AssertionError(f"{expr}: the shape rule says {tv.shape} {tv.dtype}, the reference gave "
                                     f"{tuple(val.shape)} {val.dtype}")
            env[id(tv)] = val
    return {name: env[id(tv)] for name, tv in fusion.outputs.items()}


def decompose(fd: FusionDefinition | Fusion) -> tuple[Fusion, dict[str, str]]:
    """Composites rewritten into primitives until none is left (see _decompose_once); returns (fusion,
    {old input name: new input name}).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((2, 3), name="x")
    ...     fd.add_output(fd.ops.gelu(x), name="y")  # exact gelu: x * Phi(x), Phi through erf
    >>> prim, _ = ed.decompose(fd)
    >>> [e.op.name for e in prim.exprs], list(prim.outputs)
    (['mul', 'mul', 'erf', 'add', 'mul'], ['y'])
    """
    fusion, names = _decompose_once(as_fusion(fd))
    for _ in range(8):
        left = [e.op.name for e in fusion.exprs if e.op.is_composite]
        if not left:
            return fusion, names
        fusion, _ = _decompose_once(fusion)
        if [e.op.name for e in fusion.exprs if e.op.is_composite] == left:
            return fusion, names  # what is left declines its decomposition (amin of integers)
    raise AssertionError("decompositions did not reach primitives in 8 rounds")  # pragma: no cover


def _decompose_once(fd: FusionDefinition | Fusion) -> tuple[Fusion, dict[str, str]]:
    """A new fusion in which every composite op is replaced by its primitives; input and output names are
    kept. Returns (fusion, {old input name: new input name}) — identical names today.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((2, 3), name="x")
    ...     fd.add_output(fd.ops.softmax(x), name="y")
    >>> prim, _ = ed.decompose(fd)
    >>> [e.op.name for e in prim.exprs]
    ['amax', 'sub', 'exp', 'sum', 'div']
    """
    src = as_fusion(fd)

    def expand(ops, expr, args):
        outs = expr.op.decompose(ops, **args) if expr.op.is_composite else None
        if outs is None:  # a primitive, or a composite whose decomposition declines these operands (amin of ints)
            outs = ops._fusion.emit(expr.op.name, **args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        assert len(outs) == len(expr.outputs), expr
        fixed = []
        for old, tv in zip(expr.outputs, outs):
            assert tv.shape == old.shape, f"decomposition of {expr} changed {old.name}'s shape"
            fixed.append(tv if tv.dtype == old.dtype else ops.cast(tv, old.dtype))
        return tuple(fixed)
    dst, ops, new = replay(src, expand)
    for name, tv in src.outputs.items():
        out = new[id(tv)]
        if out in dst.inputs and out.name == name:
            dst.add_output(out, name)  # an input passed through under its own name
            continue
        if out in dst.inputs or any(o is out for o in dst.outputs.values()):
            out = ops.cast(out, out.dtype)  # an input passed through, or one tensor under two names
        dst.add_output(out, name)
    return dst, {tv.name: tv.name for tv in src.inputs}
