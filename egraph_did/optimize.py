"""optimize(): fusion -> problem -> e-graph (saturated) -> priced graph -> DAG extraction -> Plan."""
from __future__ import annotations

import dataclasses
import functools
import logging
import re
import time
from collections import defaultdict

from . import collectives
from .chain import WINDOW, Chain, Refused, find_chain, stitch, window
from .cost import CostModel, size_text
from .egraph import saturate
from .errors import MemoryBoundError, PlanError
from .expand import RewriteSet, check_rewrites
from .explain import whys
from .physgraph import Node, PhysGraph, gc_paused, post_order
from .fusion import as_fusion
from .extract import ROOT, Selection, _topo_order, exact, greedy_dag, with_roots
from .layout import Layout, R
from .mesh import DeviceMesh
from .pins import PinView, pin_of, view_pins
from .plan import SAVE_OP, Collective, ComputeStep, Plan, StepMemory, Value, check_optimize_args
from .grad import NEXT
from .problem import Problem, build_problem
from .protocol_cache import protocol_attrs_cached

# one INFO line per pass (problem, e-graph, pricing, extraction seconds, graph size, predicted time): a long
# plan shows where it is; `logging.basicConfig(level=logging.INFO)` prints them
log = logging.getLogger("egraph_did")


def price(graph: PhysGraph, problem: Problem) -> None:
    """Set every node's predicted seconds and the bytes its result occupies on one device.

    >>> from egraph_did.models import row_sum
    >>> problem = build_problem(row_sum(8, 64), DeviceMesh.arange(4))
    >>> graph = PhysGraph({"x:S1": [Node("Load", (), "x")], "x:R": [Node("Coll", ("x:S1",), "allgather", 0)]},
    ...                   ident={"x:S1": ("x", "S1", 0), "x:R": ("x", "R", 1)})
    >>> price(graph, problem)
    >>> [(round(n.cost * 1e6, 2), n.memory) for c in ("x:S1", "x:R") for n in graph.classes[c]]
    [(0.0, 512), (10.0, 2048)]
    """
    with gc_paused():
        _price(graph, problem)


def _price(graph: PhysGraph, problem: Problem) -> None:
    """price's work (the collector paused around it, as around the other stages), one class at a time: a
    class's tensor, bytes and place in the step's memory model are looked up once for all its nodes, and a
    collective's seconds once per distinct key of what they depend on (_Moves: a 2-D mesh's graph prices
    ~160k collectives over ~11k such keys). The keys are looked up in two steps, the target's (its layout and
    tensor's `of`, once a class) then the node's (collective, axis, source layout): a nested key's hash is
    computed again at each lookup, and a class's collectives share their target."""
    strategies = {(k, s.sid): s for k, ss in problem.strategies.items() for s in ss}
    model = step_memory(problem)
    moves = _Moves(problem)
    nbytes, miss = moves.nbytes, moves.price
    into: dict[tuple, dict] = {}  # (target layout, of(tensor)) -> {(collective, axis, source layout): seconds}
    ident = graph.ident
    for cls, nodes in graph.classes.items():
        where = ident.get(cls)  # (tensor, layout, level); None for a multi-output run's tuple or a root
        if where is None:
            whole, t, dst, held, costs = True, None, None, 0.0, None
        else:
            t, dst, _ = where
            # under a step's memory model a node that computes nothing (Load, Keep, Coll, Proj) holds its
            # class's bytes only where its tensor counts
            whole = model is None or model.counts(t)
            held = nbytes(t, dst) if whole else 0.0
            of = moves.of(t)
            costs = into.get((dst, of))
            if costs is None:
                costs = into[(dst, of)] = {}
        for n in nodes:
            op = n.op
            if op == "Coll":
                src = ident[n.children[0]][1]
                cost = costs.get((n.key, n.sid, src))
                if cost is None:
                    cost = costs[(n.key, n.sid, src)] = miss((n.key, n.sid, src, dst, of), t)
                n.cost = cost
                n.memory = held
            elif op == "Apply":
                s = strategies[(n.key, n.sid)]
                n.cost, n.memory = s.time, s.memory
                if model is not None:
                    n.memory = _held(graph, problem, model, cls, n)
            elif op == "Load":
                n.memory = held
            elif not whole:
                n.memory = 0.0


class _Moves:
    """What collective_cost's seconds depend on: the collective, the mesh axis, the source and target layouts and
    `of(tensor)`, the tensor's shape and dtype (its bytes before and after), whether it is a fused kernel's output
    and whether a reader takes it in registers (price computes them; _price keeps each once per such key). Bytes
    (problem.nbytes) once per shape, dtype and layout: a model's layers share their shapes.

    >>> from egraph_did.models import row_sum
    >>> moves = _Moves(build_problem(row_sum(8, 64), DeviceMesh.arange(4)))
    >>> key = ("allreduce", 0, "P", "R", moves.of("y"))
    >>> round(moves.price(key, "y") * 1e6, 2), moves.nbytes("y", "R")  # two latencies of 10 us; 8 floats
    (20.0, 32)
    """

    def __init__(self, problem: Problem):
        self.problem, self.held, self.tensors, self.layouts = problem, {}, {}, {}

    def of(self, t: str) -> tuple:
        """What a collective's seconds read of tensor t: ((shape, dtype), fused output, read in registers)."""
        got = self.tensors.get(t)
        if got is None:
            tv, fused = self.problem.fusion.tensors[t], self.problem.fused.get(t)
            got = self.tensors[t] = ((tuple(tv.shape), tv.dtype), fused is not None and fused.output,
                                     t in self.problem.register_reads)
        return got

    def layout(self, code: str) -> Layout:
        lay = self.layouts.get(code)
        if lay is None:
            lay = self.layouts[code] = Layout.from_code(code)
        return lay

    def nbytes(self, t: str, code: str) -> float:
        """problem.nbytes(t, the layout of `code`), by shape, dtype and code."""
        key = (self.of(t)[0], code)
        b = self.held.get(key)
        if b is None:
            b = self.held[key] = self.problem.nbytes(t, self.layout(code))
        return b

    def price(self, key: tuple, t: str) -> float:
        """The seconds of key = (kind, axis, source code, target code, of(t)) for tensor t."""
        kind, axis, src, dst, _ = key
        return collective_cost(self.problem, kind, axis, t, self.layout(src), self.layout(dst),
                               self.nbytes(t, src), self.nbytes(t, dst))[0]


def step_memory(problem: Problem) -> StepMemory | None:
    """The memory model of a training step (plan.StepMemory), where the backward reads forward values
    through the saved marker (ed.grad's); None for other fusions: every value counts, for the whole step."""
    if not any(e.op.name == SAVE_OP for e in problem.exprs.values()):
        return None
    f = problem.fusion
    return StepMemory.of_step((t.name for t in f.inputs), (t.name for t in f.outputs.values()))


def _held(graph: PhysGraph, problem: Problem, model: StepMemory, cls: str, n: Node) -> float:
    """A node's bytes under the step's memory model: its class's bytes where they are held across the step."""
    if n.op != "Apply":
        return n.memory if cls not in graph.ident or model.counts(graph.ident[cls][0]) else 0.0
    e = problem.exprs[n.key]
    if cls not in graph.ident:  # a multi-output op's tuple class
        return n.memory if any(model.counts(o.name) for o in e.outputs) else 0.0
    t, lay, _ = graph.ident[cls]
    operand = graph.ident[n.children[0]][0] if e.op.name == SAVE_OP else None
    if not model.counts(t, e.op.name, operand):
        return 0.0
    return problem.nbytes(t, Layout.from_code(lay)) if e.op.name == SAVE_OP else n.memory


