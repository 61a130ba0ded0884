"""Repeated layers planned once: a model's chain of identical layers is planned as a window of four of its
layers (the first, two middle ones, the last) with everything around them, and the plan of the middle
layers is stamped on every layer between them.

A layer is found from the fusion's inputs: inputs whose names differ only in one integer (l0.wq .. l95.wq,
exp_avg.l3.w1, model.layers.7.mlp.up_proj.weight) are layer-indexed, and each expression belongs to the
layer of the last layer-indexed input read up to it in program order (a training step's forward, backward
and optimizer update of layer i form layer i's block). The chain holds where every middle layer's block is
the same program (ops, shapes, attributes, operands at the same places relative to the layer) and blocks meet
only their neighbours; otherwise find_chain returns None and optimize plans the whole graph.

The window is a real fusion: the first two middle layers, and the last one reading the second middle layer's
outputs where it read layer L-2's (and the second middle layer reading the last one's gradients where it
read layer 3's). optimize plans it like any fusion (every pass, either extractor). The stitched plan is the
window's steps with the second middle layer's steps instantiated for layers 2 .. L-2; it is taken only where
the window's plan is periodic, i.e. the two middle layers run the same steps relative to their neighbours
(then each stamped layer reads exactly what its neighbours make), and plan.validate() holds.

The window is exact for what it holds. What stamping assumes: each middle layer's best plan given the layouts
at its boundaries is the one of the window's middle layers, i.e. the optimum is periodic along the chain;
a chain whose cheapest steady state only pays off over many layers (a costly change of layout at layer 1
that every later layer would repay) is not found by a window of four. Under a memory bound the window is
planned without it and the stamped plan taken only where it fits (optimize); not used with like= or view pins.
"""
from __future__ import annotations

import heapq
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

from .explain import whys
from .fusion import Expr, Fusion
from .ir import TensorView
from .plan import Collective, ComputeStep, Plan, Value

WINDOW = 4  # layers the window holds: the first, two middle ones, the last
MIDDLE = 2  # the window's layer whose plan is stamped on layers 2 .. L-2


@dataclass
class Chain:
    """A fusion's chain of layers: each layer's expressions (indices into fusion.exprs, program order), the
    layer of each layer-indexed input and produced tensor, and each produced tensor's place in its block.

    >>> import torch
    >>> from egraph_did.models import gpt_training_step
    >>> fusion = gpt_training_step(1, 16, 32, 2, torch.float32, layers=5).fusion
    >>> chain = find_chain(fusion)
    >>> chain.layers, len(chain.blocks[1]) == len(chain.blocks[3]), chain.param("l#.wq", 4)
    (5, True, 'l4.wq')
    """

    fusion: Fusion
    blocks: list[list[int]]
    params: dict[str, tuple[str, int]]  # layer-indexed input -> (its name template, its layer)
    layer: dict[str, int] = field(default_factory=dict)  # tensor -> its layer (made there, or its input)
    place: dict[str, tuple[int, int]] = field(default_factory=dict)  # made tensor -> (index in block, output)
    names: dict[tuple[str, int], str] = field(default_factory=dict)  # (template, layer) -> input name
    # a tensor of the first or last layer a middle layer reads -> the place of a middle layer's tensor read there
    alias: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return len(self.blocks)

    def param(self, template: str, layer: int) -> str:
        """The layer-indexed input of `layer` named by `template`."""
        return self.names[(template, layer)]

    def made(self, layer: int, place: tuple[int, int]) -> str:
        """The tensor made at `place` (index in the block, output index) of `layer`'s block."""
        return self.fusion.exprs[self.blocks[layer][place[0]]].outputs[place[1]].name

    def relative(self, t: str, layer: int):
        """Tensor t as layer `layer` sees it: ("made", offset, place), ("param", template, offset) or
        ("shared", t) for a tensor of no layer."""
        if t in self.params:
            template, k = self.params[t]
            return ("param", template, k - layer)
        if t in self.layer:
            return ("made", self.layer[t] - layer, self.place[t])
        return ("shared", t)



