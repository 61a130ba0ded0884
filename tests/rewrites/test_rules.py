"""Every sharding rule states an identity; here each one is evaluated on random data, both sides.

Every rule of egraph_did.rewrites.ALL_RULES is declared with its numeric cases (`@rule(..., cases=[...])`
beside the rule: a small fusion on a small mesh each). For every case and every user expr in it, each
full-mesh strategy the optimizer would offer (egraph_did.problem.build_problem -> problem.strategies)
whose per-axis rules include the rule under test is run the way a plan runs it: every operand's global
random value is laid out in the strategy's input layout (shards from the loop domain; a partial as
random summands per rank whose sum, or max, is the value; expert rows, Pe, as each rank's rows of its
experts by the offsets the operand's rows are sorted by, zeros elsewhere), egraph_did.local.run_local computes every
rank's part with the local kernel the strategy names, and the outputs are assembled back (S: placed by
the loop domain, P: summed, Pmax: maxed, R: every replica equal) and compared with egraph_did.evaluate
on float64 inputs.

`rule` refuses a rule without cases; a test fails when a rule's cases never produce a strategy naming it.
"""
from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from egraph_did import DeviceMesh, FusionDefinition, evaluate
from egraph_did.cost import CostModel
from egraph_did.fusion import Fusion
from egraph_did.ir import TensorView
from egraph_did.layout import PE, Layout, R
from egraph_did.pins import apply_layout
from egraph_did.shards import Operand, RankContext
from egraph_did.collectives import EXCHANGE_FLAGS
from egraph_did.local import run_local
from egraph_did.ops import exchange_all_ranks
from egraph_did.problem import build_problem, expr_strategies
from egraph_did.rewrites import ALL_RULES, Case, rule
from egraph_did.rewrites.experts import rows_sorted_by
from egraph_did.sharding import local_indices, local_shape, shard_tensor

# float64 inputs; a local kernel differs from the global one only in summation order (partials, local
# reductions), i.e. by a few ulps of values of order 1, far below this bound.
TOL = 1e-10

F64, F32, I64 = torch.float64, torch.float32, torch.int64
RULE_BY_NAME = {r.name: r for r in ALL_RULES}


def build(c: Case) -> FusionDefinition:
    """The case's fusion: its inputs, its body, every result an output."""
    with FusionDefinition() as fd:
        ts = {n: fd.define_tensor(s.shape, s.dtype, n) for n, s in c.specs().items()}
        outs = c.body(fd.ops, **ts)
        for i, o in enumerate(outs if isinstance(outs, tuple) else (outs,)):
            fd.add_output(o, name=f"out{i}")
    return fd


# ---------------------------------------------------------------------- shard, run, assemble

def mesh_of(shape: tuple[int, ...]) -> DeviceMesh:
    return DeviceMesh(torch.arange(int(torch.tensor(shape).prod())).reshape(shape).tolist())


def view(shape, dtype, layout: Layout, mesh: DeviceMesh) -> TensorView:
    """A scratch TensorView whose loop domain is `layout` (as Plan.value_view builds one)."""
    return apply_layout(TensorView("t", tuple(shape), dtype, None, Fusion()), layout, mesh)


def without_partials(layout: Layout) -> Layout:
    return Layout(tuple(R if p.is_partial else p for p in layout))


