"""The sharding problem: a working copy of the fusion (with the decompositions of reducing composites
added as equal terms), every tensor's candidate layouts and pins, and every op's strategies on the
whole mesh with their predicted local cost. Plain data; the e-graph encodes it, the extractor prices
collectives from it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field


from egraph_did.rewrites import AxisStrategy, Operand, OpView, axis_strategies, collective_matmul
from egraph_did.rewrites.collective_matmul import add_ring_strategies, unringed
from egraph_did.rewrites.experts import expert_rows_attrs, makes_expert_rows
from egraph_did.rewrites import ring_attention

from .cost import CostModel
from .errors import PlanError
from .expand import expand
from .fusion import Expr, Fusion, Ops, as_fusion, replay
from .ir import TensorView
from .collectives import EXCHANGE_FLAGS, RING_FLAGS, exchange_bytes
from .layout import Layout, canonical_layout, is_valid, valid_layouts
from .physgraph import gc_paused
from .pins import layout_of
from .plan import SAVE_OP as SAVED
from .shards import RankContext, local_extents
from .mesh import DeviceMesh
from .ops import canonical_dtype, ops_where

# Composites whose reduction may run over a sharded axis: the e-graph also holds their decomposition,
# where rfactor rules apply to the primitive reductions.
REDUCING_COMPOSITES = ops_where(is_composite=True, reduces=True)


def _expands(e: Expr) -> bool:
    """Whether the e-graph holds e's decomposition beside it: a reducing composite, or an op that states
    its reduction split in blocks (rfactor: var_mean, attention over its keys)."""
    return (e.op.is_composite and e.op.reduces) or e.op.rfactor is not None


@dataclass(frozen=True)
class Strategy:
    """One way to run an expr on the whole mesh: a layout per operand and output, flags per mesh axis.

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> problem = build_problem(row_sum(8, 64), ed.DeviceMesh.arange(4))
    >>> [(str(s.inputs[0]), str(s.outputs[0]), s.rules[0]) for s in problem.strategies["y"]][:2]
    [('[S(0)]', '[S(0)]', 'reduce_other_axis'), ('[S(1)]', '[P]', 'sum_over_sharded_axis')]
    """

    key: str  # the expr's first output name
    sid: int
    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]
    flags: tuple[frozenset[str], ...]  # per mesh axis
    rules: tuple[str, ...]  # per mesh axis
    time: float
    memory: float  # bytes the outputs occupy on one device


@dataclass
class Problem:
    """The sharding problem of one fusion on one mesh: a working copy of the fusion, every tensor's
    valid layouts, the pins, and every expr's priced strategies (see build_problem).

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> fd, mesh = row_sum(8, 64), ed.DeviceMesh.arange(4)
    >>> _ = fd["x"].set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    >>> problem = build_problem(fd, mesh)
    >>> str(problem.pins["x"]), [str(lay) for lay in problem.deliverable("y")], problem.nbytes("x", problem.pins["x"])
    ('[S(1)]', ['[R]', '[S(0)]'], 512)
    """

    fusion: Fusion  # working copy: the user's exprs, then decompositions
    mesh: DeviceMesh
    cost_model: CostModel
    exprs: dict[str, Expr] = field(default_factory=dict)  # key -> expr
    strategies: dict[str, list[Strategy]] = field(default_factory=dict)
    equal: list[tuple[str, str]] = field(default_factory=list)  # (tensor, tensor computing the same value)
    pins: dict[str, Layout] = field(default_factory=dict)
    layouts: dict[str, list[Layout]] = field(default_factory=dict)  # every valid layout, partials included
    origin: dict[str, str] = field(default_factory=dict)  # decomposition tensor -> the composite it expands
    input_layouts: dict[str, list[Layout]] = field(default_factory=dict)  # overrides load_layouts()
    # restricted to another plan's strategies (build_problem(like=)); input_layouts alone cannot say so: a
    # plan may load no input (every output a constant's)
    restricted: bool = False
    unreplayed: list[str] = field(default_factory=list)  # the restricting plan's steps these shapes cannot run
    rewritten: dict[str, str] = field(default_factory=dict)  # tensor a program rewrite added -> the rewrite
    fused: dict[str, "Fused"] = field(default_factory=dict)  # tensor -> where its op sits in a fused kernel
    register_reads: set = field(default_factory=set)  # tensors some fusible reader takes in registers
    rewrites: tuple[str, ...] = ()  # the rewrites optimize named (egraph.saturate offers collective_matmul's rings)
    _nbytes: dict = field(default_factory=dict, repr=False, compare=False)  # nbytes: (name, layout) -> (tensor, mesh, bytes)

    def tensor(self, name: str) -> TensorView:
        """The working copy's tensor called `name`."""
        return self.fusion.tensors[name]

    def nbytes(self, name: str, layout: Layout) -> float:
        """Bytes of the largest shard of `name` under `layout` (what one device holds). Remembered per
        (name, layout) for this tensor object and mesh (pricing asks again for every node of a class)."""
        tv = self.fusion.tensors[name]
        hit = self._nbytes.get((name, layout))
        if hit is not None and hit[0] is tv and hit[1] is self.mesh:
            return hit[2]
        n = math.prod(local_extents(tv.shape, layout, self.mesh)) * tv.dtype.itemsize
        self._nbytes[(name, layout)] = (tv, self.mesh, n)
        return n

    def deliverable(self, name: str) -> list[Layout]:
        """Layouts `name` may be delivered in (an output, or a pinned tensor the plan must materialize):
        its pin, or any layout without a pending reduction."""
        if name in self.pins:
            return [self.pins[name]]
        return [lay for lay in self.layouts[name] if not lay.has_partial]

    def load_layouts(self, name: str) -> list[Layout]:
        """Layouts an input may be bound in: its pin, or (free) any layout without a pending reduction."""
        return self.input_layouts.get(name) or self.deliverable(name)


