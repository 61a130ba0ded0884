"""The e-graph (egglog: sorts, the rewrites/ family rulesets, generated mesh joins and resharding) builds
exactly the physical graph a plain Python worklist over the problem's priced strategies reaches (the
specification: `reference`): same classes (tensor, layout, level) and the same nodes in each, for every
model of egraph_did.models and fusions of attention, embedding, cross entropy and softmax, on 1-D, 2-D
and 3-D meshes. The rulesets derive the strategies; the worklist reads them from the Python rules."""
import functools

import pytest
import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.collectives import connecting
from egraph_did.egraph import saturate
from egraph_did.layout import PMAX, Layout, P, R, S
from egraph_did.problem import build_problem


def signature(g):
    """Each named class's nodes, children named by their classes' (tensor, layout, level)."""
    name = lambda c: g.ident.get(c, ("tuple",) + tuple(sorted((n.op, n.key, n.sid) for n in g.classes[c])))  # noqa: E731
    return {g.ident[c]: sorted((n.op, n.key, n.sid, tuple(name(ch) for ch in n.children)) for n in ns)
            for c, ns in g.classes.items() if c in g.ident}


@functools.lru_cache(maxsize=None)
def moves(src):
    """(dst layout code, collective, mesh axis) for every one-mesh-axis change of src the registry connects,
    where no inner mesh axis splits the same tensor axis before or after."""
    out = []
    for j, p in enumerate(src):
        for q in [R, P, PMAX] + [S(a) for a in range(8)]:  # dst: only the tensor's layouts are kept
            if q != p and not any(x.is_shard and x in src.placements[j + 1:] for x in (p, q)):
                dst = Layout(src.placements[:j] + (q,) + src.placements[j + 1:])
                out += [(dst.code(), kind.name, j) for kind in connecting(p, q)]
    return out


def reference(problem):
    """The signature of every class reachable from the loads: Keep and the registry's collectives move one
    mesh axis a level up (shards nest outer mesh axis first); a strategy runs from operands at level m."""
    m, canon = problem.mesh.ndim, {}
    for a, b in problem.equal:  # a composite and its decomposition: one tensor, named as read_back does
        group = {a, b} | {n for n, c in canon.items() if c in (canon.get(a), canon.get(b))}
        best = min(group, key=lambda n: (n in problem.origin, n))
        canon.update({n: best for n in group})
    c = lambda t: canon.get(t, t)  # noqa: E731
    nodes, todo = {}, []

    def add(ident, node):
        if ident not in nodes:
            nodes[ident] = set()
            todo.append(ident)
        nodes[ident].add(node)
    for tv in problem.fusion.inputs:
        for lay in problem.load_layouts(tv.name):
            add((c(tv.name), lay.code(), 0), ("Load", tv.name, -1, ()))
    layouts = {c(t): {lay.code(): lay for lay in lays} for t, lays in problem.layouts.items()}
    waiting = {}  # operand class -> the strategies that read it
    for key, ss in problem.strategies.items():
        e = problem.exprs[key]
        operands = [c(v.name) for _, v in e.args if hasattr(v, "logical_domain")]
        for s in ss:
            ins = tuple((t, lay.code(), m) for t, lay in zip(operands, s.inputs))
            for i in set(ins):
                waiting.setdefault(i, []).append((key, s, ins))
    while todo:
        t, code, k = ident = todo.pop()
        if k < m:
            add((t, code, k + 1), ("Keep", "", -1, (ident,)))
            for dst, kind, axis in moves(layouts[t][code]):
                if dst in layouts[t]:
                    add((t, dst, k + 1), ("Coll", kind, axis, (ident,)))
        for key, s, ins in waiting.get(ident, []):
            if all(i in nodes for i in ins):
                outs = [(c(o.name), lay.code(), 0) for o, lay in zip(problem.exprs[key].outputs, s.outputs)]
                if len(outs) == 1:
                    add(outs[0], ("Apply", key, s.sid, ins))
                else:
                    for j, o in enumerate(outs):
                        add(o, ("Proj", "", j, (("tuple", ("Apply", key, s.sid)),)))
    return {ident: sorted(ns) for ident, ns in nodes.items()}


