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

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .errors import DtypeError, ShapeError, UnknownNameError
from .fusion import Fusion, FusionDefinition, Ops, _did_you_mean, as_fusion, replay
from .ir import TensorView
from .ops import FLOAT_DTYPES, OPS, SAVE_OP, zeros_like

GRAD_PREFIX = "grad_"
SAVED_MARKER_PREFIX = SAVE_OP + "."  # a saved marker's name: saved.<the forward value it keeps> (a fusion tensor)
# recompute=None means this: the backward reads the forward through saved markers. Without a memory bound
# the plan keeps every value, priced as the plain program (optimize.keeping_everything, and fusion reads
# through the marker: problem.fusion_context); with one the optimizer may recompute instead of keep.
RECOMPUTE_DEFAULT = True


def grad(fd: FusionDefinition | Fusion, loss: str, wrt: Sequence[str] | None = None,
         recompute: bool | None = None) -> FusionDefinition:
    """A new fusion: fd's outputs, and `grad_<name>` (the gradient of the scalar output `loss`) for each
    input name in wrt (None: every floating-point input). An input the loss does not depend on gets
    zeros, as in JAX. recompute (None: on, RECOMPUTE_DEFAULT): the backward reads each forward value through
    the `saved` marker, so the plan is priced by the training step's memory model (plan.StepMemory: what
    lives across the step) and may recompute a value instead of keeping it, where a memory bound makes that
    pay (rewrites/recompute.py); without a bound it keeps every value. False: the backward reads the forward
    directly, and the memory model counts every value of the step.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> fd = mlp(tokens=4, hidden=8)
    >>> fd.add_output(fd.ops.mean(fd.ops.mul(fd["y"], fd["y"])), name="loss")
    >>> gfd = ed.grad(fd, loss="loss", wrt=["w1", "w2"])  # the backward reads saved(.)
    >>> {n: t.shape for n, t in gfd.fusion.outputs.items()}
    {'y': (4, 8), 'loss': (), 'grad_w1': (32, 8), 'grad_w2': (8, 32)}
    >>> sorted(str(e) for e in gfd.fusion.exprs if e.op.name == "saved")
    ['saved.gelu_1 = saved(gelu_1)', 'saved.linear_0 = saved(linear_0)', 'saved.y = saved(y)']
    >>> plain = ed.grad(fd, loss="loss", wrt=["w1", "w2"], recompute=False)
    >>> any(e.op.name == "saved" for e in plain.fusion.exprs)
    False
    """
    return _differentiate(as_fusion(fd, "grad"), loss, wrt, keep_outputs=True, recompute=recompute)


def value_and_grad(fd: FusionDefinition | Fusion, loss: str, wrt: Sequence[str] | None = None,
                   recompute: bool | None = None) -> FusionDefinition:
    """As grad (recompute likewise), but the new fusion outputs the loss and the gradients only (fd's other outputs are not
    computed unless a gradient needs them).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((3,), name="x")
    ...     fd.add_output(fd.ops.exp(x), name="e")
    ...     fd.add_output(fd.ops.sum(x), name="loss")
    >>> list(ed.value_and_grad(fd, loss="loss").fusion.outputs)
    ['loss', 'grad_x']
    """
    return _differentiate(as_fusion(fd, "value_and_grad"), loss, wrt, keep_outputs=False, recompute=recompute)


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


def _differentiate(src: Fusion, loss: str, wrt, keep_outputs: bool, recompute: bool | None = None
                   ) -> FusionDefinition:
    where = "grad" if keep_outputs else "value_and_grad"
    work, ops, new, grads = _forward_and_backward(src, loss, _check(src, loss, wrt, where), where, recompute)
    outputs = dict(src.outputs) if keep_outputs else {loss: src.outputs[loss]}
    results = {name: new[id(tv)] for name, tv in outputs.items()}
    results.update({GRAD_PREFIX + w: g for w, g in grads.items()})
    return _live_copy(work, results)


def _forward_and_backward(src: Fusion, loss: str, wrt: list[str], where: str, recompute: bool | None = None):
    """(work fusion, its ops, {id(src tensor): work tensor}, {wrt name: gradient}): src copied into a new
    fusion, then the backward (through saved markers where recompute, None meaning RECOMPUTE_DEFAULT); an
    input the loss does not reach gets zeros."""
    recompute = RECOMPUTE_DEFAULT if recompute is None else bool(recompute)
    need = _needs_grad(src, wrt)
    residuals: dict[int, tuple] = {}  # id(src expr) -> every output of the op it runs as (differentiated_as)

    def emit(ops, e, args):
        via = e.op.differentiated_as
        if via is None or not any(id(t) in need for t in e.inputs):
            return ops._fusion.emit(e.op.name, **args)
        residuals[id(e)] = outs = ops._fusion.emit(via, **args)  # e's outputs first: replay maps those
        return outs
    work, ops, new = replay(src, emit)
    grads = _backward(src, ops, new, need, loss, where, recompute, residuals)
    out = {w: grads.get(id(src[w])) for w in wrt}
    return work, ops, new, {w: zeros_like(ops, new[id(src[w])]) if g is None else g for w, g in out.items()}