def _families(fusion: Fusion) -> list[dict[str, tuple[str, int]]]:
    """Candidate layer indexings of the inputs, the one naming most inputs first: for each integer in an
    input's name, the name with it replaced by '#' is a template; templates whose indices are the same
    run of at least WINDOW + 1 integers form a family."""
    by_template: dict[str, dict[int, str]] = defaultdict(dict)
    for tv in fusion.inputs:
        for m in re.finditer(r"\d+", tv.name):
            by_template[tv.name[:m.start()] + "#" + tv.name[m.end():]][int(m.group())] = tv.name
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for template, named in by_template.items():
        ks = tuple(sorted(named))
        if len(ks) > WINDOW and ks == tuple(range(ks[0], ks[0] + len(ks))):
            groups[ks].append(template)
    out = []
    for ks, templates in sorted(groups.items(), key=lambda g: -len(g[1])):
        family: dict[str, tuple[str, int]] = {}
        for template in templates:
            for k in ks:
                family.setdefault(by_template[template][k], (template, k - ks[0]))
        out.append(family)
    return out


def find_chain(fusion: Fusion) -> Chain | None:
    """The fusion's chain of identical layers (at least WINDOW + 1 of them), or None.

    >>> import torch
    >>> from egraph_did.models import gpt_layer, mlp
    >>> find_chain(gpt_layer(1, 16, 32, 2, torch.float32, layers=6).fusion).layers
    6
    >>> find_chain(gpt_layer(1, 16, 32, 2, torch.float32, layers=4).fusion) is None  # too short to save work
    True
    >>> find_chain(mlp(tokens=8, hidden=16).fusion) is None
    True
    """
    for family in _families(fusion):
        chain = _chain(fusion, family)
        if chain is not None:
            return chain
    return None


def _chain(fusion: Fusion, family: dict[str, tuple[str, int]]) -> Chain | None:
    n = 1 + max(k for _, k in family.values())
    tags = _tags(fusion, family)
    if tags is None:
        return None
    blocks: list[list[int]] = [[] for _ in range(n)]
    for i, k in enumerate(tags):
        if k is not None:
            blocks[k].append(i)
    if not all(blocks):
        return None
    chain = Chain(fusion, blocks, family, names={(t, k): name for name, (t, k) in family.items()})
    chain.layer.update({name: k for name, (_, k) in family.items()})
    for k, block in enumerate(blocks):
        for a, i in enumerate(block):
            for o, tv in enumerate(fusion.exprs[i].outputs):
                chain.layer[tv.name], chain.place[tv.name] = k, (a, o)
    # the middle layers are one program (a neighbour's tensor by its layer alone: the ends' blocks may hold
    # more); those whose neighbours are middle layers too read them at the same places
    first = _signature(chain, 1, places=False)
    if first is None or any(_signature(chain, k, places=False) != first for k in range(2, n - 1)):
        return None
    inner = _signature(chain, MIDDLE)
    if any(_signature(chain, k) != inner for k in range(MIDDLE + 1, n - 2)):
        return None
    for k in (0, n - 1):  # the ends may differ from the middle, but meet only their neighbours
        for i in blocks[k]:
            if any(t.name in chain.layer and abs(chain.layer[t.name] - k) > 1 for t in fusion.exprs[i].inputs):
                return None
    # an end's tensor a middle layer reads stands where a middle layer reads its neighbour's at that operand
    for end, m, off in ((0, 1, -1), (n - 1, n - 2, 1)):
        for a, i in enumerate(blocks[m]):
            for t, u in zip(fusion.exprs[i].inputs, fusion.exprs[blocks[MIDDLE][a]].inputs):
                if chain.layer.get(t.name) != end or t.name in family:
                    continue
                if chain.layer.get(u.name) != MIDDLE + off or u.name not in chain.place:
                    return None
                p = chain.place[u.name]
                same = _key(fusion.exprs[blocks[MIDDLE + off][p[0]]]) == _key(fusion.producer(t))
                if not same or chain.alias.setdefault(t.name, p) != p:
                    return None
    return chain


def _tags(fusion: Fusion, family: dict[str, tuple[str, int]]) -> list[int | None] | None:
    """Each expression's layer: that of the layer-indexed inputs it reads; else that of its operands where they
    are of one layer, of the last layer-indexed input read up to it in program order where they are of two; an
    expression reading no layer's tensor (a step counter, a constant) is of the one layer that reads it, or of
    none (shared). None where one expression reads two layers' inputs."""
    tags: list[int | None] = [None] * len(fusion.exprs)
    layer = {name: k for name, (_, k) in family.items()}
    free, current = [], None
    for i, e in enumerate(fusion.exprs):
        read = {family[t.name][1] for t in e.inputs if t.name in family}
        if len(read) > 1:
            return None
        operands = {layer[t.name] for t in e.inputs if t.name in layer}
        if read:
            current = k = read.pop()
        elif not operands:
            free.append(i)
            continue
        elif len(operands) == 1:  # a saved marker emitted after the loss is of its operand's layer
            k = operands.pop()
        elif current in operands:  # a residual add, the gradients of two paths summed
            k = current
        else:
            return None
        tags[i] = k
        layer.update((tv.name, k) for tv in e.outputs)
    readers: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(fusion.exprs):
        for t in e.inputs:
            readers[t.name].append(i)
    outputs = {tv.name for tv in fusion.outputs.values()}
    for i in reversed(free):
        outs = fusion.exprs[i].outputs
        read_by = {tags[r] for tv in outs for r in readers[tv.name]}
        if len(read_by) == 1 and not any(tv.name in outputs for tv in outs):
            tags[i] = read_by.pop()
    return tags


