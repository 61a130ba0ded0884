"""ed.parallelize: a torch module whose forward and backward run egraph-did plans under torch.distributed.

`parallelize(module, mesh, example_inputs)` exports the module (ed.from_torch) at the example inputs and
optimizes two plans on the mesh:

- the forward: outputs pinned replicated (they come back whole), parameters free: the plan decides
  each parameter's layout, and that layout is where the parameter lives from then on;
- the backward: the vector-Jacobian product of the forward, a fusion of its own built with
  ed.value_and_grad from loss = sum over the outputs of sum(output * cotangent), the cotangents being
  extra inputs; it gives `grad_<name>` for the parameters and inputs that need a gradient. Each
  parameter and its gradient are pinned to the layout the forward plan chose, so one sharded copy of
  every parameter serves both plans and its gradient lands in the same placements. The backward
  recomputes the forward inside its fusion (no activation is kept between the two plans).

The module is converted in place, as torch's parallelize_module and fully_shard do: its parameters
become DTensors (torch.distributed.tensor) on a torch DeviceMesh of the same ranks, with the plan's
placements (Shard/Replicate), its class becomes a subclass of its own and of ParallelModule, whose
forward runs the plans through a torch.autograd.Function. So torch.optim updates the shards in place,
gradients arrive in `.grad` as DTensors of the same placements, and state_dict() holds the DTensors
torch.distributed.checkpoint saves.

The plans are optimized on rank 0 and broadcast, so that every rank runs the same steps; every rank
exports the module itself (deterministic), and rank 0's parameter values are the ones distributed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .cost import CostModel
from .errors import DtypeError, EgraphDidError, ShapeError
from .fusion import Fusion, replay
from .ir import TensorView
from .frontend import TorchFusion, from_torch
from .grad import GRAD_PREFIX, value_and_grad
from .layout import Layout, R
from .mesh import DeviceMesh
from .ops import FLOAT_DTYPES
from .optimize import optimize
from .pins import apply_layout
from .plan import Plan
from .runtime import torch_device_mesh

COTANGENT = "cotangent."  # the backward fusion's input holding d(loss)/d(output <name>)
LOSS = "parallelize.loss"  # sum over outputs of sum(output * cotangent): differentiated, never computed


class ParallelizeError(EgraphDidError, RuntimeError):
    """parallelize cannot set up here: no default process group, a world size other than the mesh's, or
    a module it cannot convert; the message says what to do.

    >>> import torch, egraph_did as ed
    >>> try:
    ...     ed.parallelize(torch.nn.Linear(4, 2), ed.DeviceMesh.arange(2), (torch.ones(3, 4),))
    ... except ed.ParallelizeError as e:
    ...     print(str(e).split(";")[0])
    parallelize: torch.distributed's default process group is not initialized
    """


def parallelize(module: torch.nn.Module, mesh: DeviceMesh, example_inputs: tuple, cost_model=None,
                memory_limit: float | None = None, *, kwargs: dict | None = None,
                extractor: str = "greedy") -> "ParallelModule":
    """Shard `module` over `mesh`: returns the module itself, converted in place, whose forward and
    backward (under autograd) run egraph-did plans on this process's rank. Every rank of the mesh calls
    it, with torch.distributed's default process group initialized over exactly the mesh's ranks (under
    ed.launch, or torchrun with init_process_group).

    example_inputs: the positional arguments of a call (a tuple; `kwargs` keyword ones), as from_torch
    takes them: the plans are specialized to their shapes and dtypes, and every later call must match.
    cost_model: ed.CostModel (default CostModel.h200()). memory_limit: bytes per device the forward plan
    may hold (replaces the cost model's bound): it decides where the parameters live, and a tight one
    makes the plan shard them. The optimizer's memory model sums every value a plan holds, with no
    reuse, and the backward recomputes the forward, so the backward plan is optimized without the bound;
    its parameters and their gradients are pinned to the forward's layouts. extractor: as ed.optimize.

    Calls take the inputs whole (the same tensors on every rank) and return the outputs whole, in the
    structure the module returns. Parameters are DTensors with the forward plan's placements; buffers
    are read once, at export (re-parallelize after changing one). The backward recomputes the forward
    inside its own plan; `module.forward_plan` and `module.backward_plan()` are the plans, to explain().

    Example (one process per rank; torchrun, or ed.launch of a module-level function)::

        def work(rank):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
            x = torch.randn(8, 16)
            model = ed.parallelize(model, ed.DeviceMesh.arange(4), (x,), memory_limit=12 * 2**10)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            loss = model(x).square().mean()         # the forward plan
            loss.backward()                          # the backward plan: .grad DTensors
            opt.step()                               # on each rank's shards
            return model[0].weight.placements        # (Shard(dim=0),): Megatron's column split

        ed.launch(work, nprocs=4)

    Without a process group it says so:

    >>> import torch, egraph_did as ed
    >>> ed.parallelize(torch.nn.Linear(4, 2), ed.DeviceMesh.arange(2), (torch.ones(3, 4),))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    egraph_did.parallelize.ParallelizeError: parallelize: torch.distributed's default process group is not initialized; ...
    """
    _check_world(module, mesh, example_inputs)
    cm = _cost_model(cost_model, memory_limit)
    state = _State.build(module, mesh, example_inputs, kwargs or {}, cm, extractor)
    _distribute_parameters(module, state)
    cls = type(module)
    if not isinstance(module, ParallelModule):
        module.__class__ = _parallel_class(cls)
    module._egraph_did = state
    return module


# ---------------------------------------------------------------------- checks


def _check_world(module, mesh, example_inputs) -> None:
    if not isinstance(module, torch.nn.Module):
        raise ParallelizeError(f"parallelize: module must be a torch.nn.Module, got a {type(module).__name__}; "
                               f"for a plain function use ed.from_torch and ed.optimize")
    if isinstance(module, ParallelModule):
        raise ParallelizeError("parallelize: this module is parallelized already (its parameters are DTensors); "
                               "parallelize the unsharded module (for other shapes, a fresh copy of it)")
    if not isinstance(mesh, DeviceMesh):
        raise ParallelizeError(f"parallelize: mesh must be an ed.DeviceMesh (e.g. ed.DeviceMesh.arange(4)), got "
                               f"a {type(mesh).__name__}")
    if not isinstance(example_inputs, tuple):
        raise ParallelizeError(f"parallelize: example_inputs must be a tuple of positional arguments, got the "
                               f"{type(example_inputs).__name__}; write (x,) for one argument")
    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelizeError("parallelize: torch.distributed's default process group is not initialized; run "
                               "one process per mesh rank under ed.launch(fn, nprocs=...) or torchrun, and call "
                               "torch.distributed.init_process_group() before parallelize (ed.launch does)")
    world = dist.get_world_size()
    if sorted(mesh.ranks) != list(range(world)):
        raise ParallelizeError(f"parallelize: the mesh {mesh} holds {mesh.size} rank(s) {sorted(mesh.ranks)}, but "
                               f"the process group has world size {world}; run one process per mesh rank "
                               f"(ed.launch(..., nprocs={mesh.size}) or torchrun --nproc-per-node={mesh.size}), or "
                               f"pass a mesh of {world} ranks (ed.DeviceMesh.arange({world}))")


def _cost_model(cost_model, memory_limit):
    if cost_model is None:
        return CostModel.h200(memory_limit)
    if memory_limit is None:
        return cost_model
    if not isinstance(cost_model, CostModel):
        raise ParallelizeError(f"parallelize: memory_limit replaces an ed.CostModel's bound, but cost_model is a "
                               f"{type(cost_model).__name__}; give that model its own bound and pass "
                               f"memory_limit=None")
    return dataclasses.replace(cost_model, memory_limit=memory_limit)


# ---------------------------------------------------------------------- what rank 0 decides for every rank


def _from_rank0(what: str, make: Callable[[], Any]) -> Any:
    """make()'s value on rank 0, on every rank (broadcast, pickled); a failure on rank 0 is raised on every
    rank (the others would otherwise wait in the broadcast), with the same type where it can be."""
    box: list[Any] = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("value", make())
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
            box[0] = ("error", type(e), str(e))
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "value":
        return box[0][1]
    if error is not None:
        raise error
    kind, msg = box[0][1], box[0][2]
    try:
        err = kind(f"{msg} (on rank 0, {what})")
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        err = ParallelizeError(f"parallelize: rank 0 failed {what}: {kind.__name__}: {msg}")
    raise err


@dataclass
class _Program:
    """What every rank runs, as rank 0 exported and optimized it (plain data: it is broadcast)."""

    params: tuple[str, ...]  # parameters the forward reads, by module path
    user_inputs: tuple[str, ...]
    leaves: list  # per flattened (args, kwargs) leaf: the user input it binds, or None
    constants: dict[str, torch.Tensor]  # folded at export: passed whole on every call
    outputs: tuple[str, ...]
    differentiable: tuple[str, ...]  # outputs with a floating-point dtype: those that take a cotangent
    out_skeleton: Any  # the module's output structure, leaves numbered (None: a dict by output name)
    forward_plan: Plan
    layouts: dict[str, Layout]  # parameter -> the layout it lives in


def _export_and_optimize(module, mesh, args, kwargs, cm, extractor) -> tuple[TorchFusion, _Program]:
    fd = from_torch(module, args, kwargs)
    outputs = fd.fusion.outputs
    for name in outputs:
        fd[name].set_device_mesh(mesh)  # the outputs come back whole: their gathers are priced
    plan = optimize(fd, mesh, cm, extractor)
    if any(len(plan.inputs.get(p, ())) > 1 for p in fd.params):
        # a parameter lives in one layout: pin each where the plan first loads it, so that reading it in
        # another layout is a collective the plan prices, not a gather outside it
        for p in fd.params:
            apply_layout(fd[p], plan.values[plan.inputs[p][0]].layout, mesh)
        plan = optimize(fd, mesh, cm, extractor)
    replicated = Layout(tuple(R for _ in range(mesh.ndim)))  # a parameter the plan never loads
    layouts = {p: plan.values[plan.inputs[p][0]].layout if p in plan.inputs else replicated for p in fd.params}
    diff = tuple(n for n, t in outputs.items() if t.dtype in FLOAT_DTYPES)
    return fd, _Program(fd.params, fd.user_inputs, list(fd.leaves), fd.constants, tuple(outputs), diff,
                        fd.output_skeleton, plan, layouts)


@dataclass
class _State:
    """A parallelized module's program and plans, with the fusion (rank 0 only: it optimizes) and the
    example call's form."""

    program: _Program
    fd: TorchFusion | None  # on rank 0
    mesh: DeviceMesh
    cost_model: Any
    extractor: str
    example: list  # per flattened (args, kwargs) leaf: (shape, dtype) of a tensor, or the value itself
    in_spec: Any
    backward_plans: dict[tuple[str, ...], Plan] = field(default_factory=dict)

    @classmethod
    def build(cls, module, mesh, args, kwargs, cm, extractor) -> "_State":
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        example = [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in leaves]
        made: list = []

        def make():
            made[:] = _export_and_optimize(module, mesh, args, kwargs, cm, extractor)
            return made[1]
        program = _from_rank0("exporting the module and optimizing the forward plan", make)
        state = cls(program, made[0] if made else None, mesh, cm, extractor, example, in_spec)
        wrt = [p for p, t in module.named_parameters(remove_duplicate=False)
               if p in program.params and t.requires_grad]
        wrt += [n for n, v in zip(program.leaves, leaves) if n is not None and v.requires_grad]
        if program.differentiable and torch.is_grad_enabled():  # the backward the example's call would run
            state.backward_plan(wrt)
        return state

    @property
    def forward_plan(self) -> Plan:
        return self.program.forward_plan

    def backward_plan(self, wrt: Sequence[str]) -> Plan:
        """The plan of the vector-Jacobian product giving grad_<name> for each name in wrt (parameters and
        user inputs), optimized once per set of names (on rank 0, for every rank)."""
        prog = self.program
        key = tuple(n for n in (*prog.params, *prog.user_inputs) if n in set(wrt))
        if key not in self.backward_plans:
            def make():
                cm = self.cost_model  # unbounded: see parallelize's docstring
                if isinstance(cm, CostModel) and cm.memory_limit is not None:
                    cm = dataclasses.replace(cm, memory_limit=None)
                return optimize(vjp_fusion(self.fd, prog.differentiable, key, prog.layouts, self.mesh),
                                self.mesh, cm, self.extractor)
            self.backward_plans[key] = _from_rank0("optimizing the backward plan", make)
        return self.backward_plans[key]

    # ------------------------------------------------------------ a call's inputs
    def user_inputs(self, args, kwargs) -> dict[str, torch.Tensor]:
        """The call's tensors by input name, after checking them against the example's shapes and dtypes."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise ShapeError(f"parallelized module: called with arguments of another structure than the example "
                             f"inputs ({_describe(spec)} against {_describe(self.in_spec)}); the plans are "
                             f"for the example's; pass the arguments as parallelize's example_inputs were")
        out = {}
        for i, (name, got, want) in enumerate(zip(self.program.leaves, leaves, self.example)):
            what = f"input {name!r}" if name is not None else f"argument leaf {i}"
            if not isinstance(want, tuple) or not isinstance(got, torch.Tensor):
                if isinstance(got, torch.Tensor) or isinstance(want, tuple) or not _same(got, want):
                    raise ShapeError(f"parallelized module: {what} is {got!r:.60}, the example had {want!r:.60}; "
                                     f"the plans were exported with that value: parallelize the unsharded "
                                     f"module again with this value in example_inputs")
                continue
            shape, dtype = want
            if tuple(got.shape) != shape:
                raise ShapeError(f"parallelized module: {what} has shape {tuple(got.shape)}, but the plans are for "
                                 f"the example inputs' shape {shape} (a plan is specialized to its shapes); pad or "
                                 f"split the input to {shape}, or parallelize the unsharded module again with "
                                 f"example inputs of this shape (one parallelized module per shape)")
            if got.dtype != dtype:
                raise DtypeError(f"parallelized module: {what} is {_dt(got.dtype)}, the plans are for the example's "
                                 f"{_dt(dtype)}; cast it (x.to(torch.{_dt(dtype)}))")
            if name is not None:
                out[name] = got
        return out


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a truth value of ==
        return a is b


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _describe(spec) -> str:
    return str(spec).replace("\n", " ")[:120]


# ---------------------------------------------------------------------- the backward fusion


def vjp_fusion(fd, outputs: Sequence[str], wrt: Sequence[str], layouts: dict[str, Layout],
               mesh: DeviceMesh) -> Fusion:
    """The fusion of the vector-Jacobian product of fd: inputs fd's and `cotangent.<out>` for each output
    in `outputs`; outputs `grad_<name>` for each name in wrt, the gradient of sum over those outputs of
    sum(out * cotangent). The forward is recomputed inside it (only what the gradients need). Each
    input in `layouts` (the parameters) is pinned to its layout, and so is its gradient; the gradients
    of the other inputs are pinned replicated (handed back whole).

    >>> import torch, egraph_did as ed
    >>> fd = ed.from_torch(torch.nn.Linear(4, 2, bias=False), (torch.ones(3, 4),))
    >>> mesh = ed.DeviceMesh.arange(2)
    >>> g = vjp_fusion(fd, ["out"], ["weight"], {"weight": ed.Layout.from_code("S0")}, mesh)
    >>> print(g)  # the forward's linear is not recomputed: no gradient needs its output
    inputs: weight[2, 4], input[3, 4], cotangent.out[3, 2]
      full_0 = full(value=1.0)
      reshape_1 = reshape(full_0, (1, 1))
      expand_2 = expand(reshape_1, (3, 2))
      mul_3 = mul(expand_2, cotangent.out)
      reshape_4 = reshape(mul_3, (-1, 2))
      transpose_5 = transpose(reshape_4, 0, 1)
      reshape_6 = reshape(input, (-1, 4))
      grad_weight = matmul(transpose_5, reshape_6)
    outputs: grad_weight
    >>> g["grad_weight"].loop_str()
    '[DIDx{2}, 2/2, 4]'
    """
    src = fd.fusion if hasattr(fd, "fusion") else fd
    work, ops, new = replay(src, lambda ops, e, args: ops._fusion.emit(e.op.name, **args))
    loss = None
    for name in outputs:
        out = new[id(src.outputs[name])]
        cot = work.define_tensor(out.shape, out.dtype, COTANGENT + name, [d.name for d in out.logical_domain])
        term = ops.sum(ops.mul(out, cot))
        loss = term if loss is None else ops.add(loss, term)
    work.add_output(loss, LOSS)
    g = _drop_output(value_and_grad(work, LOSS, list(wrt)).fusion, LOSS)
    for name, layout in layouts.items():
        if name in g.tensors:
            apply_layout(g[name], layout, mesh)
    for name in wrt:
        grad = g[GRAD_PREFIX + name]
        if name in layouts:
            apply_layout(grad, layouts[name], mesh)
        else:
            grad.set_device_mesh(mesh)
    return g


def _drop_output(src: Fusion, drop: str) -> Fusion:
    """src without the output `drop` and the ops only it needs (the loss: its value is never used; grad
    seeds d loss / d loss with a constant, so the forward ops no gradient needs are dropped)."""
    keep = {n: t for n, t in src.outputs.items() if n != drop}
    live = {id(t) for t in keep.values()}
    for e in reversed(src.exprs):
        if any(id(o) in live for o in e.outputs):
            live |= {id(t) for t in e.inputs}

    dst = Fusion()
    new = {id(t): dst.define_tensor(t.shape, t.dtype, t.name, [d.name for d in t.logical_domain])
           for t in src.inputs}
    for e in src.exprs:
        if not any(id(o) in live for o in e.outputs):
            continue
        outs = dst.emit(e.op.name, **{k: new[id(v)] if isinstance(v, TensorView) else v for k, v in e.args})
        new |= {id(o): t for o, t in zip(e.outputs, outs if isinstance(outs, tuple) else (outs,))}
    for name, tv in keep.items():
        dst.add_output(new[id(tv)], name)
    return dst


# ---------------------------------------------------------------------- parameters as DTensors


def _distribute_parameters(module: torch.nn.Module, state: _State) -> None:
    """Replace every parameter by a DTensor parameter with its plan layout (rank 0's values; a parameter
    no plan reads is replicated); a parameter tied under several names stays one parameter."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    tmesh = torch_device_mesh(state.mesh, "cuda" if device is not None else "cpu")
    done: dict[int, torch.nn.Parameter] = {}
    params = list(module.named_parameters(remove_duplicate=False))
    layout_of = {id(p): state.program.layouts[name] for name, p in params if name in state.program.layouts}
    for name, p in params:
        if id(p) not in done:
            layout = layout_of.get(id(p))
            placements = ([Shard(q.axis) if q.is_shard else Replicate() for q in layout] if layout is not None
                          else [Replicate()] * state.mesh.ndim)
            data = p.detach() if device is None else p.detach().to(device)
            done[id(p)] = torch.nn.Parameter(distribute_tensor(data, tmesh, placements),
                                             requires_grad=p.requires_grad)
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner).register_parameter(leaf, done[id(p)])