def _noise(like: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if like.dtype.is_floating_point and like.dtype != F64:
        # dyadic values: summands of a float32 value add up exactly, so the partial is exactly the value
        return (torch.randint(-32, 32, like.shape, generator=g) / 8).to(like.dtype)
    if not like.dtype.is_floating_point:
        return torch.randint(-3, 4, like.shape, generator=g).to(like.dtype)
    return torch.randn(like.shape, generator=g, dtype=F64)


def expert_coords(offsets: torch.Tensor, rows: int, size: int) -> torch.Tensor:
    """Each row's owner on a mesh axis of `size` ranks that splits the offsets' experts (torch.chunk: as
    the ranged kernel holds them): the rank of its expert; rows past the last offset on the first rank."""
    experts = offsets.numel()
    expert = torch.searchsorted(offsets, torch.arange(rows, dtype=offsets.dtype), right=True)
    return torch.where(expert < experts, expert // -(-experts // size), torch.zeros_like(expert))


def distribute(value: torch.Tensor, layout: Layout, mesh: DeviceMesh, g: torch.Generator,
               offsets: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """Every rank's local tensor of `value` in `layout`. Along partial mesh axes the ranks hold random
    summands that add up to the shard (for a pending max: values <= the shard, one rank per element
    holding it), so a kernel that mishandles a summand shows. Expert rows (Pe): each rank the rows of its
    experts by `offsets` (expert_coords), zeros elsewhere."""
    tv = view(value.shape, value.dtype, without_partials(layout), mesh)
    base = {r: shard_tensor(value, tv, r) for r in mesh.ranks}
    pax = [m for m, p in enumerate(layout) if p.is_partial]
    if not pax:
        return base
    if any(layout[m].rows for m in pax):
        assert len(pax) == 1 and offsets is not None, f"expert rows of {layout}: one partial mesh axis, the offsets"
        m = pax[0]
        owner = expert_coords(offsets, value.shape[0], mesh.shape[m])
        out = {}
        for r in mesh.ranks:
            mine = owner[torch.from_numpy(local_indices(tv, r)[0])] == mesh.coords(r)[m]
            out[r] = torch.where(mine.reshape([-1] + [1] * (value.ndim - 1)), base[r], torch.zeros_like(base[r]))
        return out
    kinds = {layout[m].reduce for m in pax}
    assert len(kinds) == 1, f"layout {layout} mixes a pending sum and a pending max"
    rax = [m for m, p in enumerate(layout) if p.kind == "R"]
    out = {}
    for r in mesh.ranks:
        c = mesh.coords(r)
        if any(c[m] for m in pax + rax):
            continue
        group = [_moved(mesh, c, pax, sub) for sub in itertools.product(*(range(mesh.shape[m]) for m in pax))]
        shard = base[r]
        if kinds == {"sum"}:
            parts = [_noise(shard, g) for _ in group[1:]]
            first = shard - sum(parts) if parts else shard
            for q, part in zip(group, [first] + parts):
                out[q] = part.contiguous()
        else:
            owner = torch.randint(0, len(group), shard.shape, generator=g)
            for i, q in enumerate(group):
                below = _noise(shard, g).abs() + 1
                out[q] = torch.where(owner == i, shard, shard - below.to(shard.dtype)).contiguous()
    for r in mesh.ranks:  # replicas along R mesh axes hold the same summand
        if r not in out:
            out[r] = out[mesh.rank_at([0 if m in rax else x for m, x in enumerate(mesh.coords(r))])]
    return out


def _moved(mesh: DeviceMesh, coords, axes, sub) -> int:
    """The rank at `coords` with mesh axes `axes` moved to positions `sub`."""
    cc = list(coords)
    for m, i in zip(axes, sub):
        cc[m] = i
    return mesh.rank_at(cc)


def assemble(locals_by_rank: dict[int, torch.Tensor], layout: Layout, global_shape, mesh: DeviceMesh
             ) -> torch.Tensor:
    """The global tensor every rank's local result stands for: shards placed by the loop domain, partial
    mesh axes summed (Pmax: maxed), replicas checked equal."""
    first = next(iter(locals_by_rank.values()))
    tv = view(global_shape, first.dtype, without_partials(layout), mesh)
    rax = [m for m, p in enumerate(layout) if p.kind == "R"]
    pax = [m for m, p in enumerate(layout) if p.is_partial]
    out = torch.zeros(tuple(global_shape), dtype=first.dtype)
    for r in mesh.ranks:
        got = locals_by_rank[r]
        assert tuple(got.shape) == local_shape(tv, r), (
            f"rank {r} computed a local shape {tuple(got.shape)}; layout {layout} gives it {local_shape(tv, r)}")
        c = mesh.coords(r)
        if any(c[m] for m in rax):
            twin = mesh.rank_at([0 if m in rax else x for m, x in enumerate(c)])
            assert torch.equal(got, locals_by_rank[twin]), f"replicas {twin} and {r} differ under {layout}"
            continue
        if any(c[m] for m in pax):
            continue
        acc = got.clone()
        for sub in itertools.product(*(range(mesh.shape[m]) for m in pax)):
            if not any(sub):
                continue
            other = locals_by_rank[_moved(mesh, c, pax, sub)]
            acc = torch.maximum(acc, other) if layout[pax[0]].reduce == "max" else acc + other
        if out.ndim == 0:
            out = acc
        else:
            idx = local_indices(tv, r)
            n = len(idx)
            out[tuple(torch.from_numpy(ix).reshape([-1 if k == a else 1 for k in range(n)])
                      for a, ix in enumerate(idx))] = acc
    return out


def random_inputs(c: Case, g: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for n, s in c.specs().items():
        if s.dtype == I64:
            out[n] = torch.randint(0, s.high, s.shape, generator=g)
        elif s.dtype == F32:
            out[n] = (torch.randint(-32, 32, s.shape, generator=g) / 8).to(F32)
        else:
            out[n] = torch.randn(s.shape, generator=g, dtype=F64)
    return out


def expose_every_tensor(fd: FusionDefinition) -> None:
    """Make every intermediate an output, so the reference gives each expr's operands and results."""
    f = fd.fusion
    for e in f.exprs:
        for tv in e.outputs:
            if not any(t is tv for t in f.outputs.values()):
                fd.add_output(tv)


def flag_axes(strategy) -> dict[str, list[int]]:
    flags: dict[str, list[int]] = {}
    for m, fs in enumerate(strategy.flags):
        for f in fs:
            flags.setdefault(f, []).append(m)
    return flags


def user_strategies(c: Case):
    """(problem, mesh, [(expr, strategy)]) for every user expr of the case and every strategy."""
    fd = build(c)
    expose_every_tensor(fd)
    mesh = mesh_of(c.mesh)
    problem = build_problem(fd, mesh)
    pairs = []
    for e in fd.fusion.exprs:
        key = e.outputs[0].name
        pe = problem.exprs[key]
        pairs += [(pe, s) for s in problem.strategies[key]]
    return fd, problem, mesh, pairs


def check_strategy(e, s, env, mesh: DeviceMesh, g: torch.Generator) -> bool:
    """Run expr e under strategy s on every rank and compare the assembled outputs with the reference
    (False: not run)."""
    tensor_args = [(k, v) for k, v in e.args if isinstance(v, TensorView)]
    by = {k: rows_sorted_by(v) if PE in lay else None for (k, v), lay in zip(tensor_args, s.inputs)}
    if any(PE in lay and by[k] is None for (k, _), lay in zip(tensor_args, s.inputs)):
        return False  # expert rows of rows no offsets sort: no grouped_mm makes them, no rank owns a row
    local = {k: distribute(env[v.name], lay, mesh, g, env[by[k].name] if by[k] is not None else None)
             for (k, v), lay in zip(tensor_args, s.inputs)}
    operands = {k: Operand(v.shape, lay) for (k, v), lay in zip(tensor_args, s.inputs)}
    outputs = [Operand(o.shape, lay) for o, lay in zip(e.outputs, s.outputs)]
    flags = flag_axes(s)
    results: list[dict[int, torch.Tensor]] = [{} for _ in e.outputs]
    exchange = [f for f in flags if f in EXCHANGE_FLAGS]
    if exchange:  # an expert exchange communicates: every rank of its mesh axis at once, as simulate runs it
        (m,) = flags[exchange[0]]
        args = {r: {k: local[k][r] if isinstance(v, TensorView) else v for k, v in e.args} for r in mesh.ranks}
        results[0] = exchange_all_ranks(exchange[0], args, operands, outputs, mesh, m)
    for r in mesh.ranks if not exchange else ():
        args = {k: local[k][r] if isinstance(v, TensorView) else v for k, v in e.args}
        outs = run_local(e.op.name, args, operands, outputs, flags, RankContext(mesh, r))
        assert len(outs) == len(e.outputs)
        for i, o in enumerate(outs):
            results[i][r] = o
    for o, lay, res in zip(e.outputs, s.outputs, results):
        got = assemble(res, lay, o.shape, mesh)
        want = env[o.name]
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=lambda m: (
            f"{e} under {[str(x) for x in s.inputs]} -> {[str(x) for x in s.outputs]} "
            f"(rules {s.rules}, flags {flags}) on mesh {mesh.shape}:\n{m}"))
    return True


def _params():
    for r in ALL_RULES:
        for c in r.cases:
            yield pytest.param(r.name, c, id=f"{r.name}-{c.name}")


# ---------------------------------------------------------------------- tests

@pytest.mark.parametrize("rule_name, c", list(_params()))
def test_rule_identity_holds_on_random_data(rule_name, c):
    g = torch.Generator().manual_seed(zlib.crc32(f"{rule_name}-{c.name}".encode()))
    fd, problem, mesh, pairs = user_strategies(c)
    inputs = random_inputs(c, g)
    env = dict(inputs)
    env.update(evaluate(fd, inputs))
    checked = 0
    for e, s in pairs:
        if rule_name in s.rules:
            checked += check_strategy(e, s, env, mesh, g)
    assert checked, f"case {c.name} offers no strategy by rule {rule_name}"


def test_a_rule_without_a_numeric_case_is_refused():
    with pytest.raises(AssertionError, match="needs at least one numeric case"):
        @rule("exp", cases=[])
        def exp_without_cases(e):
            """exp(x) = exp(x)"""
            yield e.strategy(out=R)
    assert "exp_without_cases" not in RULE_BY_NAME and all(r.cases for r in ALL_RULES)


def test_case_names_are_unique_per_rule():
    for r in ALL_RULES:
        names = [c.name for c in r.cases]
        assert len(names) == len(set(names)), f"rule {r.name} repeats a case name: {names}"


def test_every_rule_is_exercised_by_its_cases():
    """A case only counts when the optimizer offers a strategy named after the rule (axis_strategies
    names a strategy after the first rule that finds it)."""
    idle = []
    for r in ALL_RULES:
        hits = 0
        for c in r.cases:
            _, _, _, pairs = user_strategies(c)
            hits += sum(r.name in s.rules for _, s in pairs)
        if not hits:
            idle.append(r.name)
    assert not idle, f"rules no case exercises: {idle}"


@pytest.mark.parametrize("r", ALL_RULES, ids=lambda r: r.name)
def test_rule_states_its_identity(r):
    assert r.identity.strip(), f"rule {r.name} has an empty identity (docstring first line)"


def test_problem_strategies_are_expr_strategies():
    """The strategies checked above are exactly those expr_strategies prices for the optimizer."""
    c = RULE_BY_NAME["linear_row_parallel"].cases[0]
    _, problem, mesh, _ = user_strategies(c)
    key = next(k for k, e in problem.exprs.items() if e.op.name == "linear")
    again = expr_strategies(problem.exprs[key], mesh, CostModel.h200(), problem)
    assert [(s.inputs, s.outputs, s.flags, s.rules) for s in again] == \
        [(s.inputs, s.outputs, s.flags, s.rules) for s in problem.strategies[key]]