def collective_cost(problem: Problem, kind: str, axis: int, tensor: str, src: Layout, dst: Layout,
                    src_bytes: float | None = None, dst_bytes: float | None = None) -> tuple[float, float]:
    """(seconds, bytes moved) for one collective: its registry entry says which bytes it moves (of what a
    rank holds before and after) and the cost model prices them; a local one (a slice) is a copy kernel.

    >>> from egraph_did.models import row_sum
    >>> problem = build_problem(row_sum(8, 64), DeviceMesh.arange(4))
    >>> secs, nbytes = collective_cost(problem, "allreduce", 0, "y", Layout.from_code("P"), Layout.from_code("R"))
    >>> round(secs * 1e6, 2), nbytes  # y is 8 floats; an allreduce pays two latencies of 10 us
    (20.0, 32)
    """
    cm, mesh = problem.cost_model, problem.mesh
    entry = collectives.get(kind, f"optimize: {tensor}")
    # src_bytes, dst_bytes: problem.nbytes of src and dst where the caller holds them (pricing a graph)
    held = problem.nbytes(tensor, dst) if dst_bytes is None else dst_bytes
    before = problem.nbytes(tensor, src) if src_bytes is None else src_bytes
    # a collective between two ops the lowering would fuse breaks their kernel: the producer writes what it
    # would have kept in registers, and the reader reads it back (the fused prices counted neither)
    fused = problem.fused.get(tensor)
    broken = ((before if fused is not None and fused.output else 0.0)
              + (held if tensor in problem.register_reads else 0.0)) / cm.hbm_bandwidth
    if not entry.communicates:  # read and write what the rank keeps
        return cm.compute_time(0.0, 2 * held, problem.tensor(tensor).dtype) + broken, 0.0
    nbytes = entry.nbytes(before, held)
    return cm.collective_time(kind, nbytes, mesh.shape[axis], axis, mesh.ndim) + broken, nbytes


def optimize(fd, mesh: DeviceMesh, cost_model: CostModel | None = None, extractor: str = "greedy",
             like: Plan | None = None, time_limit: float | None = None, rewrites=None, chain: bool = True) -> Plan:
    """Lay out every tensor of `fd` on `mesh` at the least predicted time.

    Tensors given a mesh (set_device_mesh, plus DID splits) are pinned exactly; the rest are free.
    extractor: "greedy" (greedy-DAG) or "exact" (0/1 program, HiGHS). like: pin every tensor to the
    layout another plan chose (a plan of the same fusion at other shapes). time_limit: seconds the
    exact extractor's solver may run (default 60); past it the plan is the best found, with
    plan.method "exact-unproven" (extractor="exact" only). A training step (ed.training_step) is planned as a
    loop, each x taken in the layout next.x is delivered in: a first pass over the whole graph, whose plan gives
    the loops' pins (the exact extractor leaves it unproven unless it is a loop itself: it is then a candidate
    plan), then a pass per loop, each proven optimal under its pins; plan.stats["passes"] lists them. rewrites: the program rewrites of
    rewrites/algebra.py the e-graph may apply, by name (None: all; (): none, the program as written). chain: plan
    a chain of identical layers (at least 5) as a window of four and stamp its middle layer's plan on the others
    (egraph_did/chain.py; the window planned without a memory bound, the stamped plan taken where it fits one;
    the whole graph where the window's plan is not periodic or does not fit, with like= or view pins); False:
    plan the whole graph.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((64, 65536), name="x")
    ...     fd.add_output(fd.ops.sum(x, 1), name="y")
    >>> mesh = ed.DeviceMesh.arange(4)
    >>> _ = x.set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    >>> _ = fd["y"].set_device_mesh(mesh)  # pinned replicated
    >>> plan = ed.optimize(fd, mesh)
    >>> [c.kind for c in plan.collectives]
    ['allreduce']
    """
    check_optimize_args(fd, mesh, cost_model, extractor, like)
    user = as_fusion(fd)
    fd, views = view_pins(user, mesh)  # pins no layout names, as layouts of reshaped views
    if views and loop_ties(fd):
        raise PlanError(f"optimize: {', '.join(views)} {'is' if len(views) == 1 else 'are'} pinned as a view "
                        f"({'; '.join(map(str, views.values()))}), which training-step loops do not carry yet: pin "
                        f"outer_split(axis, mesh size) then parallelize the outer part")
    if like is not None and (views or like.views):
        like = _like_in_view_names(like, views)
    time_limit = _check_time_limit(time_limit, extractor)
    names = check_rewrites(rewrites)
    if not isinstance(chain, bool):
        raise PlanError(f"optimize: chain must be True or False, got {chain!r}")
    found = None
    if chain and like is None and not views:
        found = find_chain(as_fusion(fd))
    try:
        with protocol_attrs_cached():  # egglog's declarations checks, at 3.12's cost on 3.11
            if found is not None:
                plan = _optimize_chain(found, fd, mesh, cost_model, extractor, time_limit, names)
            else:
                plan = _optimize(fd, mesh, cost_model, extractor, like, time_limit, names, views)
    except PlanError as e:  # an error about a view names the tensor the user pinned
        if views:
            e.args = (_as_pinned(str(e), views),) + e.args[1:]
        raise
    plan.unread = [t.name for t in user.inputs if t.name not in plan.inputs]  # read by no output: not loaded
    for tv in user.inputs:  # a pinned input no output reads: its pin as given (a view pin's too: no view is held)
        if tv.name in plan.unread and tv.mesh is not None and tv.name not in plan.pinned_loops:
            plan.pinned_loops[tv.name] = [tv.loop_str(), views[tv.name].layout.code() if tv.name in views
                                          else pin_of(tv, mesh).code()]
    return plan


def _optimize_chain(found: Chain, fd, mesh: DeviceMesh, cost_model, extractor: str, time_limit: float, names) -> Plan:
    """optimize of a chain of layers: its window planned, then stitched (chain.py); the whole graph where the
    window's plan cannot be stamped (plan.stats["chain_refused"] says why)."""
    t0 = time.perf_counter()
    cm = cost_model or CostModel.h200()
    small = window(found)
    # the window holds four layers' memory, not L's: it is planned without the bound, and its stamped plan is
    # taken where it fits (the plan without a bound that fits is the plan under it); else the whole graph
    planned = _optimize(small, mesh, dataclasses.replace(cm, memory_limit=None), extractor, None, time_limit, names, {})
    t1 = time.perf_counter()
    try:
        plan = stitch(planned, found, small)
        if cm.memory_limit is not None and plan.memory > cm.memory_bound:
            raise Refused(f"the stamped plan needs {size_text(plan.memory)} per device, over the bound of "
                          f"{size_text(cm.memory_limit)}")
        plan.cost_model = cm
    except Refused as e:
        log.info("optimize: the window's plan of %d layers is not stamped (%s): planning the whole graph",
                 found.layers, e)
        plan = _optimize(fd, mesh, cost_model, extractor, None, time_limit, names, {})
        plan.stats["chain_refused"] = str(e)
        return plan
    t2 = time.perf_counter()
    log.info("optimize: %d layers planned as a window of %d (%.2f s), stitched in %.2f s", found.layers, WINDOW,
             t1 - t0, t2 - t1)
    plan.stats.update(chain={"layers": found.layers, "window_s": t1 - t0, "stitch_s": t2 - t1,
                             "window_steps": len(planned.steps), "window_ms": planned.predicted_time * 1e3},
                      total_s=t2 - t0)
    return plan