def _bind(e, new: dict[int, TensorView]) -> dict:
    return {k: new[id(v)] if isinstance(v, TensorView) else v for k, v in e.args}


def _backward(src: Fusion, ops: Ops, new: dict, need: set[int], loss: str, where: str, recompute: bool = False,
              residuals: dict[int, tuple] | None = None) -> dict[int, TensorView]:
    """{id(src tensor): its gradient in the new fusion}, seeded with d loss / d loss = 1. residuals: the
    outputs of the op an expr ran as in the forward (differentiated_as), whose vjp then applies."""
    seed = new[id(src.outputs[loss])]
    # a constant: the backward reads the loss only where its ops do (a seed computed from the loss would
    # make every gradient depend on the forward's output, and order collectives that need not be)
    grads: dict[int, TensorView] = {id(src.outputs[loss]): ops.full(tuple(seed.shape), 1.0, seed.dtype)}
    keep = _keeper(ops, {id(new[id(t)]) for t in src.inputs}) if recompute else (lambda v: v)
    for e in reversed(src.exprs):
        gs = [grads.get(id(o)) for o in e.outputs]
        wanted = [(p, v) for p, v in e.args if isinstance(v, TensorView) and id(v) in need]
        if all(g is None for g in gs) or not wanted:
            continue
        if e.op.vjp is None:
            raise ShapeError(f"{where}: the loss depends on {', '.join(v.name for _, v in wanted)} through `{e}`, "
                             f"which has no gradient ({e.op.name} is {e.op.no_grad}); take the gradient with "
                             f"respect to inputs that do not reach it, or express it with differentiable ops")
        vjp, outs = e.op.vjp, tuple(new[id(o)] for o in e.outputs)
        if residuals and id(e) in residuals:  # ran as e.op.differentiated_as: no gradient reaches its extras
            vjp, outs = OPS[e.op.differentiated_as].vjp, tuple(residuals[id(e)])
            gs += [None] * (len(outs) - len(gs))
        single = len(outs) == 1
        outs = tuple(keep(o) for o in outs)
        got = vjp(ops, gs[0] if single else tuple(gs), outs[0] if single else outs,
                  **{k: keep(v) for k, v in _bind(e, new).items()})
        for p, v in wanted:
            g = got.get(p)
            assert g is not None, f"vjp of {e.op.name} gave no gradient for {p} ({v.name}) in `{e}`"
            assert g.shape == v.shape, f"vjp of {e.op.name}: gradient of {p} has shape {g.shape}, {v.name} {v.shape}"
            if g.dtype != v.dtype:
                g = ops.cast(g, v.dtype)
            prev = grads.get(id(v))
            grads[id(v)] = g if prev is None else ops.add(prev, g)
    return grads


def _keeper(ops: Ops, inputs: set[int]):
    """keep(v): what the backward reads for the forward value v: saved(v), one marker per value, so that
    the memory model prices what the forward keeps for the backward and the recompute rewrite
    (rewrites/recompute.py) may compute it again instead; an input (held for the whole step anyway) or
    a literal as it is."""
    kept: dict[int, TensorView] = {}

    def keep(v):
        if not isinstance(v, TensorView) or id(v) in inputs:
            return v
        if id(v) not in kept:
            kept[id(v)] = ops.saved(v)
        return kept[id(v)]
    return keep


def _live_copy(work: Fusion, results: dict[str, TensorView], names: dict[str, TensorView] | None = None
               ) -> FusionDefinition:
    """A FusionDefinition with work's inputs and only the ops `results` needs, outputs named as given;
    `names` renames intermediate tensors (not inputs or outputs) of the copy: {new name: work tensor}."""
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
    renames = [(name, new.get(id(tv))) for name, tv in (names or {}).items()]
    # a marker is named after the value it keeps (explain and memory_breakdown name it so)
    renames += [(SAVED_MARKER_PREFIX + e.inputs[0].name, e.outputs[0]) for e in fd.fusion.exprs if e.op.name == SAVE_OP]
    for name, t in renames:
        f = fd.fusion
        if t is None or t in f.inputs or any(o is t for o in f.outputs.values()) or name in f.tensors:
            continue  # not in the copy, an input or an output (named already), or the name is taken
        del f.tensors[t.name]
        t.name = name
        f.tensors[name] = t
    return fd


# ---------------------------------------------------------------------- the optimizer update: a training step


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD's update as fusion ops (dampening 0): g += weight_decay p; with momentum, the
    state `momentum_buffer.<p>` (zeros before the first step) becomes momentum buf + g, and the step
    takes g + momentum buf (nesterov) or buf; p -= lr times that."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def states(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def update(self, ops, p, g, state: dict, step) -> tuple:
        if self.weight_decay:
            g = ops.add(g, ops.mul(p, self.weight_decay))
        new_state = {}
        if self.momentum:
            buf = ops.add(ops.mul(state["momentum_buffer"], self.momentum), g)
            new_state["momentum_buffer"] = buf
            g = ops.add(g, ops.mul(buf, self.momentum)) if self.nesterov else buf
        return ops.sub(p, ops.mul(g, self.lr)), new_state


@dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW's update as fusion ops: p *= 1 - lr weight_decay; the moments `exp_avg.<p>` and
    `exp_avg_sq.<p>` (zeros before the first step) move towards g and g^2; p -= lr / (1 - b1^t) m /
    (sqrt(v) / sqrt(1 - b2^t) + eps), t the step count (the input `step`, 0 before the first step)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def states(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def update(self, ops, p, g, state: dict, step) -> tuple:
        b1, b2 = self.betas
        m = ops.add(ops.mul(state["exp_avg"], b1), ops.mul(g, 1 - b1))
        v = ops.add(ops.mul(state["exp_avg_sq"], b2), ops.mul(ops.mul(g, g), 1 - b2))
        # the bias corrections are scalars of the step; cast so that they do not promote p's dtype
        bc1 = ops.cast(ops.sub(1.0, ops.pow(b1, step)), p.dtype)
        bc2 = ops.cast(ops.sub(1.0, ops.pow(b2, step)), p.dtype)
        denom = ops.add(ops.div(ops.sqrt(v), ops.sqrt(bc2)), self.eps)
        decayed = ops.mul(p, 1 - self.lr * self.weight_decay) if self.weight_decay else p
        p_next = ops.sub(decayed, ops.mul(ops.div(m, denom), ops.div(self.lr, bc1)))
        return p_next, {"exp_avg": m, "exp_avg_sq": v}


STEP, NEXT = "step", "next."


def training_step(fd: FusionDefinition | Fusion, loss: str, params: Sequence[str], optimizer,
                  recompute: bool | None = None) -> FusionDefinition:
    """One training step as one fusion: the forward, the backward of `loss` and the optimizer's update of
    each input in params. Inputs: fd's, then each optimizer state as `<state>.<param>` (zeros before the
    first step) and `step` (float64 scalar: steps taken). Outputs: the loss, `next.<param>`,
    `next.<state>.<param>` and `next.step`; feed them back as the next step's inputs. The gradient of
    each param is the intermediate tensor `grad_<param>` (so plans and plan.memory_breakdown name it).
    recompute: as ed.grad's (None, the default: the backward reads the forward through `saved` markers,
    activation checkpointing chosen by cost under a memory bound, priced by the memory model of a
    training step; False: no markers).

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     w = fd.define_tensor((2,), torch.float64, name="w")
    ...     fd.add_output(fd.ops.sum(fd.ops.mul(w, w)), name="loss")
    >>> step = ed.training_step(fd, "loss", ["w"], ed.SGD(lr=0.25))
    >>> [t.name for t in step.fusion.inputs], list(step.fusion.outputs)
    (['w', 'step'], ['loss', 'next.w', 'next.step'])
    >>> ed.evaluate(step, {"w": torch.tensor([1., 2.], dtype=torch.float64),
    ...                    "step": torch.tensor(0., dtype=torch.float64)})["next.w"]  # w - 0.25 * 2w
    tensor([0.5000, 1.0000], dtype=torch.float64)
    """
    src = as_fusion(fd, "training_step")
    if not hasattr(optimizer, "update"):
        raise ShapeError(f"training_step: optimizer must be ed.SGD(...) or ed.AdamW(...), got {optimizer!r:.60}")
    params = _check(src, loss, list(params) if not isinstance(params, str) else params, "training_step")
    _check_free_names(src, params, optimizer)
    work, ops, new, grads = _forward_and_backward(src, loss, params, "training_step", recompute)
    step = work.define_tensor((), torch.float64, STEP)
    t = ops.add(step, 1.0)
    results = {loss: new[id(src.outputs[loss])]}
    for p in params:
        state = {s: work.define_tensor(src[p].shape, src[p].dtype, f"{s}.{p}") for s in optimizer.states()}
        p_next, s_next = optimizer.update(ops, new[id(src[p])], grads[p], state, t)
        results[NEXT + p] = p_next
        results.update({f"{NEXT}{s}.{p}": v for s, v in s_next.items()})
    results[NEXT + STEP] = t
    return _live_copy(work, results, {GRAD_PREFIX + p: grads[p] for p in params})


def _check_free_names(src: Fusion, params: list[str], optimizer) -> None:
    """The names a training step adds must not be taken by fd's tensors."""
    names = [STEP, NEXT + STEP] + [f"{pre}{s}.{p}" for p in params for s in optimizer.states() for pre in ("", NEXT)]
    names += [NEXT + p for p in params]
    taken = [n for n in names if n in src.tensors]
    if taken:
        raise ShapeError(f"training_step: the step's inputs and outputs need the names {taken}, which tensors of "
                         f"the fusion have; rename those tensors")