def _key(e: Expr, outputs=()) -> tuple:
    """What two layers' expressions at one place must share: op, attributes, operand and output shapes and
    pins, and which outputs the fusion outputs."""
    return (e.op.name, repr(sorted(e.attrs.items())), tuple((t.shape, str(t.dtype), _pin(t)) for t in e.inputs),
            tuple((t.shape, str(t.dtype), _pin(t), t.name in outputs) for t in e.outputs))


def _pin(tv: TensorView) -> str | None:
    return tv.loop_str() if tv.mesh is not None else None


def _signature(chain: Chain, k: int, places: bool = True) -> list | None:
    """Layer k's block as its neighbours see it (without the places of the neighbours' tensors it reads where
    not `places`); None where it reads beyond its neighbours."""
    out, outputs = [], {tv.name for tv in chain.fusion.outputs.values()}
    for i in chain.blocks[k]:
        e = chain.fusion.exprs[i]
        rels = tuple(chain.relative(t.name, k) for t in e.inputs)
        if any(r[0] != "shared" and abs(r[-1] if r[0] == "param" else r[1]) > 1 for r in rels):
            return None
        if not places:
            rels = tuple(r[:2] if r[0] == "made" and r[1] else r for r in rels)
        out.append((_key(e, outputs), rels))
    return out


# ---------------------------------------------------------------------------- the window


def window(chain: Chain) -> Fusion:
    """The fusion of the window's layers (0, 1, 2, L-1) and every expression of no layer, tensors named as
    in the chain's fusion and pinned as there; layer L-1 reads layer 2 where it read L-2, layer 2 reads
    layer L-1 where it read layer 3.

    >>> import torch
    >>> from egraph_did.models import gpt_layer
    >>> fusion = gpt_layer(1, 16, 32, 2, torch.float32, layers=7).fusion
    >>> w = window(find_chain(fusion))
    >>> len(w.exprs) * 7 == len(fusion.exprs) * 4, sorted({t.name.split(".")[0] for t in w.inputs} - {"x"})
    (True, ['l0', 'l1', 'l2', 'l6'])
    """
    fusion, n = chain.fusion, chain.layers
    kept = {0, 1, MIDDLE, n - 1}
    dst = Fusion()
    new: dict[str, TensorView] = {}

    def pin(tv: TensorView, src: TensorView) -> None:
        if src.mesh is not None:  # the user's pin, as written, on the window's copy
            tv.set_device_mesh(src.mesh)
            tv._loop = list(src.loop_domain)

    for tv in fusion.inputs:
        if chain.layer.get(tv.name, 0) in kept:
            new[tv.name] = dst.define_tensor(tv.shape, tv.dtype, tv.name, [d.name for d in tv.logical_domain])
            pin(new[tv.name], tv)
    at = {i: (k, a) for k, block in enumerate(chain.blocks) for a, i in enumerate(block)}

    def operand(i: int, s: int, t: TensorView) -> str:
        """The name of the tensor expression i reads as its s-th operand in the window."""
        k, a = at.get(i, (None, None))
        if k == n - 1 and chain.layer.get(t.name) == n - 2 and t.name in chain.place:
            return chain.made(MIDDLE, chain.place[t.name])  # layer L-2's tensor, made by layer 2 here
        if k == MIDDLE and chain.layer.get(t.name) == MIDDLE + 1 and t.name in chain.place:
            return fusion.exprs[chain.blocks[n - 2][a]].inputs[s].name  # what layer L-2 reads there
        return t.name

    for i in _window_order(chain, [i for i in range(len(fusion.exprs)) if at.get(i, (0,))[0] in kept], operand):
        e = fusion.exprs[i]
        slots = iter(range(len(e.inputs)))
        outs = dst.emit(e.op.name, **{a: new[operand(i, next(slots), v)] if isinstance(v, TensorView) else v
                                      for a, v in e.args})
        for old, tv in zip(e.outputs, outs if isinstance(outs, tuple) else (outs,)):
            dst.tensors.pop(tv.name)
            tv.name = old.name
            dst.tensors[tv.name] = tv
            new[tv.name] = tv
            pin(tv, old)
    for name, tv in fusion.outputs.items():
        if tv.name in new:
            dst.outputs[name] = new[tv.name]
    return dst


