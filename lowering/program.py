"""A rank's lowered program prepared once: a flat list of calls over integer slots, run by a tight loop.

lowering/execute.py's run_rank walks segments: every step looks values up by name, a fused segment
finds its kernel in a dict keyed by the segment, an ATen step re-derives its operands, a collective
re-checks its shard: about 70 µs of Python a segment. Everything those lookups find is fixed by
(plan, rank, input signature), so `prepare` finds it once:

* a value is a slot (an index into one list); inputs take the first slots, in `program_inputs` order;
* a fused segment is its Triton kernel with the grid, block sizes and output allocations worked out;
* an ATen step is the op's reference with its literals bound and its local output shapes computed;
* a collective is the caller's function with the collective bound (the runtime binds the registry
  entry, the move and the process group once);
* each call lists the slots to drop after it (their last reader has run);
* a view of a view read by nothing else is one call (one learned as_strided), and a linear's matmul
  epilogue is part of its call where lowering/epilogue.py takes one.

After the first run the calls run as one generated straight-line function (values are local variables),
and fused kernels launch through their compiled launcher without Triton's per-call lookups: on a GPU
host what remains per call is ATen's and the driver's own launch cost.

The first run of a program takes the checked path for kernels and collectives (the shape, dtype and
device checks of Kernel.__call__ and run_collective); later runs skip them: every shape is fixed by the
input signature the program was prepared for. Index checks (embedding ids, gather indices) guard
user data, so they run every time unless the caller passes check_indices=False.

Numerics are run_rank's: the same kernels with the same launch parameters, the same references.
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from egraph_did.errors import PlanError
from egraph_did.local import run_local
from egraph_did.ops import OPS
from egraph_did.plan import Collective, ComputeStep, Plan
from egraph_did.shards import Operand, RankContext

from . import schedulers
from .compute import check_step_indices
from .epilogue import epilogue_plan, gemm_fn
from .segment import Segment, kernel_spec

CollectiveFn = Callable[[Plan, Collective, torch.Tensor, int], torch.Tensor]
BindCollective = Callable[[Collective], tuple]  # (fn, checked fn[, start, checked start]): see prepare


class SegmentFailed(PlanError):
    """A call of a prepared program raised: `index` is its segment, `what` the segment's description;
    the original exception is the __cause__."""

    def __init__(self, index: int, what: str, error: BaseException):
        super().__init__(f"segment {index} ({what}): {type(error).__name__}: {error}")
        self.index, self.what, self.error = index, what, error


@dataclass(frozen=True)
class Call:
    """One call of a prepared program: fn(*slots[args]) -> a tuple of tensors into slots[outs]; then
    slots[frees] are dropped. first_fn is the checked variant the program's first run uses; raw calls
    (index checks) raise their error as it is, since it already names the tensor and the fix."""

    fn: Callable[..., tuple]
    args: tuple[int, ...]
    outs: tuple[int, ...]
    frees: tuple[int, ...]
    segment: int
    comm: bool = False
    raw: bool = False
    first_fn: Callable[..., tuple] | None = None


@dataclass
class Program:
    """One rank's lowered program as flat calls (see prepare()). run(inputs) takes the input tensors in
    `inputs` order and returns the output tensors in `outputs` order.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> plan = ed.optimize(mlp(tokens=8, hidden=16), ed.DeviceMesh.arange(2))
    >>> prog = prepare(plan, 1, [torch.ones(4, 16), torch.ones(64, 16), torch.ones(16, 64)], None)
    >>> prog.inputs, prog.outputs, len(prog.calls)
    (('x:S0', 'w1:R', 'w2:R'), ('y:S0',), 3)
    """

    plan: Plan
    rank: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    calls: list[Call]
    nslots: int
    segments: list[Segment]
    described: list[str] = field(default_factory=list)  # each segment's describe(), for errors and progress
    out_slots: list[int] = field(default_factory=list)
    has_index_checks: bool = False
    runs: int = 0
    graph: Any = None  # lowering/graphs.py's state for this program, when it is captured
    _straight: Any = None  # (the calls it was made from, the run as one generated function): _straight_line

    def run(self, inputs: Sequence[torch.Tensor], before_comm: Callable[[int], None] | None = None
            ) -> list[torch.Tensor]:
        """The outputs for these inputs (in `inputs` order). before_comm(segment index) is called before
        each collective (the runtime records its progress there: a stalled run names the collective).
        A failing call raises SegmentFailed naming its segment; an index check raises its ShapeError."""
        if self.runs and len(inputs) == len(self.inputs):  # checked run done: the straight-line function
            straight = self._straight
            if straight is None or straight[0] is not self.calls:
                straight = self._straight = (self.calls, _straight_line(self))
            self.runs += 1
            outs, k, error = straight[1](inputs, before_comm)
            if error is None:
                return outs
            call = self.calls[k]
            if call.raw:
                raise error
            raise SegmentFailed(call.segment, self.described[call.segment], error) from error
        slots: list[Any] = [None] * self.nslots
        slots[:len(inputs)] = inputs
        first = self.runs == 0
        self.runs += 1
        call = None
        try:
            for call in self.calls:
                if before_comm is not None and call.comm:
                    before_comm(call.segment)
                fn = call.first_fn if first and call.first_fn is not None else call.fn
                out = fn(*[slots[a] for a in call.args])
                for o, t in zip(call.outs, out):
                    slots[o] = t
                for f in call.frees:
                    slots[f] = None
        except Exception as e:
            if call is None or call.raw:
                raise
            raise SegmentFailed(call.segment, self.described[call.segment], e) from e
        return [slots[o] for o in self.out_slots]


def _straight_line(prog: Program) -> Callable:
    """prog's calls as one generated Python function, f(inputs, before_comm) -> (outputs, k, error):
    values are local variables instead of list slots, each call's arguments spelled out, dead values
    dropped where they die. The loop over Call objects spends about half a µs a call in indexing,
    zips and attribute reads; here there is only the call. k is the failing call's index (error set).

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> plan = ed.optimize(row_sum(4, 3), ed.DeviceMesh.arange(2))
    >>> prog = prepare(plan, 1, [torch.ones(2, 3)], None)
    >>> _straight_line(prog)([torch.ones(2, 3)], None)
    ([tensor([3., 3.])], 0, None)
    """
    ns: dict[str, Any] = {}
    lines = ["def run(inputs, before_comm):"]
    lines += [f"    s{i} = inputs[{i}]" for i in range(len(prog.inputs))]
    lines += ["    k = 0", "    try:"]
    for k, call in enumerate(prog.calls):
        ns[f"f{k}"] = call.fn
        args = ", ".join(f"s{a}" for a in call.args)
        lines.append(f"        k = {k}")
        if call.comm:
            lines.append(f"        if before_comm is not None: before_comm({call.segment})")
        if not call.outs:
            lines.append(f"        f{k}({args})")
        elif len(call.outs) == 1 and getattr(call.fn, "one", None) is not None:  # returns the tensor itself
            ns[f"f{k}"] = call.fn.one
            lines.append(f"        s{call.outs[0]} = f{k}({args})")
        elif len(call.outs) == 1:
            lines.append(f"        s{call.outs[0]} = f{k}({args})[0]")
        else:
            lines.append(f"        _o = f{k}({args})")
            lines += [f"        s{o} = _o[{j}]" for j, o in enumerate(call.outs)]
        lines += [f"        s{f} = None" for f in call.frees]
    lines += ["    except Exception as e:", "        return None, k, e",
              f"    return [{', '.join(f's{o}' for o in prog.out_slots)}], 0, None"]
    exec("\n".join(lines), ns)  # noqa: S102 - code built above from slot numbers only
    return ns["run"]


def program_inputs(plan: Plan) -> tuple[str, ...]:
    """The values a rank's program reads from outside: every input's loaded layouts, in plan order.

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> program_inputs(ed.optimize(row_sum(4, 3), ed.DeviceMesh.arange(2)))
    ('x:S0',)
    """
    return tuple(v for vals in plan.inputs.values() for v in vals)


def signature(tensors: Sequence[torch.Tensor]) -> tuple:
    """What a prepared program is specific to: each input's shape, dtype, device, strides and whether
    its data is 16-byte aligned (a compiled Triton kernel is specialized on that).

    >>> signature([torch.ones(2, 3)])
    ((torch.Size([2, 3]), torch.float32, device(type='cpu'), (3, 1), True),)
    """
    return tuple((t.shape, t.dtype, t.device, t.stride(), t.data_ptr() % 16 == 0) for t in tensors)


# ---------------------------------------------------------------------------- building calls

def _local_operand(plan: Plan, value: str) -> Operand:
    v = plan.values[value]
    return Operand(v.shape, v.layout)


def _aten_fn(plan: Plan, step: ComputeStep, ctx: RankContext, cuda: bool = False) -> Callable[..., tuple]:
    """The step's local semantics with everything but its tensors bound. Steps that name a local kernel
    go through run_local as they are; the rest take run_local's no-kernel branch with the local output
    shapes computed once (run_local recomputes them per call)."""
    params = tuple(step.operands)
    literals = {k: v for k, v in step.args if k not in step.tensor_params}
    opdef = OPS[step.op]
    if step.flags:
        operands = {k: _local_operand(plan, v) for k, v in step.operands.items()}
        outputs = [_local_operand(plan, o) for o in step.writes]
        flags = dict(step.flags)

        def via_run_local(*ts):
            return run_local(step.op, {**literals, **dict(zip(params, ts))}, operands, outputs, flags, ctx)
        return via_run_local
    ref, local_attrs = opdef.reference, opdef.local_attrs
    if cuda and not params and "device" in inspect.signature(ref).parameters:
        # a constant (full: the loss gradient's seed) reads no tensor to take its device from
        literals = {**literals, "device": torch.device("cuda", torch.cuda.current_device())}
    out_shapes = [ctx.local_shape(_local_operand(plan, o)) for o in step.writes]
    if cuda and step.op == "linear" and params == ("x", "weight"):  # on a CPU mm may take another kernel
        return _mm_linear(tuple(out_shapes[0]))
    direct = _direct_op(step.op, params, literals, cuda)
    if direct is not None:
        return _one_output(direct)
    try:  # the local attributes read literals and local shapes only: bind them once with the literals
        fixed = {**literals, **(local_attrs(literals, out_shapes) if local_attrs is not None else {})}
    except KeyError:  # this op's local attributes read a tensor: work them out per call
        fixed = None
    if fixed is not None:
        bound = functools.partial(ref, **fixed)
        if opdef.kind == "view" and len(params) == 1:
            view = _learned_view(bound, params[0])
            view.bound = functools.partial(_call_one, bound, params[0])  # t -> the view: for _fold_views
            return view

        if _positional(ref, params, fixed):  # the tensors are ref's leading parameters: no keyword dict per call
            def positional(*ts):
                out = bound(*ts)
                return tuple(out) if isinstance(out, (tuple, list)) else (out,)
            return positional

        def prebound(*ts):
            out = bound(**dict(zip(params, ts)))
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return prebound

    def reference(*ts):
        args = {**literals, **dict(zip(params, ts))}
        if local_attrs is not None:
            args.update(local_attrs(args, out_shapes))
        out = ref(**args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return reference


def _direct_op(op: str, params: tuple[str, ...], literals: dict, cuda: bool) -> Callable | None:
    """The torch function the op's reference ends in, with its literals bound, for the hottest ops of a
    transformer layer: what the reference computes, minus its Python frames and keyword dicts on the
    way (a linear's lambda; sdpa's reference, attention()'s device test and, on a CPU, the math-backend
    context manager, about 40 µs a call on a CPU host). None for any other op or argument set.

    * linear(x, weight): F.linear(x, weight), as the reference calls it;
    * sdpa(q, k, v, is_causal, scale): on CUDA F.scaled_dot_product_attention, as attention() calls it; on a
      CPU the math backend's own op, which is what F.scaled_dot_product_attention runs under
      sdpa_kernel(SDPBackend.MATH) (the same bits: tests/execution/test_runtime_lean.py checks them).

    >>> fn = _direct_op("sdpa", ("q", "k", "v"), {"is_causal": True}, cuda=False)
    >>> q = torch.randn(1, 2, 4, 8)
    >>> from egraph_did.ops import attention
    >>> torch.equal(fn(q, q, q), attention(q, q, q, is_causal=True))
    True
    """
    if op == "linear" and params == ("x", "weight") and set(literals) <= {"bias"} and literals.get("bias") is None:
        return torch.nn.functional.linear
    if op == "sdpa" and params == ("q", "k", "v") and set(literals) <= {"is_causal", "scale"}:
        causal, scale = bool(literals.get("is_causal", False)), literals.get("scale")
        if cuda:
            return functools.partial(torch.nn.functional.scaled_dot_product_attention, is_causal=causal,
                                     scale=scale)
        math = torch.ops.aten._scaled_dot_product_attention_math.default

        def sdpa_math(q, k, v):
            return math(q, k, v, None, 0.0, causal, None, scale=scale)[0]
        return sdpa_math
    return None


def _one_output(fn: Callable) -> Callable[..., tuple]:
    """fn (tensors -> one tensor) as a call's function (-> a tuple); fn itself rides along as `.one`, which
    the straight-line run calls directly (no tuple made and unpacked per call).

    >>> wrapped = _one_output(torch.neg)
    >>> wrapped(torch.ones(1)), wrapped.one is torch.neg
    ((tensor([-1.]),), True)
    """
    def call(*ts):
        return (fn(*ts),)
    call.one = fn
    return call


def _mm_linear(shape: tuple[int, ...], before: Callable | None = None, after: Callable | None = None,
               flat: bool = False) -> Callable[..., tuple]:
    """linear(x, weight) without a bias as the one mm ATen's linear reaches (it flattens x's leading axes
    into rows, then multiplies by weight.T): the same GEMM on the same operands, so the same bits, minus
    linear's and matmul's dispatch on the way (about 3 µs a call on a GPU host; measured bitwise equal there
    for GPT-3's [1, 2048, 12288] x [1536, 12288]^T in bf16). Used for CUDA tensors only.

    before / after: a view read by nothing else that makes x (sdpa -> permute -> reshape into wo), or that
    takes the linear's result (linear -> reshape -> permute into sdpa), folded in by _fold_views: each is
    learned (_learned_view) together with the linear's own flattening of x or view to `shape`, so either
    side is one as_strided (a call and a Python frame fewer each: about 2 µs on a CPU host). flat: x comes
    already flattened to rows (linears that share x flatten it once: _share_rows).

    >>> x, w = torch.randn(2, 3, 4), torch.randn(6, 4)
    >>> torch.equal(_mm_linear((2, 3, 6))(x, w)[0], torch.nn.functional.linear(x, w))
    True
    >>> heads = lambda t: t.reshape(2, 3, 2, 3).permute(0, 2, 1, 3)
    >>> fn = _mm_linear((2, 3, 6), before=lambda t: t.permute(1, 0, 2), after=heads)
    >>> y = x.permute(1, 0, 2).contiguous()  # before(y) holds x's values
    >>> all(torch.equal(fn(y, w)[0], heads(torch.nn.functional.linear(x, w))) for _ in range(2))
    True
    """
    mm = torch.mm
    pre = _learned_view(lambda t: _rows(before(t)), "t").one if before is not None else _rows
    post = _learned_view(lambda t: after(t.view(shape)), "t").one if after is not None else None
    if flat and post is not None:
        def linear(x, weight):
            return post(mm(x, weight.t()))
    elif flat:
        def linear(x, weight):
            return mm(x, weight.t()).view(shape)
    elif post is not None:
        def linear(x, weight):
            return post(mm(pre(x), weight.t()))
    elif before is None:  # the plain linear: its one flattening inlined
        def linear(x, weight):
            return mm(x.reshape(-1, x.shape[-1]), weight.t()).view(shape)
    else:
        def linear(x, weight):
            return mm(pre(x), weight.t()).view(shape)
    fn = _one_output(linear)
    fn.then_view = lambda outer: _mm_linear(  # for _fold_views: a view of its result, or one that makes x
        shape, before, outer if after is None else (lambda t: outer(after(t))), flat)
    if not flat:
        fn.view_into = lambda inner: _mm_linear(shape, inner if before is None else (lambda t: before(inner(t))),
                                                after)
        if before is None:
            fn.on_rows = lambda: _mm_linear(shape, None, after, flat=True)  # for _share_rows
    return fn


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _share_rows(raw_calls: list[tuple]) -> list[tuple]:
    """Linears (CUDA's _mm_linear) that read the same x (q, k and v from one norm) read its rows, flattened
    once by a call put before the first of them: one reshape instead of three.

    >>> lin = lambda: _mm_linear((1, 2, 3))
    >>> calls = [(lin(), None, ("h", "wq"), ("q",), False, 0, False), (lin(), None, ("h", "wk"), ("k",), False, 1, False)]
    >>> [(c[2], c[3]) for c in _share_rows(calls)]
    [(('h',), ('h@rows',)), (('h@rows', 'wq'), ('q',)), (('h@rows', 'wk'), ('k',))]
    """
    readers: dict[str, list[int]] = {}
    for k, call in enumerate(raw_calls):
        if getattr(call[0], "on_rows", None) is not None and len(call[2]) == 2:
            readers.setdefault(call[2][0], []).append(k)
    shared = {k: x for x, ks in readers.items() if len(ks) > 1 for k in ks}
    out: list[tuple] = []
    for k, (fn, first, reads, writes, raw, index, comm) in enumerate(raw_calls):
        x = shared.get(k)
        if x is None:
            out.append((fn, first, reads, writes, raw, index, comm))
            continue
        if readers[x][0] == k:
            out.append((_one_output(_rows), None, (x,), (f"{x}@rows",), False, index, False))
        out.append((fn.on_rows(), None, (f"{x}@rows", reads[1]), writes, raw, index, comm))
    return out


def _positional(ref: Callable, params: tuple[str, ...], fixed: dict) -> bool:
    """Whether ref(*tensors, **fixed) binds the tensors to params: they are its first parameters, in order,
    and none of them is also bound by keyword.

    >>> _positional(lambda x, weight, bias=None: None, ("x", "weight"), {}), _positional(lambda a, b: None, ("b",), {})
    (True, False)
    """
    try:
        lead = list(inspect.signature(ref).parameters.values())[:len(params)]
    except (TypeError, ValueError):
        return False
    return ([p.name for p in lead] == list(params) and not set(params) & set(fixed)
            and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in lead))


def _learned_view(bound: Callable, param: str) -> Callable[..., tuple]:
    """A view (reshape, permute, expand, ...) as one as_strided once its first call has shown the result:
    for an input of the same shape and strides (the program's signature fixes them; checked per call,
    cheaply) the view's size, strides and offset are the same, and as_strided skips the op's shape logic
    (a few µs a call on a GPU host). A reshape that had to copy (no view exists) keeps calling the op.

    >>> view = _learned_view(lambda x: x.reshape(2, 6), "x")
    >>> x = torch.arange(12.).reshape(3, 4)
    >>> view(x)[0].shape, view(x + 1)[0][1, 0].item()  # the first call learns, the second replays
    (torch.Size([2, 6]), 7.0)
    """
    learned: list = []  # [] before the first call; then [(input strides, shape, size, strides, offset)] or [None]

    def view(t):
        if learned:
            first = learned[0]
            if first is None:  # the first call had to copy: the op it is, without looking again
                return bound(**{param: t})
            if t.stride() == first[0] and t.shape == first[1]:  # laid out as when learned
                _, _, size, stride, offset = first
                if offset:
                    return t.as_strided(size, stride, t.storage_offset() + offset)
                return t.as_strided(size, stride)  # t's own storage offset: one call fewer
            return bound(**{param: t})
        out = bound(**{param: t})
        if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            learned.append((t.stride(), t.shape, out.size(), out.stride(), out.storage_offset() - t.storage_offset()))
        else:
            learned.append(None)
        return out
    return _one_output(view)


def _call_one(bound: Callable, param: str, t):
    return bound(**{param: t})


def _fold_views(raw_calls: list[tuple], keep: set[str]) -> list[tuple]:
    """A view of a view read by nothing else (linear -> reshape -> permute into sdpa) as one call: one
    learned as_strided instead of two, a host call fewer each (a few µs each on a GPU host).

    >>> from egraph_did.lowering.program import _learned_view, _call_one
    >>> def view(f):
    ...     v = _learned_view(lambda x: f(x), "x"); v.bound = lambda t: f(t); return v
    >>> calls = [(view(lambda t: t.reshape(2, 6)), None, ("a",), ("b",), False, 0, False),
    ...          (view(lambda t: t.t()), None, ("b",), ("c",), False, 1, False)]
    >>> [(c[2], c[3]) for c in _fold_views(calls, set())]
    [(('a',), ('c',))]
    >>> _fold_views(calls, set())[0][0](torch.arange(12.))[0].shape
    torch.Size([6, 2])
    """
    readers: dict[str, int] = {}
    for call in raw_calls:
        for v in call[2]:
            readers[v] = readers.get(v, 0) + 1
    out: list[tuple] = []
    for call in raw_calls:
        fn, first, reads, writes, raw, index, comm = call
        prev = out[-1] if out else None
        sole_reader = (prev is not None and getattr(fn, "bound", None) and len(reads) == 1 and prev[3] == reads
                       and readers[reads[0]] == 1 and reads[0] not in keep)
        if sole_reader and getattr(prev[0], "bound", None):
            inner, outer = prev[0].bound, fn.bound
            both = _learned_view(lambda t, inner=inner, outer=outer: outer(inner(t)), "t")
            both.bound = lambda t, inner=inner, outer=outer: outer(inner(t))
            out[-1] = (both, None, prev[2], writes, False, index, False)
            continue
        if sole_reader and getattr(prev[0], "then_view", None):  # a linear's mm and the view after it
            out[-1] = (prev[0].then_view(fn.bound), None, prev[2], writes, False, index, False)
            continue
        if (prev is not None and getattr(fn, "view_into", None) and getattr(prev[0], "bound", None)
                and len(reads) == 2 and prev[3] == reads[:1] and reads[1] != reads[0]
                and readers[reads[0]] == 1 and reads[0] not in keep):  # a view that makes a linear's x
            out[-1] = (fn.view_into(prev[0].bound), None, (prev[2][0], reads[1]), writes, False, index, False)
            continue
        out.append(call)
    return out


def _kernel_fn(kernel: schedulers.Kernel, device: torch.device) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
    """(lean launch, checked launch) of a compiled kernel; both return its outputs in spec.outputs order.
    The lean one is Kernel.__call__ without the per-call checks and dicts: outputs allocated from shapes
    known here, the launch configuration worked out once."""
    spec = kernel.spec
    names = list(dict.fromkeys(spec.outputs))
    pick = tuple(names.index(n) for n in spec.outputs)

    def checked(*ts):
        outs = kernel(dict(zip(spec.inputs, ts)))
        return tuple(outs[n] for n in spec.outputs)
    if any(math.prod(sh) == 0 for _, sh, _ in spec.tensors):
        return checked, checked  # empty tensors: Kernel.__call__ knows their values without a launch
    if kernel._config is None:
        kernel._config = schedulers.heuristics(spec, kernel.schedule)
    cfg = kernel._config
    alloc = tuple((tuple(spec.shape(n)), spec.dtype(n)) for n in names)
    launcher = kernel.fn[(cfg.grid,)]
    constexprs, warps = dict(cfg.constexprs), cfg.num_warps
    params = list(getattr(kernel.fn, "arg_names", ()))
    tail = [constexprs[n] for n in params[len(spec.inputs) + len(names):]]
    direct: list = [None if device.type == "cuda" and sorted(params[len(spec.inputs) + len(names):]) ==
                    sorted(constexprs) else False]
    empty = torch.empty
    if all(sh for sh, _ in alloc):  # sizes as separate arguments: torch's parser takes them ~1 µs sooner
        def allocate():
            return [empty(*sh, dtype=dt, device=device) for sh, dt in alloc]
    else:  # a 0-d output: empty() wants its empty size as one tuple
        def allocate():
            return [empty(sh, dtype=dt, device=device) for sh, dt in alloc]

    def launch(ts, outs):
        args = [t.contiguous() for t in ts] + outs
        if direct[0]:
            direct[0](*args, *tail)
            return
        compiled = launcher(*args, **constexprs, num_warps=warps)
        if direct[0] is None:
            direct[0] = _direct_launch(compiled, cfg.grid, args, len(outs), tail)

    if len(spec.outputs) == 1:  # the common case: one output, returned as it is (see _one_output)
        sh, dt = alloc[0]
        one_empty = (lambda: empty(*sh, dtype=dt, device=device)) if sh else (lambda: empty(sh, dtype=dt, device=device))

        def lean_one(*ts):
            out = one_empty()
            run = direct[0]
            if run:
                run(*[t.contiguous() for t in ts], out, *tail)
            else:
                launch(ts, [out])
            return out
        fn = _one_output(lean_one)
        fn.launch_path = lambda: launch_path(direct[0])
        return fn, checked

    def lean(*ts):
        outs = allocate()
        launch(ts, outs)
        return tuple(outs) if in_order else tuple(outs[k] for k in pick)
    in_order = pick == tuple(range(len(names)))
    lean.launch_path = lambda: launch_path(direct[0])
    return lean, checked


def launch_path(direct) -> str:
    """How a prepared kernel launches now (for benchmarks: a kernel left on Triton's JIT entry pays
    tens of µs a call on a GPU host): its _direct_launch state in words.

    >>> launch_path(None), launch_path(False)
    ('JIT entry (direct launcher not tried yet)', 'JIT entry')
    """
    if direct is None:
        return "JIT entry (direct launcher not tried yet)"
    if direct is False:
        return "JIT entry"
    return "compiled.run" if getattr(direct, "__name__", "") == "launch" else "CompiledKernel runner"


def _direct_launch(compiled, grid: int, args: list, n_out: int, tail: list):
    """The compiled kernel's own launcher (CompiledKernel[grid]): Triton's JIT entry re-binds and
    re-specializes every argument on each call (tens of µs on a GPU host); the program's argument
    types and alignments are fixed by its signature, so the kernel it picked once is the kernel.
    Whether the launcher takes the arguments as given differs between Triton versions: it is tried
    once against the JIT launch it replaces, outside any CUDA graph capture, and used only if both
    write the same bits (False: keep the JIT launch; None: try again at the next call)."""
    if torch.cuda.is_current_stream_capturing():
        return None
    for make in (_raw_launch, lambda c, g, d: c[(g, 1, 1)]):  # the leaner first, then Triton's own runner
        try:
            runner = make(compiled, grid, args[0].device)
            again = [torch.empty_like(o) for o in args[-n_out:]]
            runner(*args[:-n_out], *again, *tail)
            torch.cuda.synchronize()
            if all(torch.equal(a, b) for a, b in zip(args[-n_out:], again)):
                return runner
        except Exception:  # noqa: BLE001, S112 - any failure: this Triton's launcher wants other arguments
            continue
    return False


def _raw_launch(compiled, grid: int, device: torch.device) -> Callable:
    """CompiledKernel[grid] without its per-call lookups: Triton's runner asks for the current device,
    then its stream, and builds launch metadata for hooks on every call (a few µs on a GPU host); here the
    device is the program's, the stream is read directly, and the call goes straight to compiled.run with
    the arguments the runner would pass (Triton 3.x). Where a launch hook is set (a profiler), Triton's
    runner runs instead, so the hook sees every launch."""
    from triton import knobs
    run, function, meta = compiled.run, compiled.function, compiled.packed_metadata
    stream_of, index, hooks = torch._C._cuda_getCurrentRawStream, device.index or 0, knobs.runtime
    runner = compiled[(grid, 1, 1)]

    def launch(*args):
        if _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
            return runner(*args)
        run(grid, 1, 1, stream_of(index), function, meta, None, None, None, *args)
    return launch


def _hooked(hook) -> bool:
    """Whether a Triton launch hook would do anything: None, or a HookChain with no calls, does not.

    >>> _hooked(None), _hooked(print)
    (False, True)
    """
    return hook is not None and bool(getattr(hook, "calls", True))


def _fused_calls(plan: Plan, seg: Segment, rank: int, device: torch.device, ctx: RankContext,
                 check_indices: bool) -> list[tuple[Callable, Callable | None, tuple[str, ...], tuple[str, ...], bool]]:
    """(fn, first_fn, reads, writes, raw) for a fused segment: its kernel, or each step through torch
    where this rank's local shapes fit no scheduler (as run_fused does)."""
    spec = kernel_spec(plan, seg.steps, seg.inputs, seg.outputs, rank)
    try:
        kernel = schedulers.compile_kernel(spec)
    except schedulers.Unsupported:
        return [c for step in seg.steps for c in _aten_calls(plan, step, ctx, check_indices, device.type == "cuda")]
    lean, checked = _kernel_fn(kernel, device)
    return [(lean, checked, tuple(seg.inputs), tuple(seg.outputs), False)]


def _aten_calls(plan: Plan, step: ComputeStep, ctx: RankContext, check_indices: bool, cuda: bool = False
                ) -> list[tuple]:
    calls = []
    if check_indices and OPS[step.op].indexes is not None:
        rank = ctx.rank

        def check(*ts):  # a bad id names its tensor, not torch's IndexError deep in a kernel
            check_step_indices(plan, step, dict(zip(step.reads, ts)), rank)
            return ()
        calls.append((check, None, tuple(step.reads), (), True))
    calls.append((_aten_fn(plan, step, ctx, cuda), None, tuple(step.reads), tuple(step.writes), False))
    return calls


def _comm_calls(plan: Plan, c: Collective, rank: int, collective: CollectiveFn | None,
                bind: BindCollective | None) -> list[tuple]:
    """One call, or two where the binding can split the collective (start, then finish: see _overlap)."""
    if bind is not None:
        fn, first, *split = bind(c)
        if split and split[0] is not None:
            start, first_start = split
            pending = f"{c.dst}@pending"
            return [((lambda t: (start(t),)), (lambda t: (first_start(t),)), (c.src,), (pending,), False),
                    ((lambda finish: (finish(),)), None, (pending,), (c.dst,), False)]
        return [((lambda t: (fn(t),)), (lambda t: (first(t),)), (c.src,), (c.dst,), False)]
    if collective is None:
        raise PlanError(f"prepare: the plan has collective {c} but no collective function was given")
    return [((lambda t: (collective(plan, c, t, rank),)), None, (c.src,), (c.dst,), False)]


def _overlap(raw_calls: list[tuple]) -> list[tuple]:
    """Each collective's finish (a call that reads a '@pending' slot) moved down to just before the first
    call that reads what it gives (or the end): the compute between runs while the transfer is in flight.
    Every rank moves the same calls, so collectives still start in one order on every rank.

    >>> calls = [(None, None, ("a",), ("y@pending",), False), (None, None, ("y@pending",), ("y",), False),
    ...          (None, None, ("b",), ("z",), False), (None, None, ("y", "z"), ("w",), False)]
    >>> [c[3][0] for c in _overlap(calls)]  # z is computed while y travels
    ['y@pending', 'z', 'y', 'w']
    """
    out, waiting = [], []
    for call in raw_calls:
        reads = call[2]
        if any(r.endswith("@pending") for r in reads):
            waiting.append(call)
            continue
        due = [w for w in waiting if set(w[3]) & set(reads)]
        out += due
        waiting = [w for w in waiting if w not in due]
        out.append(call)
    return out + waiting


def prepare(plan: Plan, rank: int, inputs: Sequence[torch.Tensor], collective: CollectiveFn | None, *,
            segments: list[Segment] | None = None, bind_collective: BindCollective | None = None,
            check_indices: bool = True) -> Program:
    """Rank's program for inputs like these (program_inputs(plan) order), as flat calls. collective:
    run_rank's function (plan, c, local, rank) -> local result; or bind_collective(c) -> (fn, checked fn)
    of one tensor, bound once, or (fn, checked fn, start, checked start) where start(t) issues the collective
    and returns its finish(): finish runs just before the first call that reads the result (_overlap).
    segments: the lowered plan's with its matmul epilogues fused (lowering/epilogue.py) by default
    (eager_segments for torch only).

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> plan = ed.optimize(row_sum(4, 3), ed.DeviceMesh.arange(2))  # rows split: no collective
    >>> prepare(plan, 1, [torch.ones(2, 3)], None).run([torch.ones(2, 3)])
    [tensor([3., 3.])]
    """
    segments = epilogue_plan(plan).segments if segments is None else segments
    names = program_inputs(plan)
    if len(inputs) != len(names):
        raise PlanError(f"prepare: the program reads {len(names)} values {list(names)}, got {len(inputs)} tensors")
    device = inputs[0].device if inputs else torch.device("cpu")
    ctx = RankContext(plan.mesh, rank)
    slot: dict[str, int] = {v: i for i, v in enumerate(names)}
    raw_calls: list[tuple] = []  # (fn, first_fn, reads, writes, raw, segment index, comm)
    for i, seg in enumerate(segments):
        if seg.kind == "comm":
            built = _comm_calls(plan, seg.steps[0], rank, collective, bind_collective)
        elif seg.kind == "fused":
            built = _fused_calls(plan, seg, rank, device, ctx, check_indices)
        elif seg.kind == "gemm":
            built = [(gemm_fn(plan, seg, rank), None, tuple(seg.inputs), tuple(seg.outputs), False)]
        else:
            built = _aten_calls(plan, seg.steps[0], ctx, check_indices, device.type == "cuda")
        raw_calls += [(*b, i, seg.kind == "comm") for b in built]
    outputs = tuple(plan.outputs.values())
    raw_calls = _overlap(_share_rows(_fold_views(raw_calls, set(outputs))))
    for _, _, reads, writes, *_ in raw_calls:
        for v in (*reads, *writes):
            slot.setdefault(v, len(slot))
    last: dict[str, int] = {}  # the call after which a value is dead: its last reader, or its writer
    for k, (_, _, reads, writes, *_) in enumerate(raw_calls):
        for v in (*writes, *reads):
            last[v] = k
    keep = set(outputs)
    missing = [v for v in outputs if v not in slot]
    if missing:
        raise PlanError(f"prepare: outputs {missing} are neither inputs nor made by any segment")
    calls = []
    for k, (fn, first, reads, writes, raw, index, comm) in enumerate(raw_calls):
        frees = tuple(slot[v] for v in dict.fromkeys((*reads, *writes)) if last[v] == k and v not in keep)
        calls.append(Call(fn, tuple(slot[v] for v in reads), tuple(slot[v] for v in writes), frees, index,
                          comm, raw, first))
    return Program(plan, rank, names, outputs, calls, len(slot), segments, [s.describe() for s in segments],
                   [slot[v] for v in outputs], any(c.raw for c in calls))


def program_for(plan: Plan, rank: int, inputs: Sequence[torch.Tensor], collective: CollectiveFn | None, *,
                key: Any = None, segments: list[Segment] | None = None,
                bind_collective: BindCollective | None = None, check_indices: bool = True) -> Program:
    """prepare(...), once per (plan, rank, input signature, key, check_indices): cached on the plan
    object. key names what the collective function stands for (default: the function itself; the
    runtime passes what its bound collectives depend on, since it makes a new closure per run).

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> plan = ed.optimize(row_sum(4, 3), ed.DeviceMesh.arange(2))
    >>> x = torch.ones(2, 3)
    >>> program_for(plan, 1, [x], None) is program_for(plan, 1, [x * 2], None)  # same signature
    True
    """
    cache = plan.__dict__.setdefault("_programs", {})
    which = id(epilogue_plan(plan)) if segments is None else tuple(segments)  # re-lowered: prepared anew
    k = (rank, signature(inputs), collective if key is None else key, check_indices, which)
    prog = cache.get(k)
    if prog is None or prog.plan is not plan:
        prog = cache[k] = prepare(plan, rank, inputs, collective, segments=segments,
                                  bind_collective=bind_collective, check_indices=check_indices)
    return prog


__all__ = ["Program", "Call", "SegmentFailed", "prepare", "program_for", "program_inputs", "signature"]