def embedding_lm(tokens=6, vocab=16, hidden=8):
    """Token embedding, a projection, logits over the vocabulary and their cross entropy."""
    with ed.FusionDefinition() as fd:
        ids = fd.define_tensor((tokens,), torch.int64, name="ids")
        target = fd.define_tensor((tokens,), torch.int64, name="target")
        table = fd.define_tensor((vocab, hidden), name="table")
        w = fd.define_tensor((hidden, hidden), name="w")
        h = fd.ops.gelu(fd.ops.linear(fd.ops.embedding(ids, table), w))
        fd.add_output(fd.ops.cross_entropy(fd.ops.linear(h, table), target), name="loss")
    return fd


def softmax_rows(rows=6, cols=8):
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((rows, cols), name="x")
        fd.add_output(fd.ops.softmax(x, -1), name="y")
    return fd


MODELS = {"row_sum": lambda: models.row_sum(8, 64), "mlp": lambda: models.mlp(8, 16),
          "layer_norm": lambda: models.layer_norm(8, 16), "gpt_layer": lambda: models.gpt_layer(2, 8, 16, 4),
          "mlp_with_backward": lambda: models.mlp_with_backward(8, 16),
          "attention": lambda: models.attention(2, 6, 16, 4), "embedding_cross_entropy": embedding_lm,
          "softmax": softmax_rows}
MESHES = {(4,): [0, 1, 2, 3], (2, 4): [[0, 1, 2, 3], [4, 5, 6, 7]], (2, 2, 2): [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]}


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_egraph_builds_the_reachable_graph(model, mesh):
    problem = build_problem(MODELS[model](), ed.DeviceMesh(MESHES[mesh]))
    assert signature(saturate(problem)) == reference(problem)


@pytest.mark.parametrize("model", ["gpt_layer", "mlp_with_backward"])
def test_read_back_orders_classes_and_nodes_by_what_they_hold(model):
    """The extractors break cost ties by order, so read_back orders by content, never by egglog's rows:
    classes by (the program's order of tensors, level, layout), tuple classes after them; a class's
    nodes Load, Keep, Coll, Proj, Apply, each op's nodes by their children's class numbers (a Coll's
    then by collective and mesh axis)."""
    problem = build_problem(MODELS[model](), ed.DeviceMesh(MESHES[(2, 4)]))
    g = saturate(problem)
    rank = {name: i for i, name in enumerate(problem.fusion.tensors)}
    held = [c for c in g.classes if c in g.ident]
    number = lambda c: int(c[1:])  # noqa: E731
    assert [number(c) for c in g.classes] == sorted(number(c) for c in g.classes)
    assert held == list(g.classes)[:len(held)]  # tuple classes after every Held one
    keys = [(rank[t], t, level, lay) for t, lay, level in (g.ident[c] for c in held)]
    assert keys == sorted(keys)
    ops = ["Load", "Keep", "Coll", "Proj", "Apply"]
    for nodes in g.classes.values():
        assert [ops.index(n.op) for n in nodes] == sorted(ops.index(n.op) for n in nodes)
        for op in ("Keep", "Coll", "Proj"):
            got = [(tuple(map(number, n.children)), n.key, n.sid) for n in nodes if n.op == op]
            assert got == sorted(got)


def test_price_equals_collective_cost_per_node():
    """optimize._price computes a collective's seconds once per key of what they depend on (_Moves): every
    Coll node of a 2-D graph costs what collective_cost gives it alone, and holds its class's bytes."""
    from egraph_did.optimize import collective_cost, price
    problem = build_problem(MODELS["mlp_with_backward"](), ed.DeviceMesh(MESHES[(2, 4)]))
    g = saturate(problem)
    price(g, problem)
    colls = [(c, n) for c, ns in g.classes.items() for n in ns if n.op == "Coll"]
    assert len(colls) > 100
    for c, n in colls:
        t, dst, _ = g.ident[c]
        src = g.ident[n.children[0]][1]
        want = collective_cost(problem, n.key, n.sid, t, Layout.from_code(src), Layout.from_code(dst))[0]
        assert (n.cost, n.memory) == (want, problem.nbytes(t, Layout.from_code(dst))), (c, n)