def _like_in_view_names(like: Plan, views: dict[str, PinView]) -> Plan:
    """A like= plan as view_pins' fusion names its inputs and outputs (a viewed one by its view), so the replay
    keeps the layouts of the same terms; PlanError where the two fusions pin different tensors as views.

    >>> import egraph_did as ed
    >>> mesh = ed.DeviceMesh.arange(2)
    >>> def fusion(rows):
    ...     with ed.FusionDefinition() as fd:
    ...         w = fd.define_tensor((rows, 4), name="w")
    ...         fd.add_output(fd.ops.relu(w), name="y")
    ...     _ = w.set_device_mesh(mesh).outer_split(0, 2).outer_split(1, 2).parallelize(1, ed.ParallelType.DIDx)
    ...     return fd
    >>> plan = ed.optimize(fusion(4), mesh, like=ed.optimize(fusion(64), mesh))  # replayed at 4 rows
    >>> plan.views["w"].view_shape
    (2, 2, 4)
    """
    held = {n: v.view for n, v in views.items() if n in like.inputs or n in like.outputs}
    if held != {n: v.view for n, v in like.views.items()}:
        theirs, ours = sorted(like.views), sorted(held)
        raise PlanError(f"optimize(like=plan): the like plan holds {theirs or 'no tensor'} through a view (a pin no "
                        f"layout names), this fusion {ours or 'none'}; pin the same tensors the same way in both, or "
                        f"optimize without like=")
    by_name = {n: v.view for n, v in like.views.items()}
    return dataclasses.replace(like, inputs={by_name.get(k, k): vs for k, vs in like.inputs.items()},
                               outputs={by_name.get(k, k): v for k, v in like.outputs.items()}, views={})


def _as_pinned(message: str, views: dict[str, PinView]) -> str:
    """`message` with each view's tensor named as the user pinned it.

    >>> v = PinView("w", (4, 2), (2, 2, 2), (2, 1), Layout.from_code("S1"), ("a", "b", "c"), "[2, DIDx{2}, 4/2/2, 2]", "w.view")
    >>> _as_pinned("w.view: no layout in ['[S(1)]'] is reachable", {"w": v})
    "w (pinned [2, DIDx{2}, 4/2/2, 2], held as its view w.view [2, 2, 2]): no layout in ['[S(1)]'] is reachable"
    """
    for name, v in views.items():
        message = re.sub(rf"(?<![\w.]){re.escape(v.view)}(?![\w.])",
                         f"{name} (pinned {v.loop}, held as its view {v.view} {list(v.view_shape)})", message)
    return message


def _optimize(fd, mesh: DeviceMesh, cost_model, extractor: str, like, time_limit: float, names, views) -> Plan:
    """optimize's work on view_pins' fusion `fd` (arguments checked)."""
    t0 = time.perf_counter()
    cm = cost_model or CostModel.h200()
    pins = None if like is None else {name: like.values[v].layout for name, v in like.outputs.items()}
    offered = RewriteSet(names, tuple(map(tuple, like.buckets)) if like is not None else ())
    passes: list[dict] = []  # each pass's extraction, in order (plan.stats["passes"])
    cuts: set = set()  # the exact extractor's cuts, which the first pass hands the later ones (exact's `cuts`)

    # the exact extractor's passes, by id(plan): the pairs greedy's plan of their graph would offer the bucket pass
    # (asked of the kept pass only: a greedy extraction each)
    greedy_pairs = {} if extractor == "exact" and "bucket_pair" in names and like is None else None

    def once(cm, pins, rewrites, limit=time_limit, upper=None, screen=False, prove=True):
        # the collector paused for the whole pass, as its stages pause it: between them (the template, the plan)
        # the first allocations met full collections over the pass's graph (a 2x2 Llama step's ~200k nodes:
        # 0.5 s of its 4 s); on return the graph is freed by reference counts, and the deferred collection
        # scans what the pass keeps
        with gc_paused():
            plan, problem = _optimize_once(fd, mesh, cm, pins, like, rewrites, extractor, limit, cuts, upper, screen,
                                           prove, None if rewrites.buckets else greedy_pairs)
        passes.append(_pass_summary(plan.stats))
        st = plan.stats
        log.info("optimize pass %d: problem %.2f s, e-graph %.2f s (%d classes, %d nodes), pricing %.2f s, "
                 "extraction %.2f s (%s), %.4g ms predicted", len(passes), st["build_s"], st["egraph_s"],
                 st["classes"], st["nodes"], st["price_s"], st["extract_s"], st["extract_method"],
                 plan.predicted_time * 1e3)
        return plan, problem
    screens = None  # greedy: each loop's cost on the first pass's graph (loop_screen), in loop_pins' order
    held_back: list[dict] = []  # greedy: the loops whose screens lost (their passes run only if no other fits)
    ran = 0  # loop passes run
    try:
        # a training step's first pass: greedy screens its loops on its graph (the exact extractor runs them all:
        # their LP bounds skip the MIPs that lose); the exact extractor leaves it unproven where its plan is no loop
        # (only the loops' pins are read from it) and proves it where it is one (it may be the plan)
        quick = extractor == "exact" and like is None and bool(loop_ties(as_fusion(fd)))
        plan, problem = once(cm, pins, offered, screen=extractor == "greedy" and like is None, prove=not quick)
        loops = [] if like is not None else loop_pins(plan, problem, replicated=True)
        screens = plan.stats.get("loop_screens")
        if screens is not None:
            kept = screened(loops, screens)
            held_back, loops = [lp for lp in loops if lp not in kept], kept
    except MemoryBoundError:  # a training step may fit as a loop: the loops of the plan with no bound
        if like is not None or not loop_ties(as_fusion(fd)):
            raise
        free, problem = once(dataclasses.replace(cm, memory_limit=None), pins, offered)
        # no screens here (the first pass did not fit): greedy keeps to the two loops read from the plan
        loops = loop_pins(free, problem, always=True, replicated=extractor == "exact")
        plan = None
    if loops:  # a training step whose next.<x> is not laid out as x: the cheaper of the loops it could be
        tried, unfit = [], None
        for extra in loops + held_back:
            if tried and extra in held_back:
                break
            # the cheapest loop so far bounds the next: the exact extractor skips the MIP of a loop whose LP bound is
            # above it (its plan returned unproven; it is not taken)
            upper = min((t[0].predicted_time for t in tried), default=None)
            ran += 1
            try:
                tried.append((*once(cm, {**(pins or {}), **extra}, offered, upper=upper), extra))
            except MemoryBoundError as e:
                unfit = e
        if not tried and plan is None:
            raise unfit
        if tried:
            plan, problem, extra = min(tried, key=lambda t: t[0].predicted_time)
            pins = {**(pins or {}), **extra}
    plan.buckets = [list(p) for p in offered.buckets]  # a replay (like=) keeps the plan's pairs
    pairs = bucket_candidates(plan, problem) if "bucket_pair" in names and like is None else []
    if greedy_pairs:  # and greedy's: exact's plan of the pass may offer no pair where greedy's bucketed one is cheaper
        pairs = _joined_pairs(pairs, greedy_pairs.pop(id(plan), list)())
        greedy_pairs.clear()  # the other passes' graphs
    if pairs:  # a second e-graph, offered to send these pairs in one buffer: kept where it is cheaper
        try:
            bucketed, _ = once(cm, pins, offered.with_buckets(pairs), time_limit * BUCKET_PASS_SHARE)
        except PlanError as e:  # an offer, not a need: the plan in hand stands (a tight memory bound, a short limit)
            plan.stats["bucket_pass_refused"] = f"{type(e).__name__}: {e}"
        else:
            if bucketed.predicted_time < plan.predicted_time:
                plan = bucketed
                plan.buckets = [list(p) for p in pairs]
    for tv in as_fusion(fd).all_tensors():  # pins as the user wrote them (Plan.loop_domain reports them so)
        if tv.mesh is not None and tv.name in problem.pins:
            plan.pinned_loops[tv.name] = [tv.loop_str(), problem.pins[tv.name].code()]
            if tv.chunks == "dtensor" and (tv.name in plan.inputs or tv.name in plan.outputs):
                plan.dtensor_chunks.append(tv.name)
    report_views(plan, views)
    plan.stats.update(total_s=time.perf_counter() - t0, bucket_pairs_offered=len(pairs), loops_tried=ran,
                      passes=passes, **({} if screens is None else {"loop_screens": screens}))
    return plan