# ---------------------------------------------------------------------- the module


class _Run(torch.autograd.Function):
    """One call: forward runs the forward plan; backward runs the backward plan of the arguments that
    need a gradient, which recomputes the forward inside it."""

    @staticmethod
    def forward(ctx, state: _State, names: tuple, *tensors):
        prog = state.program
        values = dict(zip(names, tensors)) | prog.constants
        plan = prog.forward_plan
        outs = plan.run({k: v for k, v in values.items() if k in plan.inputs}, inputs="global", outputs="global")
        outs = tuple(outs[n] for n in prog.outputs)
        ctx.state, ctx.names = state, names
        ctx.save_for_backward(*tensors)
        ctx.mark_non_differentiable(*(o for n, o in zip(prog.outputs, outs) if n not in prog.differentiable))
        return outs

    @staticmethod
    def backward(ctx, *cotangents):
        state, names = ctx.state, ctx.names
        need = ctx.needs_input_grad[2:]
        wrt = [n for n, w in zip(names, need) if w]
        plan = state.backward_plan(wrt)
        prog = state.program
        values = dict(zip(names, ctx.saved_tensors)) | prog.constants
        values |= {COTANGENT + n: c.contiguous() for n, c in zip(prog.outputs, cotangents) if n in prog.differentiable}
        grads = plan.run({k: v for k, v in values.items() if k in plan.inputs}, inputs="global", outputs="dtensor")
        out = []
        for n, w in zip(names, need):
            g = grads[GRAD_PREFIX + n] if w else None
            out.append(g if g is None or n in prog.layouts else g.to_local())  # a user input's: whole
        return (None, None, *out)


