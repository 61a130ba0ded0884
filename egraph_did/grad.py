"""Reverse-mode differentiation of a fusion: `grad(fd, loss=..., wrt=[...])` is a new fusion that computes
the original outputs and, for each input in wrt, `grad_<input>`: the gradient of the scalar loss.

The backward is made of fusion ops, so the optimizer shards forward and backward together. Each op's
backward is its vjp in the op table (egraph_did/ops.py, beside the op); this module only walks the
program in reverse, adds the gradients of a tensor read twice and drops what no output needs.

>>> import torch, egraph_did as ed
>>> with ed.FusionDefinition() as fd:
...     x = fd.define_tensor((3,), name="x")
...     fd.add_output(fd.ops.sum(fd.ops.mul(x, x)), name="loss")
>>> gfd = ed.grad(fd, loss="loss", wrt=["x"])
>>> list(gfd.fusion.outputs)
['loss', 'grad_x']
>>> ed.evaluate(gfd, {"x": torch.tensor([1., 2., 3.])})["grad_x"]
tensor([2., 4., 6.])
"""
from __future__ import annotations

from typing import Sequence

from .errors import DtypeError, ShapeError, UnknownNameError
from .fusion import Fusion, FusionDefinition, Ops, _did_you_mean, as_fusion
from .ir import TensorView
from .ops import FLOAT_DTYPES, zeros_like

GRAD_PREFIX = "grad_"


def grad(fd: FusionDefinition | Fusion, loss: str, wrt: Sequence[str] | None = None) -> FusionDefinition:
    """A new fusion: fd's outputs, and `grad_<name>` (the gradient of the scalar output `loss`) for each
    input name in wrt (None: every floating-point input). An input the loss does not depend on gets
    zeros, as in JAX.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> fd = mlp(tokens=4, hidden=8)
    >>> fd.add_output(fd.ops.mean(fd.ops.mul(fd["y"], fd["y"])), name="loss")
    >>> gfd = ed.grad(fd, loss="loss", wrt=["w1", "w2"])
    >>> {n: t.shape for n, t in gfd.fusion.outputs.items()}
    {'y': (4, 8), 'loss': (), 'grad_w1': (32, 8), 'grad_w2': (8, 32)}
    """
    return _differentiate(as_fusion(fd, "grad"), loss, wrt, keep_outputs=True)


def value_and_grad(fd: FusionDefinition | Fusion, loss: str, wrt: Sequence[str] | None = None
                   ) -> FusionDefinition:
    """As grad, but the new fusion outputs the loss and the gradients only (fd's other outputs are not
    computed unless a gradient needs them).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((3,), name="x")
    ...     fd.add_output(fd.ops.exp(x), name="e")
    ...     fd.add_output(fd.ops.sum(x), name="loss")
    >>> list(ed.value_and_grad(fd, loss="loss").fusion.outputs)
    ['loss', 'grad_x']
    """
    return _differentiate(as_fusion(fd, "value_and_grad"), loss, wrt, keep_outputs=False)


# ---------------------------------------------------------------------- checks


def _check(src: Fusion, loss: str, wrt, where: str) -> list[str]:
    """The wrt names, checked: loss a floating-point scalar output, each wrt a floating-point input."""
    outs = list(src.outputs)
    if not isinstance(loss, str) or loss not in src.outputs:
        hint = _did_you_mean(loss, outs) if isinstance(loss, str) else ""
        also = (f"; {loss!r} is a tensor of the fusion but not an output: fd.add_output it first"
                if isinstance(loss, str) and loss in src.tensors else "")
        raise UnknownNameError(f"{where}: loss={loss!r} is not an output of the fusion{hint}{also}; pass the "
                               f"name of a scalar output: one of {outs}")
    lt = src.outputs[loss]
    if lt.shape != ():
        raise ShapeError(f"{where}: the loss {loss!r} has shape {lt.shape}; a gradient needs a scalar loss (shape "
                         f"()): output a reduction of it, e.g. fd.add_output(fd.ops.sum({loss}), name='loss'), "
                         f"and pass that name")
    if lt.dtype not in FLOAT_DTYPES:
        raise DtypeError(f"{where}: the loss {loss!r} is {_dt(lt.dtype)}; a gradient needs a floating-point "
                         f"loss: cast it (fd.ops.cast({loss}, torch.float32))")
    floats = [t.name for t in src.inputs if t.dtype in FLOAT_DTYPES]
    wrt = floats if wrt is None else _check_wrt(src, wrt, floats, where)
    for w in wrt:
        if GRAD_PREFIX + w in src.tensors:
            raise ShapeError(f"{where}: the gradient of {w!r} would be named {GRAD_PREFIX + w!r}, which a tensor of "
                             f"the fusion already has; rename that tensor")
    return wrt