# ---------------------------------------------------------------------- working copy

def clone_fusion(src: Fusion) -> tuple[Fusion, Ops]:
    """A structural copy of src with the same tensor names (no pins).

    >>> from egraph_did.models import mlp
    >>> src = mlp(tokens=8, hidden=16).fusion
    >>> dst, ops = clone_fusion(src)
    >>> [str(e) for e in dst.exprs] == [str(e) for e in src.exprs], dst["x"] is src["x"]
    (True, False)
    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     fd.add_output(fd.ops.cast(fd.define_tensor((2,), name="x"), "float64"), name="y")
    >>> dict(clone_fusion(fd.fusion)[0].exprs[0].args)["dtype"]  # a dtype by name becomes a torch dtype
    torch.float64
    """
    def same(ops, e, args):
        if isinstance(args.get("dtype"), str):  # cast(x, "float64"): a dtype by name, made a torch dtype once
            args = {**args, "dtype": canonical_dtype(args["dtype"])}
        outs = ops._fusion.emit(e.op.name, **args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for old, tv in zip(e.outputs, outs):  # keep the user's names
            ops._fusion.tensors.pop(tv.name)
            tv.name = old.name
            ops._fusion.tensors[tv.name] = tv
        return outs
    dst, ops, new = replay(src, same)
    for name, tv in src.outputs.items():
        dst.outputs[name] = new[id(tv)]
    return dst, ops


def _add_decompositions(work: Fusion, ops: Ops, mesh: DeviceMesh, problem: Problem) -> None:
    """Append, for each reducing composite, its decomposition (and its rfactor by each mesh axis size),
    recording that the decomposition's outputs equal the composite's."""
    blocks = sorted({s for s in mesh.shape if s > 1})
    pending = [e for e in work.exprs if _expands(e)]
    for _ in range(4):  # composites inside decompositions (layer_norm -> var_mean) expand in turn
        start = len(work.exprs)
        for e in pending:
            args = dict(e.args)
            if e.op.rfactor is not None:  # var_mean: the parallel Welford merge; attention: the online softmax's
                variants = [lambda g=g: e.op.rfactor(ops, g, **args) for g in blocks]
            else:
                variants = [lambda: e.op.decompose(ops, **args)]
            for make in variants:
                first = len(work.exprs)
                outs = make()
                if outs is None:
                    continue
                for old, new in zip(e.outputs, outs if isinstance(outs, tuple) else (outs,)):
                    problem.equal.append((old.name, new.name))
                for d in work.exprs[first:]:
                    for o in d.outputs:
                        problem.origin[o.name] = problem.origin.get(e.outputs[0].name, e.outputs[0].name)
        pending = [e for e in work.exprs[start:] if _expands(e)]
        if not pending:
            break


# ---------------------------------------------------------------------- strategies

def op_view(e: Expr, d: int) -> OpView:
    """Expr e as the sharding rules see it on a mesh axis of `d` devices: operand and output shapes and
    dtypes by parameter, literal attributes.

    >>> from egraph_did.models import row_sum
    >>> v = op_view(row_sum(8, 64).fusion.exprs[0], 4)
    >>> v.op, v["x"].shape, v.attrs, v.d
    ('sum', (8, 64), (('dims', 1), ('keepdim', False)), 4)
    """
    operands = tuple(Operand(k, v.shape, v.dtype) for k, v in e.args if isinstance(v, TensorView))
    attrs = tuple((k, v) for k, v in e.args if not isinstance(v, TensorView)) + expert_rows_attrs(e)
    return OpView(e.op.name, operands, attrs, tuple(Operand("out", o.shape, o.dtype) for o in e.outputs), d)


def local_flops(e: Expr, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> float:
    """Floating-point work of one rank's kernel, from the local shapes.

    >>> from egraph_did.models import mlp
    >>> first = mlp(tokens=8, hidden=16).fusion.exprs[0]  # linear(x, w1): [8, 16] x [64, 16]^T
    >>> local_flops(first, [(8, 16), (64, 16)], [(8, 64)])  # 2 * 8 * 64 * 16
    16384.0
    """
    return e.op.count_flops(ins, outs, dict(e.args))


def _empty_in_empty_out(ins: tuple[Layout, ...], outs: tuple[Layout, ...], operands, outputs, mesh: DeviceMesh) -> bool:
    """Whether, on every rank that holds an empty shard of an operand or output, every output's shard is empty
    too and none is pending (a reduction of the axes it keeps: it maps the empty shard to an empty one, as an
    elementwise op does; torch reduces a non-empty axis of an empty tensor to an empty one). A reduction
    whose empty rank would still write something (a pending partial of nothing, welford_blocks' block of an
    empty shard) is not.

    >>> import torch
    >>> x, y = TensorView("x", (5, 3), torch.float64), TensorView("y", (3,), torch.float64)
    >>> mesh = DeviceMesh.arange(4)  # 3 columns over 4 ranks: the last rank holds none
    >>> _empty_in_empty_out((Layout.from_code("S1"),), (Layout.from_code("S0"),), [x], [y], mesh)  # sum over rows
    True
    >>> _empty_in_empty_out((Layout.from_code("S1"),), (Layout.from_code("R"),), [x], [y], mesh)
    False
    """
    if any(lay.has_partial for lay in outs):
        return False
    tensors = list(operands) + list(outputs)
    if not all(is_valid(lay, t.shape, mesh, allow_empty=True) for lay, t in zip(ins + outs, tensors)):
        return False
    for rank in mesh.ranks:
        ctx = RankContext(mesh, rank)

        def empty(lay, t):
            return any(lo >= hi for lo, hi in (ctx.shard_range(n, lay, a) for a, n in enumerate(t.shape)))
        if any(map(empty, ins, operands)) and not all(map(empty, outs, outputs)):
            return False
    return True


def _nesting_ok(combo: tuple[AxisStrategy, ...], ins: tuple[Layout, ...]) -> bool:
    """Rules are stated per mesh axis; a rule that reasons about the whole extent of its split
    (nestable=False) does not hold where another mesh axis splits the same tensor axis: each mesh
    axis's rule saw a different piece."""
    for s in combo:
        if not s.nestable:
            for lay, p in zip(ins, s.inputs):
                if p.is_shard and len(lay.sharding_axes(p.axis)) > 1:
                    return False
    return True


def signature(e: Expr) -> tuple:
    """Everything `expr_strategies` reads of e: the op, each operand's parameter, shape and dtype, each
    attribute (by type and repr: 1, 1.0 and True stay apart), each output's shape and dtype. Exprs of one
    signature (the layers of a model) have the same strategies on a mesh, but for their key.

    >>> from egraph_did.models import gpt_layer
    >>> sigs = [signature(e) for e in gpt_layer(batch=1, seq=8, hidden=16, heads=2, layers=2).fusion.exprs]
    >>> len(sigs), len(set(sigs))  # the second layer repeats the first's signatures
    (40, 11)
    """
    args = tuple((k, v.shape, v.dtype) if isinstance(v, TensorView) else (k, type(v), repr(v)) for k, v in e.args)
    return (e.op.name, id(e.op), args, tuple((o.shape, o.dtype) for o in e.outputs), expert_rows_attrs(e))


@dataclass(frozen=True)
class Fused:
    """Where an expr sits in the kernel the lowering fuses it into (lowering/segment.py runs consecutive
    fusible steps as one kernel): the operands it reads from the producer's registers, whether its output
    lives only in registers, and so what it costs beyond the kernel it joins (no launch where it joins a
    producer's)."""

    operands: frozenset = frozenset()  # parameter names read in registers
    output: bool = False  # every reader takes it in registers: never written


def _fuses(producer: Expr, consumer: Expr) -> bool:
    """Whether the lowering can run consumer in producer's kernel, reading producer's output in registers:
    both kernel primitives (or composites of them), one of them elementwise (a pointwise epilogue, or a
    reduction's pointwise prologue), one output each."""
    p, c = producer.op, consumer.op
    return (p.fusible and c.fusible and len(producer.outputs) == 1 and len(consumer.outputs) == 1
            and "pointwise" in (p.kind, c.kind) and not c.permutes)


def fusion_context(work: Fusion, materialized=()) -> dict[str, Fused]:
    """Fused per expr key: a fusible run of ops is priced as the one kernel the scheduler emits (its inputs
    read and its outputs written once, one launch), not op by op. materialized: tensors every plan writes
    (outputs, pins).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, w = fd.define_tensor((4, 8), name="x"), fd.define_tensor((8, 8), name="w")
    ...     fd.add_output(fd.ops.add(fd.ops.exp(fd.ops.linear(x, w)), 1.0), name="y")
    >>> ctx = fusion_context(fd.fusion)
    >>> ctx["exp_1"]  # reads the GEMM's output from memory (no kernel primitive), kept in registers for add
    Fused(operands=frozenset(), output=True)
    >>> ctx["y"]  # joins exp's kernel; an output is written
    Fused(operands=frozenset({'a'}), output=False)
    """
    real = _unsaved(work)
    readers: dict[str, list[Expr]] = {}
    for e in work.exprs:
        if e.op.name == SAVED:
            continue
        for v in {id(t): t for t in e.inputs}.values():
            readers.setdefault(real(v).name, []).append(e)
    keep = set(work.outputs) | set(materialized)
    out = {}
    for e in work.exprs:
        if e.op.name == SAVED:
            continue
        ins = frozenset(k for k, v in e.args if isinstance(v, TensorView) and work.producer(real(v)) is not None
                        and _fuses(work.producer(real(v)), e))
        name = e.outputs[0].name
        write_free = (len(e.outputs) == 1 and name not in keep and bool(readers.get(name))
                      and all(_fuses(e, r) for r in readers[name]))
        out[name] = Fused(ins, write_free)
    for e in work.exprs:  # saved(t) is written where t is (a collective on it breaks t's kernel as one on t
        if e.op.name == SAVED:  # would: collective_cost); the marker itself reads nothing in registers
            out[e.outputs[0].name] = Fused(output=out.get(real(e.outputs[0]).name, Fused()).output)
    return out


def _unsaved(work: Fusion):
    """The tensor a value aliases through grad's saved markers (saved(saved(t)) -> t; any other -> itself).
    The marker is no kernel: fusion reads through it, so a marked program is priced as the plain one. (Its
    template "{x}" made it a fusible producer of its own: every reader of saved(t) was priced as reading it
    in registers with no launch, 582 us against 622 us for the same plan of the data-parallel MLP step.)

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((4,), name="x")
    ...     fd.add_output(fd.ops.exp(fd.ops.saved(fd.ops.saved(x))), name="y")
    >>> [_unsaved(fd.fusion)(e.inputs[0]).name for e in fd.fusion.exprs]
    ['x', 'x', 'x']
    """
    alias = {e.outputs[0].name: e.inputs[0] for e in work.exprs if e.op.name == SAVED}

    def real(v: TensorView) -> TensorView:
        while v.name in alias:
            v = alias[v.name]
        return v
    return real


def expr_strategies(e: Expr, mesh: DeviceMesh, cm: CostModel, problem: Problem | None = None,
                    priced: dict | None = None, fused: Fused = Fused()) -> list[Strategy]:
    """Every strategy of e on the mesh: the product of its one-axis rules, valid shapes only, priced.
    priced: a cache by signature (see `signature`) of the rows, for exprs priced on this mesh and cost
    model (build_problem keeps one per problem). fused: where e sits in a fused kernel (fusion_context):
    what it reads or writes in registers costs no memory traffic, and joining a producer's kernel no launch.

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> mesh = ed.DeviceMesh([[0, 1], [2, 3]])
    >>> problem = build_problem(row_sum(8, 64), mesh)
    >>> strategies = expr_strategies(problem.exprs["y"], mesh, problem.cost_model, problem)
    >>> len(strategies), strategies[1].rules  # 4 rules per mesh axis, every pair fits
    (16, ('reduce_other_axis', 'sum_over_sharded_axis'))
    """
    if priced is None:
        rows = _priced_rows(e, mesh, cm, fused)
    else:
        sig = (signature(e), fused)
        rows = priced.get(sig)
        if rows is None:
            rows = priced[sig] = _priced_rows(e, mesh, cm, fused)
    key = e.outputs[0].name
    return [Strategy(key, sid, *row) for sid, row in enumerate(rows)]


def _exchange_time(e: Expr, combo, mesh: DeviceMesh, cm: CostModel) -> float:
    """The all-to-all inside a step whose kernel is an expert exchange (collectives.EXCHANGES) on a mesh axis:
    the rows the dispatch receives (x's) or the combine sends (the output's), a rank's balanced share."""
    t = 0.0
    for m, c in enumerate(combo):
        for flag in c.flags:
            if flag in EXCHANGE_FLAGS:
                # the dispatch moves the operand split on its rows (grouped_mm's x; grouped_mm_wgrad's x or g)
                ts = [v for _, v in e.args if isinstance(v, TensorView)]
                rows = e.outputs[0] if EXCHANGE_FLAGS[flag].src == "spans" else next(
                    v for v, p in zip(ts, c.inputs) if p.is_shard)
                nbytes = exchange_bytes(rows.shape[0], rows.shape[1], rows.dtype.itemsize, mesh.shape[m])
                t += (cm.exchange_time(nbytes, mesh.shape[m], m, mesh.ndim) if hasattr(cm, "exchange_time") else
                      cm.collective_time("alltoall", nbytes, mesh.shape[m], m, mesh.ndim))
    return t


def _priced_rows(e: Expr, mesh: DeviceMesh, cm: CostModel, fused: Fused = Fused(),
                 empty_reductions: bool = False) -> list[tuple]:
    """(inputs, outputs, flags, rules, time, memory) of each of e's strategies, in strategy id order.
    empty_reductions: a reduction also takes layouts that leave a rank empty where its kernel computes nothing
    there (_empty_in_empty_out); a replay's (_restrict_to), not the e-graph's rules."""
    operands = [v for _, v in e.args if isinstance(v, TensorView)]
    in_registers = [k in fused.operands for k, v in e.args if isinstance(v, TensorView)]
    per_axis: list[list[AxisStrategy]] = [axis_strategies(op_view(e, size)) for size in mesh.shape]
    out: list[tuple] = []
    held = _Held(operands + list(e.outputs), mesh, e.op.empty_shards)
    n_in = len(operands)
    flags_of = {id(c): c.flags for cs in per_axis for c in cs}  # (a property: a new frozenset each read)
    for combo in itertools.product(*per_axis):
        ins_at = [held.at(i, [c.inputs[i] for c in combo]) for i in range(n_in)]
        outs_at = [held.at(n_in + i, [c.outputs[i] for c in combo]) for i in range(len(e.outputs))]
        ins, outs = tuple(h[0] for h in ins_at), tuple(h[0] for h in outs_at)
        if not all(h[1] for h in ins_at + outs_at) and not (
                empty_reductions and e.op.reduces and _empty_in_empty_out(ins, outs, operands, e.outputs, mesh)):
            continue
        if not _nesting_ok(combo, ins) or len({c.local.name for c in combo if c.local}) > 1:
            continue  # a step runs one local kernel (local.run_local): two kernels' identities never combine
        flags = tuple(flags_of[id(c)] for c in combo)
        in_sized, out_sized = [held.sized(h) for h in ins_at], [held.sized(h) for h in outs_at]
        in_shapes, out_shapes = [x for x, _ in in_sized], [x for x, _ in out_sized]
        in_bytes = sum(b for _, b in in_sized)
        out_bytes = sum(b for _, b in out_sized)
        if e.op.kind == "gather":  # a gather reads its indices and the rows it picks, not the whole table
            k = [p for p, v in e.args if isinstance(v, TensorView)].index(e.op.indexes.index)
            in_bytes = math.prod(in_shapes[k]) * operands[k].dtype.itemsize + out_bytes
        launch = cm.launch_overhead
        if not any(flags):  # a rank-local kernel runs alone: the lowering fuses no flagged step
            in_bytes -= sum(b for (_, b), r in zip(in_sized, in_registers) if r)
            launch = 0.0 if any(in_registers) else launch
        moved = in_bytes + (0 if fused.output and not any(flags) else out_bytes)
        if e.op.metadata_only:
            time, mem = 0.0, 0.0
        else:
            dtype = operands[0].dtype if operands and operands[0].dtype.is_floating_point else e.outputs[0].dtype
            flop_shapes = in_shapes
            if any(EXCHANGE_FLAGS[f].src == "blocks" for c in combo for f in c.flags if f in EXCHANGE_FLAGS):
                # a dispatch computes the rows it receives, its experts' share of every rank's block: x whole
                flop_shapes = [tuple(operands[0].shape)] + list(in_shapes[1:])
            time = cm.compute_time(local_flops(e, flop_shapes, out_shapes), moved, dtype) - cm.launch_overhead + launch
            time += _exchange_time(e, combo, mesh, cm)
            mem = float(out_bytes)
        out.append((ins, outs, flags, tuple(c.rule for c in combo), time, mem))
    return out


class _Held:
    """_priced_rows' layouts of its tensors, each made once per placements (the per-axis rules' own objects):
    on a 2-D mesh a combo (a product of the axes' strategies) often repeats a tensor's layout, and its Layout,
    fit, local extents and bytes are the same each time (a 2x2 mesh's Llama step: ~23% of them repeat). Its
    shapes are read once (TensorView.shape builds a tuple each read).

    >>> import torch
    >>> from egraph_did.layout import S
    >>> held = _Held([TensorView("x", (6, 8), torch.float32)], DeviceMesh([[0, 1], [2, 3]]), False)
    >>> split = S(0)
    >>> h = held.at(0, [split, split])
    >>> str(h[0]), h[1], held.sized(h), held.at(0, [split, split]) is h  # 3 | 3 rows, then 2, 1
    ('[S(0), S(0)]', True, ((2, 8), 64), True)
    """

    def __init__(self, tensors: list[TensorView], mesh: DeviceMesh, allow_empty: bool):
        self.tensors, self.mesh, self.allow_empty = tensors, mesh, allow_empty
        self.shapes = [t.shape for t in tensors]  # (a property: a new tuple each read)
        self.seen: list[dict] = [{} for _ in tensors]

    def at(self, i: int, placements: list) -> list:
        """[Layout, whether it fits tensor i, (local extents, bytes) or None until sized]."""
        key = tuple(map(id, placements))  # the per-axis rules' own objects, alive as long as the call
        got = self.seen[i].get(key)
        if got is None:
            lay = Layout(tuple(placements))
            got = self.seen[i][key] = [lay, is_valid(lay, self.shapes[i], self.mesh, self.allow_empty), None, i]
        return got

    def sized(self, h: list) -> tuple[tuple[int, ...], int]:
        """(the largest local shape, its bytes) of h's tensor under h's layout (computed where a combo is kept)."""
        if h[2] is None:
            i = h[3]
            ext = local_extents(self.shapes[i], h[0], self.mesh)
            h[2] = (ext, math.prod(ext) * self.tensors[i].dtype.itemsize)
        return h[2]


# ---------------------------------------------------------------------- build

def build_problem(fd, mesh: DeviceMesh, cost_model: CostModel | None = None,
                  pins: dict[str, Layout] | None = None, like=None, rewrites=()) -> Problem:
    """Working fusion, pins read from the user's loop domains (plus `pins`), strategies for every expr.
    like: a Plan of the same fusion (at any shapes) whose layouts and strategies are the only ones kept.
    rewrites: the program rewrites (rewrites/algebra.py) whose equal programs the working fusion gains.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((8, 64), name="x")
    ...     fd.add_output(fd.ops.softmax(x, -1), name="y")
    >>> problem = build_problem(fd, ed.DeviceMesh.arange(4), pins={"y": Layout.from_code("R")})
    >>> problem.equal, [e.op.name for e in problem.fusion.exprs]  # softmax and its decomposition
    ([('y', 'div_5')], ['softmax', 'amax', 'sub', 'exp', 'sum', 'div'])
    """
    user = as_fusion(fd)
    if not user.outputs:
        raise PlanError("the fusion has no outputs; call fd.add_output(tensor, name=...)")
    with gc_paused():
        return _build(user, mesh, cost_model, pins, like, rewrites)


def _build(user: Fusion, mesh: DeviceMesh, cost_model: CostModel | None, pins, like, rewrites) -> Problem:
    """build_problem's work (the collector paused around it)."""
    cm = cost_model or CostModel.h200()
    work, ops = clone_fusion(user)
    problem = Problem(work, mesh, cm)
    problem.rewrites = tuple(rewrites or ())
    for tv in user.all_tensors():
        if tv.mesh is not None:
            problem.pins[tv.name] = layout_of(tv, mesh)
    for name, lay in (pins or {}).items():
        if name not in work.tensors:
            raise PlanError(f"pin for unknown tensor {name!r}")
        problem.pins[name] = canonical_layout(lay, mesh)
    _add_decompositions(work, ops, mesh, problem)
    for eq in expand(work, ops, rewrites, mesh, cm, like):
        problem.rewritten[eq.new] = eq.rewrite
        problem.origin[eq.new] = eq.old or eq.new  # the program's own name stays the class's name
        if eq.old is not None:
            problem.equal.append((eq.old, eq.new))
    by_shape: dict[tuple[int, ...], list[Layout]] = {}  # the layouts of a shape, on this mesh
    rows = makes_expert_rows(work.exprs)  # expert rows (Pe) exist in programs of grouped matmuls only
    for tv in work.all_tensors():
        shape = tuple(tv.shape)
        if shape not in by_shape:  # a rank may hold nothing: only ops that compute on empty shards take those
            by_shape[shape] = list(valid_layouts(shape, mesh, partial=True, allow_empty=True, rows=rows))
        problem.layouts[tv.name] = list(by_shape[shape])
    for name, lay in problem.pins.items():
        if not is_valid(lay, work.tensors[name].shape, mesh, allow_empty=True):
            raise PlanError(f"{name}: pinned layout {lay} does not fit its shape {work.tensors[name].shape}")
    priced: dict[tuple, list[tuple]] = {}  # signature -> its strategies' rows, on this mesh and cost model
    problem.fused = fused = fusion_context(work, problem.pins)
    real = _unsaved(work)  # a reader of saved(t) in registers reads t's: a collective on either breaks it
    problem.register_reads = {n for e in work.exprs for k, v in e.args
                              if isinstance(v, TensorView) and k in fused[e.outputs[0].name].operands
                              for n in (v.name, real(v).name)}
    for e in work.exprs:
        key = e.outputs[0].name
        problem.exprs[key] = e
        problem.strategies[key] = expr_strategies(e, mesh, cm, problem, priced, fused[key])
    if collective_matmul.NAME in problem.rewrites:  # rings of GEMMs and their collectives, priced (a replay keeps its own)
        add_ring_strategies(problem, signature)
        ring_attention.add_attention_rings(problem)  # rings of attention and its key/value all-gather
    if like is not None:
        _restrict_to(problem, like)
    return problem


def _unreplayed(problem: Problem, key: str, ins: tuple[Layout, ...], outs: tuple[Layout, ...]) -> str:
    """A like plan's step these shapes give no strategy, and why (optimize's error names it where the replay
    then reaches no layout of an output)."""
    e = problem.exprs[key]
    tensors = [v for _, v in e.args if isinstance(v, TensorView)] + list(e.outputs)
    layouts = list(ins) + list(outs)
    step = (f"{', '.join(f'{t.name}:{lay}' for t, lay in zip(e.outputs, outs))} = {e.op.name}("
            f"{', '.join(f'{t.name}:{lay}' for t, lay in zip(tensors, ins))})")
    if not all(is_valid(lay, t.shape, problem.mesh, allow_empty=True) for lay, t in zip(layouts, tensors)):
        return f"{step} does not fit these shapes"
    empty = next((f"{t.name} {list(t.shape)}" for lay, t in zip(layouts, tensors)
                  if not is_valid(lay, t.shape, problem.mesh)), None)
    if empty is None:
        return f"{step}, which no rule derives at these shapes"
    return f"{step} leaves a rank with no element of {empty} ({e.op.name} computes only on shards that hold data)"


def _other_term(e: Expr, step, like) -> str | None:
    """How the like plan's step differs from this fusion's expr of its name, where it is another term (None
    where it is the same one at other shapes): its op, or its operands' and outputs' number of axes, which a
    replay never changes. The op alone let a rewritten term whose name the replay gave another add keep the
    plan's strategies: the plan's sum of attention outputs [1, 1, 32768, 128] on [S(2)] imposed on RMSNorm's
    mean + eps [1, 12, 1], refused as unreachable far from the cause."""
    if e.op.name != step.op:
        return f"by {step.op}, this fusion by {e.op.name}"
    ours = [t.shape for _, t in e.args if isinstance(t, TensorView)] + [t.shape for t in e.outputs]
    theirs = [like.values[v].shape for v in (*step.operands.values(), *step.outputs)]
    if [len(x) for x in ours] == [len(x) for x in theirs]:
        return None
    return (f"by {step.op} of shapes {[list(x) for x in theirs]}, this fusion by {e.op.name} of "
            f"{[list(x) for x in ours]}")


def _restrict_to(problem: Problem, like) -> None:
    """Keep only the strategies and input layouts another plan of the same fusion used."""
    problem.restricted = True
    for s in like.compute_steps:  # by name, its strategies would be kept for another term: a plan with no way through
        if s.key in problem.exprs and (theirs := _other_term(problem.exprs[s.key], s, like)):
            raise PlanError(f"optimize(like=plan): the plan computes {s.key} {theirs}: the plan is of another program "
                            f"(an export follows the module's dtype and device: a float32 module drops the casts a "
                            f"bf16 one has), or the program rewrites named their terms differently at these shapes; "
                            f"plan the same program at both shapes, or optimize without like=")
    used: dict[str, set] = {}
    serving = []  # each step's key, layouts and the (inputs, outputs) that would replay it
    for s in like.compute_steps:
        key = s.key
        ins = tuple(like.values[v].layout for v in s.operands.values())
        outs = tuple(like.values[o].layout for o in s.outputs)
        used.setdefault(key, set()).add((ins, outs))
        serving.append((key, ins, outs, {(ins, outs)}))
        for flag, axes in s.flags:  # a ring: the plain GEMM it replaced serves where these shapes cannot ring
            if flag in RING_FLAGS and not any(
                    (t.inputs, t.outputs) == (ins, outs) for t in problem.strategies.get(key, ())):
                ring = RING_FLAGS[flag].name
                plain = (unringed(ring, ins, outs, axes[0]) if ring not in ring_attention.RULES else
                         ring_attention.unringed(s.op, tuple(s.operands), ins, outs, axes[0]))
                used[key].add(plain)
                serving[-1][3].add(plain)
    for key, strats in problem.strategies.items():
        keep = used.get(key, set())
        kept = [s for s in strats if (s.inputs, s.outputs) in keep]
        missing = keep - {(s.inputs, s.outputs) for s in kept}
        if missing and problem.exprs[key].op.reduces:
            # the plan's layouts leave a rank empty at these shapes (4 ranks over a head dim of 3): the problem
            # gives a reduction no such strategy, but one that keeps the emptied axis computes nothing there,
            # so the plan's strategy stands (else the replay of a valid plan found no route: 'no layout ...
            # is reachable', test_plan_replay_at_shapes_that_leave_a_rank_empty)
            e = problem.exprs[key]
            kept += [Strategy(key, 0, *row) for row in _priced_rows(e, problem.mesh, problem.cost_model,
                                                                     problem.fused[key], empty_reductions=True)
                     if (row[0], row[1]) in missing]
        problem.strategies[key] = [dataclasses.replace(s, sid=i) for i, s in enumerate(kept)]
    kept_pairs = {key: {(s.inputs, s.outputs) for s in ss} for key, ss in problem.strategies.items()}
    problem.unreplayed = [_unreplayed(problem, key, ins, outs) for key, ins, outs, pairs in serving
                          if key in kept_pairs and not pairs & kept_pairs[key]]
    for name, vals in like.inputs.items():
        problem.input_layouts[name] = [canonical_layout(like.values[v].layout, problem.mesh) for v in vals]


__all__ = ["Problem", "Strategy", "build_problem", "expr_strategies", "signature", "clone_fusion", "REDUCING_COMPOSITES"]