def _pass_summary(stats: dict) -> dict:
    """One pass as plan.stats["passes"] lists it: its stages' seconds (problem, e-graph, pricing, extraction wall
    and CPU), method (exact: proven or not), cost, and for the exact extractor how its proof came ("dp"; the 0/1
    program's "lp" or "mip").

    >>> _pass_summary({"build_s": 0.1, "egraph_s": 0.2, "price_s": 0.05, "extract_s": 0.5, "extract_cpu_s": 0.4,
    ...                "extract_method": "exact", "extract_cost": 1e-3, "exact_method": "ilp", "exact_proof": "lp"})
    {'build_s': 0.1, 'egraph_s': 0.2, 'price_s': 0.05, 'extract_s': 0.5, 'extract_cpu_s': 0.4, 'method': 'exact', 'cost': 0.001, 'proof': 'lp'}
    """
    proof = stats.get("exact_proof") if stats.get("exact_method") == "ilp" else stats.get("exact_method")
    return {**{k: stats[k] for k in ("build_s", "egraph_s", "price_s") if k in stats},
            "extract_s": stats["extract_s"], "extract_cpu_s": stats["extract_cpu_s"], "method": stats["extract_method"],
            "cost": stats["extract_cost"], "proof": proof}


def report_views(plan: Plan, views: dict[str, PinView]) -> None:
    """Give a plan of view_pins' fusion the user's names back: an input or output '<t>.view' is bound and
    delivered as t (plan.views says how to reshape), and t's pin is the view's value, reported in the loop
    domain the user pinned.

    >>> import egraph_did as ed
    >>> mesh = ed.DeviceMesh.arange(2)
    >>> with ed.FusionDefinition() as fd:
    ...     w = fd.define_tensor((8, 4), name="w")
    ...     fd.add_output(fd.ops.relu(w), name="y")
    >>> _ = w.set_device_mesh(mesh).outer_split(0, 2).outer_split(1, 2).parallelize(1, ed.ParallelType.DIDx)
    >>> plan = ed.optimize(fd, mesh)  # report_views ran: the input is w again, bound through its view
    >>> list(plan.inputs), plan.inputs["w"], plan.loop_domain("w"), str(plan.views["w"].layout)
    (['w'], ['w.view:S1'], '[2, DIDx{2}, 8/2/2, 4]', '[S(1)]')
    """
    if not views:
        return
    by_view = {v.view: name for name, v in views.items()}
    for vname, name in by_view.items():
        plan.pinned_loops.pop(vname, None)
        if vname in plan.pins:  # held (an input no step reads is not)
            plan.pins[name] = plan.pins.pop(vname)
            plan.pinned_loops[name] = [views[name].loop, plan.values[plan.pins[name]].layout.code()]
    plan.inputs = {by_view.get(k, k): vs for k, vs in plan.inputs.items()}
    plan.outputs = {by_view.get(k, k): v for k, v in plan.outputs.items()}
    plan.views = {name: v for name, v in views.items() if name in plan.inputs or name in plan.outputs}


def loop_ties(fusion) -> dict[str, str]:
    """{input x: output 'next.x'}: a training step's outputs that are its next step's inputs
    (ed.training_step's names), which a plan must deliver as it takes them.

    >>> from egraph_did.models import mlp_training_step
    >>> sorted(loop_ties(mlp_training_step(8, 16).fusion).items())[:2]
    [('exp_avg.w1', 'next.exp_avg.w1'), ('exp_avg.w2', 'next.exp_avg.w2')]
    """
    inputs = {t.name for t in fusion.inputs}
    return {o[len(NEXT):]: o for o in fusion.outputs if o.startswith(NEXT) and o[len(NEXT):] in inputs}


def loop_pins(plan: Plan, problem: Problem, always: bool = False, replicated: bool = False
              ) -> list[dict[str, Layout]]:
    """Where plan takes some x in one layout and delivers next.x in another (not a loop: the next step would
    reshard x first, and nothing pays for it), two sets of pins that make it one: every tied pair in the
    layout the plan takes x in, or every pair that differs in the layout it delivers next.x in (a pin the
    user gave on either side wins). [] where the plan is a loop already, unless `always`: then the pins
    that keep every pair where the plan holds it. `replicated`: a third set, every tied pair replicated
    (the data-parallel loop), which the two above can miss: they follow one plan pair by pair, and where
    that plan takes a weight both replicated and sharded, they pair the weight with moments in another layout.
    Measured with the exact extractor: on a GPT layer's training step (1 x 256 x 256, 4 heads, 4 ranks) the
    cheapest loop plan of the whole graph (proven by bench/exact_hard_cases.py's tied 0/1 program) is this one,
    0.526 ms, where the two sets gave 0.561; on mlp_training_step(64, 32) over 2 ranks 100.2 us against 110.2.
    On one GPT-3 layer it loses (the sharded loop wins). optimize tries them all with the exact extractor (their LP
    bounds skip the MIPs that lose) and, with greedy, those whose loop_screen is near the best.

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp_training_step
    >>> fd = mlp_training_step(8, 16)
    >>> mesh = ed.DeviceMesh.arange(2)
    >>> loop_pins(ed.optimize(fd, mesh), build_problem(fd, mesh))  # optimize already made it a loop
    []
    """
    ties = loop_ties(problem.fusion)
    whole = Layout.replicated(problem.mesh.ndim)

    def taken(x):
        return plan.values[plan.inputs[x][0]].layout if x in plan.inputs else whole

    loose = {x for x, o in ties.items() if o in plan.outputs and taken(x) != plan.layout_of(o)}
    if not loose and not always:
        return []
    out = []
    # replicated second: the cheapest loop so far bounds the next pass (exact's upper), and on the small steps
    # above it was the cheapest, so the delivered pass's MIP (20-60 s there) was skipped by its LP bound
    for way in ("taken",) + (("replicated",) if replicated else ()) + ("delivered",):
        if way == "replicated":
            extra = replicated_pins(problem)
        else:
            extra = {}
            for x, o in ties.items():
                lay = problem.pins.get(x) or problem.pins.get(o) or (
                    plan.layout_of(o) if way == "delivered" and x in loose else taken(x))
                extra[x] = extra[o] = lay
        if extra not in out:
            out.append(extra)
    return out