class ParallelModule(torch.nn.Module):
    """What ed.parallelize makes of a module: its class becomes a subclass of this and of its own, so
    attributes, submodules and state_dict() keys stay the module's; forward runs the plans.

    >>> cls = _parallel_class(torch.nn.Linear)
    >>> cls.__name__, issubclass(cls, ParallelModule) and issubclass(cls, torch.nn.Linear)
    ('ParallelLinear', True)
    """

    _egraph_did: _State

    def forward(self, *args, **kwargs):
        """The module's forward on inputs of the example's shapes, given whole on every rank; the outputs
        whole on every rank, in the module's structure. Under autograd, backward runs the backward plan.

        Example (inside a rank; see ed.parallelize)::

            y = model(x)            # x: the example's shape and dtype, the same on every rank
            y.sum().backward()      # model's parameters get .grad DTensors
        """
        state = self._egraph_did
        prog = state.program
        user = state.user_inputs(args, kwargs)  # checked against the example; undetached, so that autograd
        params = dict(self.named_parameters(remove_duplicate=False))  # reaches inputs that require grad
        names = (*prog.params, *prog.user_inputs)
        outs = _Run.apply(state, names, *(params[n] for n in prog.params), *(user[n] for n in prog.user_inputs))
        if prog.out_skeleton is None:
            return dict(zip(prog.outputs, outs))
        return pytree.tree_map(lambda i: outs[i], prog.out_skeleton)

    @property
    def forward_plan(self) -> Plan:
        """The forward's plan (explain() says how every tensor is laid out and why).

        Example (inside a rank)::

            print(model.forward_plan.explain())
        """
        return self._egraph_did.forward_plan

    def backward_plan(self, wrt: Sequence[str] | None = None) -> Plan:
        """The backward's plan giving the gradients of `wrt` (names of parameters and inputs; None: every
        parameter that requires grad). Optimized on first use; every rank must ask for the same.

        Example (inside a rank)::

            print(model.backward_plan().collectives)
        """
        state = self._egraph_did
        if wrt is None:
            wrt = [n for n, p in self.named_parameters(remove_duplicate=False)
                   if n in state.program.params and p.requires_grad]
        return state.backward_plan(wrt)


_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    """The class `Parallel<Name>(ParallelModule, cls)`, one per module class."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Parallel{cls.__name__}", (ParallelModule, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


__all__ = ["parallelize", "ParallelModule", "ParallelizeError", "vjp_fusion"]