def _check_wrt(src: Fusion, wrt, floats: list[str], where: str) -> list[str]:
    if isinstance(wrt, str):
        raise ShapeError(f"{where}: wrt must be a list of input names, got the str {wrt!r}; pass wrt=[{wrt!r}]")
    names = [t.name for t in src.inputs]
    for w in wrt:
        if w in names:
            t = src[w]
            if t.dtype not in FLOAT_DTYPES:
                raise DtypeError(f"{where}: input {w!r} is {_dt(t.dtype)}; gradients are defined for "
                                 f"floating-point inputs only: drop {w!r} from wrt (floating-point inputs: "
                                 f"{floats})")
        elif isinstance(w, str) and w in src.tensors:
            raise ShapeError(f"{where}: wrt {w!r} is computed by the fusion, not an input; a gradient is taken "
                             f"with respect to inputs: pass input names, e.g. {floats}")
        else:
            raise UnknownNameError(f"{where}: wrt {w!r} is not an input of the fusion{_did_you_mean(w, names)}; "
                                   f"pass input names, e.g. {floats}")
    if len(set(wrt)) != len(wrt):
        raise ShapeError(f"{where}: wrt {list(wrt)} names an input twice; list each once")
    return list(wrt)


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------------- the reverse walk


def _needs_grad(src: Fusion, wrt: list[str]) -> set[int]:
    """ids of the tensors a wrt input reaches through floating-point values (only those carry gradients)."""
    need = {id(src[w]) for w in wrt}
    for e in src.exprs:
        if any(id(t) in need for t in e.inputs):
            need |= {id(o) for o in e.outputs if o.dtype in FLOAT_DTYPES}
    return need


def _differentiate(src: Fusion, loss: str, wrt, keep_outputs: bool) -> FusionDefinition:
    where = "grad" if keep_outputs else "value_and_grad"
    wrt = _check(src, loss, wrt, where)
    need = _needs_grad(src, wrt)
    work = Fusion()
    ops = Ops(work)
    new: dict[int, TensorView] = {}
    for tv in src.inputs:
        new[id(tv)] = work.define_tensor(tv.shape, tv.dtype, tv.name, [d.name for d in tv.logical_domain])
    for e in src.exprs:
        outs = work.emit(e.op.name, **_bind(e, new))
        for old, tv in zip(e.outputs, outs if isinstance(outs, tuple) else (outs,)):
            new[id(old)] = tv
    grads = _backward(src, ops, new, need, loss, where)
    outputs = dict(src.outputs) if keep_outputs else {loss: src.outputs[loss]}
    results = {name: new[id(tv)] for name, tv in outputs.items()}
    for w in wrt:
        g = grads.get(id(src[w]))
        results[GRAD_PREFIX + w] = g if g is not None else zeros_like(ops, new[id(src[w])])
    return _live_copy(work, results)


def _bind(e, new: dict[int, TensorView]) -> dict:
    return {k: new[id(v)] if isinstance(v, TensorView) else v for k, v in e.args}


def _backward(src: Fusion, ops: Ops, new: dict, need: set[int], loss: str, where: str) -> dict[int, TensorView]:
    """{id(src tensor): its gradient in the new fusion}, seeded with d loss / d loss = 1."""
    seed = new[id(src.outputs[loss])]
    grads: dict[int, TensorView] = {id(src.outputs[loss]): ops.add(zeros_like(ops, seed), 1.0)}
    for e in reversed(src.exprs):
        gs = [grads.get(id(o)) for o in e.outputs]
        wanted = [(p, v) for p, v in e.args if isinstance(v, TensorView) and id(v) in need]
        if all(g is None for g in gs) or not wanted:
            continue
        if e.op.vjp is None:
            raise ShapeError(f"{where}: the loss depends on {', '.join(v.name for _, v in wanted)} through `{e}`, "
                             f"which has no gradient ({e.op.name} is {e.op.no_grad}); take the gradient with "
                             f"respect to inputs that do not reach it, or express it with differentiable ops")
        outs = tuple(new[id(o)] for o in e.outputs)
        single = len(outs) == 1
        got = e.op.vjp(ops, gs[0] if single else tuple(gs), outs[0] if single else outs, **_bind(e, new))
        for p, v in wanted:
            g = got.get(p)
            assert g is not None, f"vjp of {e.op.name} gave no gradient for {p} ({v.name}) in `{e}`"
            assert g.shape == v.shape, f"vjp of {e.op.name}: gradient of {p} has shape {g.shape}, {v.name} {v.shape}"
            if g.dtype != v.dtype:
                g = ops.cast(g, v.dtype)
            prev = grads.get(id(v))
            grads[id(v)] = g if prev is None else ops.add(prev, g)
    return grads


def _live_copy(work: Fusion, results: dict[str, TensorView]) -> FusionDefinition:
    """A FusionDefinition with work's inputs and only the ops `results` needs, outputs named as given."""
    live = {id(t) for t in results.values()}
    for e in reversed(work.exprs):
        if any(id(o) in live for o in e.outputs):
            live |= {id(t) for t in e.inputs}
    fd = FusionDefinition()
    new: dict[int, TensorView] = {}
    for tv in work.inputs:
        new[id(tv)] = fd.define_tensor(tv.shape, tv.dtype, tv.name, [d.name for d in tv.logical_domain])
    for e in work.exprs:
        if any(id(o) in live for o in e.outputs):
            outs = fd.fusion.emit(e.op.name, **_bind(e, new))
            for old, tv in zip(e.outputs, outs if isinstance(outs, tuple) else (outs,)):
                new[id(old)] = tv
    for name, tv in results.items():
        out = new[id(tv)]
        if (out in fd.fusion.inputs and out.name != name) or any(o is out for o in fd.fusion.outputs.values()):
            out = fd.ops.cast(out, out.dtype)  # an input, or one tensor under two names: output a copy
        fd.add_output(out, name)
    return fd