def replicated_pins(problem: Problem) -> dict[str, Layout]:
    """The data-parallel loop's pins: every tied pair (x, next.x) replicated, where the user pinned neither side
    (a pin the user gave on either side wins, for both).

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp_training_step
    >>> pins = replicated_pins(build_problem(mlp_training_step(8, 16), ed.DeviceMesh.arange(2)))
    >>> str(pins["w1"]), str(pins["next.w1"]), len(pins)
    ('[R]', '[R]', 14)
    """
    out = {}
    for x, o in loop_ties(problem.fusion).items():
        out[x] = out[o] = problem.pins.get(x) or problem.pins.get(o) or Layout.replicated(problem.mesh.ndim)
    return out


# greedy runs the pass of each loop whose screen is within this of the best screen: on 8 GPT-3 layers the screens
# were 0.8-1.0% above the passes (greedy on the bigger graph), in the passes' order; on one layer and the small
# steps of bench/plan_quality.py --training equal to them
SCREEN_SLACK = 0.03


def loop_screen(graph: PhysGraph, roots: list[str], problem: Problem, pins: dict[str, Layout],
                memory_limit: float | None) -> float | None:
    """The cost of greedy's plan of `graph` (a training step's first pass, no tie pinned) cut down to one loop
    (loop_pins' `pins`): each tied input loaded only in its pin, each tied output delivered only in its pin. One
    greedy extraction on a graph at hand, where the loop's pass builds its problem and e-graph again: optimize
    (greedy) runs only the passes of the loops whose screen is near the best (screened). None where no plan fits.

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp_training_step
    >>> plan = ed.optimize(mlp_training_step(64, 32), ed.DeviceMesh.arange(2))
    >>> [round(c * 1e6, 2) for c in plan.stats["loop_screens"]], round(plan.predicted_time * 1e6, 2)
    ([110.25, 100.24, 110.24], 100.24)
    """
    codes = {name: lay.code() for name, lay in pins.items()}
    classes = dict(graph.classes)
    for c, nodes in graph.classes.items():
        lay = graph.ident.get(c, (None, None, None))[1]
        kept = [n for n in nodes if not (n.op == "Load" and codes.get(n.key, lay) != lay)]
        if len(kept) != len(nodes):
            classes[c] = kept
    for o in loop_ties(problem.fusion).values():
        if f"__out__:{o}" in classes and o in codes:
            classes[f"__out__:{o}"] = [n for n in classes[f"__out__:{o}"] if graph.ident[n.children[0]][1] == codes[o]]
    try:
        return greedy_dag(dataclasses.replace(graph, classes=classes), roots, memory_limit).cost
    except PlanError:  # MemoryBoundError is one: nothing of this loop fits
        return None


def screened(loops: list[dict], screens: list[float | None]) -> list[dict]:
    """The loops worth a pass: those whose screen is within SCREEN_SLACK of the best one's, and any not screened
    (None: no plan fitted its screen, so only its pass can tell).

    >>> screened(["taken", "replicated", "delivered"], [13.96e-3, 23.0e-3, 7.16e-3])
    ['delivered']
    """
    assert len(loops) == len(screens), (len(loops), len(screens))
    best = min((c for c in screens if c is not None), default=None)
    return [lp for lp, c in zip(loops, screens) if c is None or best is None or c <= best * (1 + SCREEN_SLACK)]


# The bucketed pass's share of time_limit (exact extractor): it only offers to merge collectives of a plan
# already found, and on bucketed graphs the exact DP tends to give up at once, leaving the 0/1 program to
# prove it or run to its limit. Fuzz seed 34 case 9729 (a 2x2x2 mesh, a memory bound): the first pass
# proven in 1.9 s, the bucketed one unproven at 60 s (LP bound 43%) with the same plan; plan.stats["passes"]
# says which pass proved what.
BUCKET_PASS_SHARE = 0.25


def _optimize_once(fd, mesh, cm, pins, like, rewrites, extractor, time_limit, cuts: set | None = None,
                   upper: float | None = None, screen: bool = False, prove: bool = True,
                   greedy_pairs: dict | None = None) -> tuple[Plan, Problem]:
    """Problem, e-graph, extraction and plan, under the given rewrites (optimize's one pass); `cuts`: the
    exact extractor's cut hints, shared by the passes of one optimize call; `upper`: the cost of a plan the
    caller holds already (exact's `upper`); `screen`: where the plan is not a loop, also plan.stats["loop_screens"]
    (loop_screen of each of loop_pins(..., replicated=True), on this pass's graph while it is at hand);
    `greedy_pairs` (exact extractor): where given, greedy_pairs[id(plan)] is a function of no arguments that returns
    bucket_candidates of greedy's plan of this pass's graph (_greedy_bucket_pairs)."""
    t0 = time.perf_counter()
    problem = build_problem(fd, mesh, cm, pins=pins, like=like, rewrites=rewrites)
    t1 = time.perf_counter()
    graph = saturate(problem)
    if rewrites.buckets:
        drop_cycles(graph, [k for k, r in problem.rewritten.items() if r == "bucket_pair"], _bucket_priority(problem))
    t2, c2 = time.perf_counter(), time.process_time()
    m = mesh.ndim
    outputs = {}
    inputs = {tv.name for tv in problem.fusion.inputs}
    must = list(problem.fusion.outputs) + [t for t in problem.pins if t not in problem.fusion.outputs
                                            and t not in inputs]
    for name in must:  # outputs, and pinned intermediates the plan must materialize in their pin
        e = canonical(graph, problem, name)
        classes = [graph.index[(e, lay.code(), m)] for lay in problem.deliverable(name) if (e, lay.code(), m) in graph.index]
        if not classes:  # a partial pinned on a value computed whole: one rank keeps it, the others zeros
            classes = [c for lay in problem.deliverable(name) if (c := partial_from_whole(graph, e, lay, m))]
        if not classes:
            replay = (f"; at these shapes the like plan's {'; '.join(problem.unreplayed)}: replay it at shapes "
                      f"its splits leave no rank empty, or optimize without like=") if problem.unreplayed else ""
            raise PlanError(f"{name}: no layout in {[str(x) for x in problem.deliverable(name)]} is reachable "
                            f"from the pinned inputs; the pin on {name} cannot be honoured{replay}")
        outputs[name] = classes
    tp = time.perf_counter()
    price(graph, problem)
    price_s = time.perf_counter() - tp
    roots = with_roots(graph, outputs)
    # exact starts from it too: on one GPT-3 layer's training step it is the loop passes' optimum where
    # greedy's plan of the whole graph is 2% over
    kept = keeping_everything(graph, problem, roots, cm.memory_bound)
    unproven = None  # the exact extractor's plan of a pass left unproven (prove=False), built once
    if extractor == "greedy":
        try:
            sel = greedy_dag(graph, roots, cm.memory_bound)
        except MemoryBoundError:  # not even the plan of least memory greedy_dag ends with: kept stands if it fits
            if kept is None:
                raise
            sel = kept
        if kept is not None and kept.cost < sel.cost:
            sel = kept
    elif extractor == "exact":
        # start= and cuts= only where there is a start (a training step): bench/exact_hard_cases.py swaps exact
        # for a hook without them. The cut hints: on one GPT-3 layer's training step the loop passes' cut loops
        # took 4 LP rounds from the first pass's cuts, not 9 (CPU per loop pass 1.2-1.6 -> 0.7-1.0 s)
        kw = {} if kept is None else {"start": kept, "cuts": cuts}
        sel = exact(graph, roots, cm.memory_bound, time_limit=time_limit, upper=upper, prove=prove, **kw)
        if sel.stats.get("exact_proof") == "none":
            unproven = build_plan(problem, graph, sel)  # the plan, unless it is a loop
            if not loop_pins(unproven, problem):
                # the unproven plan is a loop, so it may be optimize's plan: proven after all (from the first try's cuts)
                sel, unproven = exact(graph, roots, cm.memory_bound, time_limit=time_limit, upper=upper, **kw), None
                sel.stats["exact_proved_loop"] = True
    else:
        raise PlanError(f"unknown extractor {extractor!r}; use 'greedy' or 'exact'")
    t3, c3 = time.perf_counter(), time.process_time()
    plan = unproven if unproven is not None else build_plan(problem, graph, sel)
    plan.stats.update(graph.stats)
    plan.stats.update(sel.stats, extract_method=sel.method, extract_cost=sel.cost)  # exact: proven or not
    if greedy_pairs is not None and extractor == "exact":
        greedy_pairs[id(plan)] = functools.partial(_greedy_bucket_pairs, graph, roots, problem)
    loops = loop_pins(plan, problem, replicated=True) if screen else []
    if loops:
        t4 = time.perf_counter()
        plan.stats.update(loop_screens=[loop_screen(graph, roots, problem, extra, cm.memory_bound) for extra in loops],
                          loop_screens_s=time.perf_counter() - t4)
    # extract_cpu_s: this process's CPU seconds, which a busy machine does not inflate as it does extract_s
    plan.stats.update(build_s=t1 - t0, egraph_s=t2 - t1, price_s=price_s, extract_s=t3 - t2, extract_cpu_s=c3 - c2,
                      total_s=time.perf_counter() - t0,
                      classes=len(graph.classes), nodes=graph.n_nodes,
                      rewrite_terms=len(problem.rewritten))  # ops the program rewrites added (used or not)
    return plan, problem