def _window_order(chain: Chain, kept: list[int], operand) -> list[int]:
    """The kept expressions in program order where the rewired operands allow it: the last layer's backward
    reads what layer L-2 made for it (a layer norm's statistics recomputed from its input), which layer 2 makes
    later in program order (in layer 3's backward)."""
    fusion = chain.fusion
    maker = {tv.name: i for i in kept for tv in fusion.exprs[i].outputs}
    after = [{maker[m] for s, t in enumerate(fusion.exprs[i].inputs) if (m := operand(i, s, t)) in maker}
             for i in kept]
    at = {i: k for k, i in enumerate(kept)}
    return [kept[k] for k in _ready_first([{at[m] for m in ms} for ms in after], kept)]


def _ready_first(after: list[set[int]], keys: list) -> list[int]:
    """An order of items 0..n-1 in which each comes after the items in after[its index]: among those ready,
    the one of the least key first. AssertionError where they hold a cycle.

    >>> _ready_first([set(), {0}, set()], [5, 1, 3])  # 1 waits for 0; 2 is ready first by its key
    [2, 0, 1]
    """
    waiting = [len(a) for a in after]
    readers: dict[int, list[int]] = defaultdict(list)
    for k, a in enumerate(after):
        for m in a:
            readers[m].append(k)
    ready = [(keys[k], k) for k in range(len(after)) if not waiting[k]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(k)
        for r in readers[k]:
            waiting[r] -= 1
            if not waiting[r]:
                heapq.heappush(ready, (keys[r], r))
    assert len(order) == len(after), "the order's items hold a cycle"
    return order


# ---------------------------------------------------------------------------- stitching


class _Window:
    """The window plan's steps, each with the window layer it belongs to (0..3, None: no layer), and each
    value as its layer sees it."""

    def __init__(self, plan: Plan, chain: Chain, small: Fusion):
        self.plan, self.chain = plan, chain
        self.known = set(small.tensors)  # the window's tensors (a tensor the optimizer added is not one)
        n = chain.layers
        self.at = {0: 0, 1: 1, MIDDLE: 2, n - 1: 3}  # chain layer -> window layer
        self.real = {0: 0, 1: 1, 2: MIDDLE, 3: n - 1}  # window layer -> chain layer
        self.steps = plan.steps
        self.maker: dict[str, int] = {v: i for i, s in enumerate(self.steps) for v in s.writes}
        self.tags = self._tags()

    def tensor_layer(self, t: str) -> int | None:
        k = None if self.added(t) else self.chain.layer.get(t)
        return None if k is None else self.at.get(k)

    def _tags(self) -> list[int | None]:
        """A step's window layer: its tensor's (a collective's; a compute step's made tensor), for a step that
        makes only tensors the optimizer added (a decomposition, a rewrite) the layer of its first reader."""
        tags: list[int | None] = [None] * len(self.steps)
        added: list[int] = []
        for i, s in enumerate(self.steps):
            tensors = [self.plan.values[v].tensor for v in s.writes]
            known = [t for t in tensors if not self.added(t)]
            if known:
                tags[i] = self.tensor_layer(known[0])
            else:
                added.append(i)
        readers: dict[str, int] = {}
        for i, s in reversed(list(enumerate(self.steps))):
            for v in s.reads:
                readers[v] = i
        for i in reversed(added):
            first = min((readers[v] for v in self.steps[i].writes if v in readers), default=None)
            tags[i] = tags[first] if first is not None else None
        # a step that reads only tensors of no layer computes the same for every layer (AdamW's bias corrections,
        # from the step counter): the e-graph made it once, in some layer's name; it is of no layer
        self.invariant: set[str] = set()
        for i, s in enumerate(self.steps):
            if all(v in self.invariant or (v not in self.maker and self.tensor_layer(self.plan.values[v].tensor) is None)
                   for v in s.reads):
                tags[i] = None
                self.invariant.update(s.writes)
        return tags

    def added(self, t: str) -> bool:
        """Whether the optimizer added tensor t (a decomposition's, a rewrite's: named afresh, maybe as a tensor
        of a layer the window left out is named)."""
        return t not in self.known

    def value_rel(self, v: str, w: int | None, memo: dict):
        """Value v as window layer w sees it (comparable between layers): one that layer makes by the step that
        makes it (equal terms share a value named after any of them, so not by its name), a neighbour's by its
        place in the neighbour's block; raises Refused where it is neither."""
        val = self.plan.values[v]
        code = v[len(val.tensor) + 1:]
        if v in self.invariant:
            return ("shared", val.tensor, code)
        i = self.maker.get(v)
        if i is not None and self.tags[i] == w:
            return ("own", self.step_rel(i, w, memo, outputs=False), self.steps[i].writes.index(v), code)
        if self.added(val.tensor):
            raise Refused(f"{v} is made in window layer {self.tags[i]} and read in {w}")
        k = self.tensor_layer(val.tensor)  # the window holds no tensor of a layer it left out
        if k is None or w is None:
            return ("shared", val.tensor, code)
        offset = k - w
        if abs(offset) > 1:
            raise Refused(f"{v} of window layer {k} is read by window layer {w}")
        if val.tensor in self.chain.params:
            return ("param", offset, self.chain.params[val.tensor][0], code)
        return ("made", offset, self.place(val.tensor, k), code)

    def place(self, t: str, k: int) -> tuple[int, int]:
        """The place of tensor t (of window layer k) in a middle layer's block."""
        p = self.chain.place[t] if k in (1, 2) else self.chain.alias.get(t)
        if p is None:
            raise Refused(f"{t} of layer {self.real[k]} is read where no middle layer reads its neighbour")
        return p

    def step_rel(self, i: int, w: int | None, memo: dict, outputs: bool = True):
        key = (i, w, outputs)
        if key not in memo:
            s = self.steps[i]
            if isinstance(s, Collective):
                body = ("coll", s.kind, self.value_rel(s.src, w, memo), s.mesh_axis, s.reduce, s.time)
            else:
                body = ("compute", s.op, tuple((a, self.value_rel(x, w, memo) if a in s.tensor_params else repr(x))
                                               for a, x in s.args), s.flags, s.rules, s.time)
            if outputs:
                body += (tuple(self.value_rel(v, w, memo) for v in s.writes),)
            memo[key] = body
        return memo[key]

    def periodic(self) -> None:
        """Raises Refused unless window layers 1 and 2 run the same steps, each relative to its layer."""
        memo: dict = {}
        one = Counter(self.step_rel(i, 1, memo) for i, t in enumerate(self.tags) if t == 1)
        two = Counter(self.step_rel(i, 2, memo) for i, t in enumerate(self.tags) if t == 2)
        if one != two:
            raise Refused(f"the middle layers' plans differ ({sum((one - two).values())} steps of layer 1 not "
                           f"in layer 2, {sum((two - one).values())} the other way)")


class Refused(Exception):
    """The window's plan cannot be stamped (the message says why): optimize plans the whole graph."""


def stitch(plan: Plan, chain: Chain, small: Fusion) -> Plan:
    """The chain's plan from its window's: layers 0, 1 and L-1 as the window runs them, the window's layer 2
    instantiated on each of layers 2 .. L-2; Refused where the window's plan is not periodic.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import gpt_layer
    >>> fd = gpt_layer(1, 16, 32, 2, torch.float32, layers=6)
    >>> mesh = ed.DeviceMesh.arange(2)
    >>> whole, chained = ed.optimize(fd, mesh, chain=False), ed.optimize(fd, mesh)  # optimize stitches
    >>> chained.stats["chain"]["layers"], len(chained.steps) == len(whole.steps)
    (6, True)
    >>> abs(chained.predicted_time - whole.predicted_time) < 1e-12
    True
    """
    win = _Window(plan, chain, small)
    win.periodic()
    n = chain.layers
    values: dict[str, Value] = {}
    invariant = {plan.values[v].tensor for v in win.invariant}

    def tensor_for(t: str, w: int | None, j: int) -> str:
        if win.added(t):  # named afresh: the window's names may be those of left-out layers' tensors
            return f"{t}@" if t in invariant else f"{t}@{j}"
        if t in invariant:
            return t
        k = win.tensor_layer(t)
        if k is None or w is None:
            return t
        target = j + (k - w)
        if target == win.real[k]:
            return t
        if t in chain.params:
            return chain.param(chain.params[t][0], target)
        return chain.made(target, win.place(t, k))

    def value_for(v: str, w: int | None, j: int) -> str:
        val = plan.values[v]
        t = tensor_for(val.tensor, w, j)
        name = f"{t}:{v[len(val.tensor) + 1:]}"
        if name not in values:
            tv = None if win.added(val.tensor) else chain.fusion.tensors[t]
            if tv is not None and tuple(tv.shape) != tuple(val.shape):
                raise Refused(f"{v} of the window stands for {t}, of another shape")
            axes = tuple(d.name for d in tv.logical_domain) if tv is not None else val.axes
            values[name] = replace(val, name=name, tensor=t, axes=axes)
        return name

    def instance(s, w, j):
        if isinstance(s, Collective):
            return replace(s, tensor=tensor_for(s.tensor, w, j), src=value_for(s.src, w, j),
                           dst=value_for(s.dst, w, j), why="")
        return replace(s, args=tuple((a, value_for(x, w, j) if a in s.tensor_params else x) for a, x in s.args),
                       outputs=tuple(value_for(v, w, j) for v in s.outputs), key=tensor_for(s.key, w, j))

    laid: list[tuple[int, int]] = []  # (window step, chain layer) of each stitched step
    for i, w in enumerate(win.tags):
        for j in (range(MIDDLE, n - 1) if w == 2 else (win.real[w] if w is not None else 0,)):
            laid.append((i, j))
    made = [instance(plan.steps[i], win.tags[i], j) for i, j in laid]
    steps = [made[k] for k in _topological(made, laid)]
    # inputs, outputs, pins: those of window layer 2 for every middle layer, the others renamed as they are
    def every(name: str) -> list[tuple[str, int | None, int]]:
        w = win.tensor_layer(name)
        js = range(MIDDLE, n - 1) if w == 2 else (win.real[w] if w is not None else 0,)
        return [(tensor_for(name, w, j), w, j) for j in js]
    inputs = {t: [value_for(v, w, j) for v in vs] for name, vs in plan.inputs.items() for t, w, j in every(name)}
    output_of = {tv.name: name for name, tv in chain.fusion.outputs.items()}
    outputs = {}
    for name, v in plan.outputs.items():
        tv = chain.fusion.outputs[name]
        for t, w, j in every(tv.name):
            outputs[output_of[t]] = value_for(v, w, j)
    pins = {t: value_for(v, w, j) for name, v in plan.pins.items() for t, w, j in every(name)}
    pinned_loops = {t: loop for name, loop in plan.pinned_loops.items() for t, _, _ in every(name)}
    rewrites = {s.key: plan.rewrites[plan.steps[i].key] for s, (i, _) in zip(made, laid)
                if isinstance(s, ComputeStep) and plan.steps[i].key in plan.rewrites}
    # the pairs offered to bucket_pair (a like= replay offers them again): one with a tensor of window layer 2 on
    # every middle layer; a pair with a tensor of the last layer that no middle layer's neighbour has (a gradient
    # of its norm weight) is offered only where it was, beside layer L-2: no step sends it (a step reading it
    # from layer 2 would have been refused above), so nothing the plan runs is lost
    def offered(pair, j):
        try:
            return tuple(tensor_for(t, 2, j) for t in pair)
        except Refused:
            return None
    buckets = sorted({tuple(p) for p in plan.buckets} | {
        b for pair in plan.buckets if any(win.tensor_layer(t) == 2 for t in pair)
        for b in (offered(pair, j) for j in range(MIDDLE, n - 1)) if b is not None})
    layouts = {v: val.layout.code() for v, val in values.items()}
    steps = [replace(s, why=y) if y is not None else s
             for s, y in zip(steps, whys(steps, layouts, outputs, list(pins)))]
    out = Plan(plan.mesh, plan.cost_model, values, steps, inputs, outputs, method=plan.method,
               stats=dict(plan.stats), pins=pins, rewrites=rewrites, buckets=[list(p) for p in buckets],
               pinned_loops=pinned_loops)
    out.validate()
    out.memory = out.memory_breakdown()["total"]
    return out


def _topological(steps: list, laid: list[tuple[int, int]]) -> list[int]:
    """An order of the stitched steps in which each reads only what earlier steps made: among the steps ready,
    the one of the earliest window step (then the lowest layer) first, so every layer keeps the window's order."""
    maker = {v: k for k, s in enumerate(steps) for v in s.writes}
    return _ready_first([{maker[v] for v in s.reads if v in maker} for s in steps], laid)


__all__ = ["Chain", "Refused", "find_chain", "window", "stitch", "WINDOW"]