def keeping_everything(graph: PhysGraph, problem: Problem, roots: list[str], memory_limit: float | None
                       ) -> Selection | None:
    """Greedy's plan of a training step with saved markers (ed.grad's recompute=True) where the backward reads
    every forward value as the forward made it (saved(t) from t, in t's layout: no recomputation, no
    collective on a saved value), if it fits memory_limit; None where the fusion has no marker or it does
    not fit. Keeping costs no time, so this is the plan without markers (the same classes, each saved
    value a free alias of t's); optimize keeps the cheaper of it and greedy's plan of the whole graph,
    where a bottom-up choice per class does not see that the forward already holds t where the backward
    reads saved(t), and may re-gather or recompute it (a GPT layer, tensor+sequence parallel: two
    all-gathers more), or may find a cheaper plan (the exact extractor searches the whole graph: its
    optimum is never worse).

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> fd = mlp(tokens=64, hidden=32)
    >>> fd.add_output(fd.ops.sum(fd["y"]), name="loss")
    >>> plain, marked = (ed.optimize(ed.grad(fd, "loss", ["w1"], recompute=r), ed.DeviceMesh.arange(2))
    ...                  for r in (False, True))
    >>> [s.op for s in marked.compute_steps if s.op == "saved"], marked.predicted_time <= plain.predicted_time
    (['saved'], True)
    """
    if step_memory(problem) is None:
        return None
    saved = {canonical(graph, problem, k) for k, e in problem.exprs.items() if e.op.name == SAVE_OP}
    classes = dict(graph.classes)
    for cls, nodes in graph.classes.items():
        if graph.ident.get(cls, ("",))[0] in saved:
            classes[cls] = [n for n in nodes if n.op == "Keep" or
                            (n.op == "Apply" and problem.exprs[n.key].op.name == SAVE_OP)]
    try:
        sel = greedy_dag(dataclasses.replace(graph, classes=classes), roots)
    except PlanError:  # keeping t can be impossible (a pin on saved(t) t's layouts never reach): the whole graph decides
        return None
    return sel if memory_limit is None or sel.memory <= memory_limit else None


def _bucket_priority(problem: Problem):
    """The order drop_cycles tries bucket_pair's nodes in: packing from partial or split layouts first, then
    unpacking from whole ones (the buffer's collective sits between: what a bucket is for), then the rest."""
    def priority(graph: PhysGraph, node: Node) -> int:
        e = problem.exprs[node.key]
        lays = [Layout.from_code(graph.ident[c][1]) for c in node.children]
        packs = e.op.name == "cat" or (e.op.name == "reshape" and e.args[0][1].name not in problem.rewritten)
        if packs and any(p.kind != "R" for lay in lays for p in lay):
            return 0
        if not packs and not any(lay.has_partial for lay in lays):
            return 1
        return 2
    return priority


def partial_from_whole(graph: PhysGraph, tensor: str, layout: Layout, level: int) -> str | None:
    """The class of `tensor` in `layout` at `level`, made from the class of its layout with every partial
    placement replicated by a to_partial per such mesh axis (DTensor's Replicate -> Partial: a replicated
    bias added to a pending sum, kept pending). The e-graph does not offer to_partial between layouts (a
    value would be split into summands and summed again); optimize asks it only where a pin's partial
    layout is otherwise out of reach. None if the whole layout is out of reach too.

    >>> g = PhysGraph({"c0": [Node("Load", (), "z")]}, ident={"c0": ("z", "R", 1)}, index={("z", "R", 1): "c0"})
    >>> c = partial_from_whole(g, "z", Layout.from_code("P"), 1)
    >>> g.ident[c], g.classes[c]
    (('z', 'P', 1), [Node(op='Coll', children=('c0',), key='to_partial', sid=0, cost=0.0, memory=0.0)])
    >>> partial_from_whole(g, "w", Layout.from_code("P"), 1) is None
    True
    """
    axes = [a for a, p in enumerate(layout) if p.is_partial]
    cur = Layout(tuple(R if p.is_partial else p for p in layout))
    src = graph.index.get((tensor, cur.code(), level))
    if not axes or src is None:
        return None
    for a in axes:
        cur = Layout(tuple(layout[i] if i == a else p for i, p in enumerate(cur)))
        key = (tensor, cur.code(), level)
        if key not in graph.index:
            cid = f"to_partial:{tensor}:{cur.code()}:{level}"
            graph.classes[cid] = [Node("Coll", (src,), "to_partial", a)]
            graph.ident[cid], graph.index[key] = key, cid
        src = graph.index[key]
    return src


def drop_cycles(graph: PhysGraph, keys: list[str], priority=lambda graph, node: 0) -> None:
    """Keep the physical graph acyclic where a rewrite made a class equal to a term that reads it (bucket_pair:
    a = unflat(flat(a) ++ flat(b))): the nodes of the exprs `keys` are added back one at a time, producers
    first (by `priority`(graph, node), then the order of `keys`), each only where no class it reads is computed
    from its own class; then classes left with no node, and the nodes that read them, go.

    >>> g = PhysGraph({"a": [Node("Load", (), "a")], "b": [Node("Apply", ("a",), "pack")],
    ...                "a2": [Node("Apply", ("b",), "unpack"), Node("Apply", ("a",), "copy")]},
    ...               ident={"a": ("a", "P", 0), "b": ("b", "P", 0), "a2": ("a", "P", 1)})
    >>> g.classes["a"].append(Node("Apply", ("a2",), "unpack"))  # a from itself, through the buffer
    >>> drop_cycles(g, ["pack", "unpack"])
    >>> [n.key for n in g.classes["a"]], [n.key for n in g.classes["a2"]]
    (['a'], ['copy', 'unpack'])
    """
    order = {k: i for i, k in enumerate(keys)}
    held = {c: [n for n in ns if n.op == "Apply" and n.key in order] for c, ns in graph.classes.items()}
    for c, ns in held.items():
        graph.classes[c] = [n for n in graph.classes[c] if n not in ns]
    acyclic = _TopoOrder(graph)
    candidates = [(c, n) for c, ns in held.items() for n in ns]
    for c, n in sorted(candidates, key=lambda cn: (priority(graph, cn[1]), order[cn[1].key])):
        if all(acyclic.add_edge(c, ch) for ch in set(n.children)):
            graph.classes[c].append(n)
            acyclic.link(c, n)
    while True:
        empty = {c for c, ns in graph.classes.items() if not ns}
        if not empty:
            return
        for c in empty:
            del graph.classes[c]
            graph.index.pop(graph.ident.pop(c, None), None)
        for c, ns in graph.classes.items():
            graph.classes[c] = [n for n in ns if not empty.intersection(n.children)]


class _TopoOrder:
    """A topological order of a physical graph's classes (every class after the classes its nodes read), kept
    as nodes are added (Pearce and Kelly's dynamic order): a new edge is checked for a cycle by searching only
    between its two ends' places in the order, not the whole graph below it (drop_cycles on a 32-layer
    training step's bucketed graph made one whole-graph search per candidate node)."""

    def __init__(self, graph: PhysGraph):
        self.classes = graph.classes
        self.readers: dict[str, set] = defaultdict(set)
        for c, ns in self.classes.items():
            for n in ns:
                for ch in n.children:
                    self.readers[ch].add(c)
        self.ord = {c: i for i, c in enumerate(_topo_order(graph, list(graph.classes)))}

    def _children(self, c: str):
        return {ch for n in self.classes.get(c, ()) for ch in n.children}

    def add_edge(self, c: str, ch: str) -> bool:
        """Whether c may read ch (no cycle: ch is not computed from c); if so, the order puts ch before c."""
        if c == ch:
            return False
        o = self.ord
        lo, hi = o[c], o[ch]
        if hi < lo:
            return True
        # the readers of c placed before ch: ch among them is a cycle
        forward, stack = set(), [c]
        while stack:
            x = stack.pop()
            if x == ch:
                return False
            if x not in forward:
                forward.add(x)
                stack.extend(r for r in self.readers.get(x, ()) if o[r] <= hi)
        # what ch reads placed after c moves before the forward set, each part keeping its own order
        backward, stack = set(), [ch]
        while stack:
            x = stack.pop()
            if x not in backward:
                backward.add(x)
                stack.extend(k for k in self._children(x) if o[k] > lo)
        moved = sorted(backward, key=o.get) + sorted(forward, key=o.get)
        for x, slot in zip(moved, sorted(o[x] for x in moved)):
            o[x] = slot
        return True

    def link(self, c: str, node: Node) -> None:
        """Record node (now in class c) as reading its children."""
        for ch in node.children:
            self.readers[ch].add(c)


MAX_BUCKET_PAIRS = 32  # the pairs a second e-graph is offered, those that save most first (drop_cycles grows with them)


def bucket_candidates(plan: Plan, problem: Problem) -> list[tuple[str, str]]:
    """Pairs of tensors a plan moves by collectives of one kind on one mesh axis, one after the other in
    its order, that could travel in one buffer: tensors of the program or of its decompositions (named
    alike by every problem of the fusion; a rewrite's are not), of one dtype, neither computed from the
    other (bucket_pair's precondition: the pair's buffer reads both).

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp_with_backward
    >>> from egraph_did.layout import Layout, S
    >>> from egraph_did.pins import apply_layout
    >>> mesh = ed.DeviceMesh.arange(4)
    >>> fd = mlp_with_backward(tokens=8192, hidden=256)
    >>> for n in ("x", "dy", "y", "dx"): _ = apply_layout(fd[n], Layout((S(0),)), mesh)
    >>> for n in ("dw1", "dw2"): _ = fd[n].set_device_mesh(mesh)
    >>> plan = ed.optimize(fd, mesh, rewrites=())
    >>> bucket_candidates(plan, build_problem(fd, mesh))  # data parallel: two weight gradients
    [('dw2', 'dw1')]
    """
    fusion = problem.fusion

    @functools.lru_cache(maxsize=None)
    def ancestors(t: str) -> frozenset:
        e = fusion.producer(fusion.tensors[t])
        ins = [v.name for v in e.inputs] if e is not None else []
        return frozenset(ins).union(*(ancestors(i) for i in ins))

    cm, mesh = problem.cost_model, problem.mesh
    last: dict[tuple, Collective] = {}
    pairs = []
    for c in plan.collectives:
        t = c.tensor
        if t not in fusion.tensors or t in problem.rewritten:
            continue  # a rewrite's tensor: named anew by each problem
        group = (c.kind, c.mesh_axis, plan.values[c.src].dtype, c.reduce)
        prev = last.get(group)
        last[group] = c
        if prev is None or prev.tensor == t or prev.tensor in ancestors(t) or t in ancestors(prev.tensor):
            continue
        # worth a second e-graph only where one collective of both plus the copies in and out (a kernel
        # each, reading and writing what they copy) costs less than the two
        copy = lambda nbytes: cm.compute_time(0.0, 2 * nbytes, problem.tensor(t).dtype)  # noqa: E731
        joint = cm.collective_time(c.kind, prev.bytes + c.bytes, mesh.shape[c.mesh_axis], c.mesh_axis, mesh.ndim)
        saving = prev.time + c.time - joint - copy(prev.bytes + c.bytes) - copy(prev.bytes) - copy(c.bytes)
        if saving > 0:
            pairs.append((saving, prev.tensor, t))
    best = set(sorted(pairs, key=lambda p: -p[0])[:MAX_BUCKET_PAIRS])
    return list(dict.fromkeys((a, b) for saving, a, b in pairs if (saving, a, b) in best))  # in plan order


def _greedy_bucket_pairs(graph: PhysGraph, roots: list[str], problem: Problem) -> list[tuple[str, str]]:
    """bucket_candidates of greedy's plan of `graph` ([] where greedy finds no plan within the memory bound): the
    pairs greedy's bucket pass would offer, which optimize offers the exact extractor's too, so that its bucketed
    graph holds greedy's. Fuzz seed 48 case 7199 (1x2x2, a memory bound): exact's proven first plan reduced t0 and
    t2 on two mesh axes (no pair), greedy's on one, whose bucket made greedy's plan 68 us to exact's 76."""
    try:  # least=False: an offer, not worth greedy's least-memory search inside exact's optimize (fuzz 49/7837)
        sel = greedy_dag(graph, roots, problem.cost_model.memory_bound, least=False)
    except PlanError:
        return []
    return bucket_candidates(build_plan(problem, graph, sel), problem)


def _joined_pairs(ours: list[tuple[str, str]], theirs) -> list[tuple[str, str]]:
    """`ours` then the pairs of `theirs` it lacks, at most MAX_BUCKET_PAIRS (drop_cycles grows with them).

    >>> _joined_pairs([("a", "b")], [("a", "b"), ("c", "d")])
    [('a', 'b'), ('c', 'd')]
    """
    return list(dict.fromkeys([*ours, *theirs]))[:MAX_BUCKET_PAIRS]


def _check_time_limit(time_limit, extractor: str) -> float:
    """The exact extractor's time limit in seconds: 60 if None; a positive finite number otherwise.

    >>> _check_time_limit(None, "exact"), _check_time_limit(5, "exact")
    (60.0, 5.0)
    >>> _check_time_limit(5, "greedy")
    Traceback (most recent call last):
    ...
    egraph_did.errors.PlanError: optimize: time_limit bounds the exact extractor's solver; greedy extraction has none: drop time_limit or pass extractor='exact'
    """
    if time_limit is None:
        return 60.0
    if extractor != "exact":
        raise PlanError("optimize: time_limit bounds the exact extractor's solver; greedy extraction has none: "
                        "drop time_limit or pass extractor='exact'")
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not 0 < time_limit < float("inf"):
        raise PlanError(f"optimize: time_limit must be a positive number of seconds, got {time_limit!r} "
                        f"(e.g. time_limit=10)")
    return float(time_limit)


def canonical(graph: PhysGraph, problem: Problem, tensor: str) -> str:
    """The name the e-graph read-back uses for the class of `tensor`.

    >>> graph = PhysGraph(canonical={"div_5": "y"})  # softmax's decomposition ends in div_5, equal to y
    >>> canonical(graph, None, "div_5"), canonical(graph, None, "x")
    ('y', 'x')
    """
    return graph.canonical.get(tensor, tensor)


def build_plan(problem: Problem, graph: PhysGraph, sel: Selection) -> Plan:
    """Turn the chosen nodes into ordered steps over named values.

    >>> from egraph_did.egraph import saturate
    >>> from egraph_did.models import row_sum
    >>> pins = {"x": Layout.from_code("S1"), "y": Layout.from_code("R")}
    >>> problem = build_problem(row_sum(8, 64), DeviceMesh.arange(4), pins=pins)
    >>> graph = saturate(problem); price(graph, problem)
    >>> sel = greedy_dag(graph, with_roots(graph, {"y": [graph.index[("y", "R", 1)]]}))
    >>> [s.kind for s in build_plan(problem, graph, sel).steps]  # one latency beats an allreduce's two
    ['allgather', 'compute']
    """
    mesh = problem.mesh
    choice = sel.choice
    order = [c for c in _order(graph, choice) if c in choice]
    values: dict[str, Value] = {}
    value_of: dict[str, str] = {}  # class -> value name
    steps: list = []
    inputs: dict[str, list[str]] = {}

    def value_named(t: str, lay: str) -> str:
        name = f"{t}:{lay}"
        if name not in values:
            tv = problem.tensor(t)
            values[name] = Value(name, t, tv.shape, str(tv.dtype).replace("torch.", ""), lay,
                                 tuple(d.name for d in tv.logical_domain))
        return name

    def value_for(cls: str) -> str:
        t, lay, _ = graph.ident[cls]
        return value_named(t, lay)

    # a multi-output op's values, by its tuple class: the projected ones first, named by their classes
    projected: dict[str, dict[int, str]] = {}
    for cls in order:
        if choice[cls].op == "Proj":
            projected.setdefault(choice[cls].children[0], {})[choice[cls].sid] = value_for(cls)
    produced: set[str] = set()
    for cls in order:
        n = choice[cls]
        if n.op in ("Root", "Choose"):
            continue
        if n.op == "Keep":
            value_of[cls] = value_of[n.children[0]]
            continue
        if n.op == "Proj":
            value_of[cls] = projected[n.children[0]][n.sid]
            continue
        if n.op == "Apply" and cls not in graph.ident:  # a multi-output op's tuple class: the op runs here
            e, strat = problem.exprs[n.key], problem.strategies[n.key][n.sid]
            outs = [projected.get(cls, {}).get(i) or value_named(o.name, strat.outputs[i].code())
                    for i, o in enumerate(e.outputs)]
            steps.append(_compute_step(problem, n, outs, value_of))
            produced.update(outs)
            value_of[cls] = cls
            continue
        v = value_for(cls)
        value_of[cls] = v
        if v in produced:
            continue  # the same tensor in the same layout, reached another way: reuse it
        if n.op == "Load":
            inputs.setdefault(n.key, []).append(v)
        elif n.op == "Coll":
            t = graph.ident[cls][0]
            src = value_of[n.children[0]]
            secs, nbytes = collective_cost(problem, n.key, n.sid, t, values[src].layout,
                                           values[v].layout)
            reduce = values[src].layout[n.sid].reduce  # how a pending partial combines; 'sum' otherwise
            steps.append(Collective(n.key, t, src, v, n.sid, mesh.axis_names[n.sid], nbytes, secs, reduce))
        elif n.op == "Apply":
            steps.append(_compute_step(problem, n, [v], value_of))
        produced.add(v)
    outputs = {}
    for name in problem.fusion.outputs:
        cls = f"__out__:{name}"
        outputs[name] = value_of[choice[cls].children[0]]
    pins = {}  # every pinned tensor (input, output or intermediate) -> the value holding it in its pin
    for name, lay in problem.pins.items():
        v = f"{canonical(graph, problem, name)}:{lay.code()}"
        if v in values:
            pins[name] = v
    rewrites = {s.key: problem.rewritten[s.key] for s in steps
                if isinstance(s, ComputeStep) and s.key in problem.rewritten}
    plan = Plan(mesh, problem.cost_model, values, _explain_why(steps, values, outputs, problem), inputs, outputs,
                memory=sel.memory, method=sel.method, pins=pins, rewrites=rewrites)
    plan.validate()
    return plan


def _compute_step(problem: Problem, n: Node, outs: list[str], value_of) -> ComputeStep:
    e = problem.exprs[n.key]
    s = problem.strategies[n.key][n.sid]
    operand_values = iter(value_of[c] for c in n.children)
    args, params = [], []
    for k, v in e.args:
        if hasattr(v, "logical_domain"):
            args.append((k, next(operand_values)))
            params.append(k)
        else:
            args.append((k, v))
    flags: dict[str, list[int]] = {}
    for m, fs in enumerate(s.flags):
        for f in fs:
            flags.setdefault(f, []).append(m)
    return ComputeStep(e.op.name, tuple(args), tuple(params), tuple(outs),
                       tuple((f, tuple(ms)) for f, ms in sorted(flags.items())), s.rules, s.time, n.key)


def _order(graph: PhysGraph, choice) -> list[str]:
    """Chosen classes, producers first."""
    return post_order([ROOT], lambda c: reversed(choice[c].children))


def _explain_why(steps, values, outputs, problem: Problem) -> list:
    """Fill each collective's `why` (explain.why: the first step or output that reads what it made)."""
    layouts = {v: val.layout.code() for v, val in values.items()}
    return [dataclasses.replace(s, why=w) if w is not None else s
            for s, w in zip(steps, whys(steps, layouts, outputs, problem.pins))]
