"""Host overhead of the prepared program (lowering/program.py) on a CPU: a proxy for the lean executor's
per-call cost on a GPU host, where the GPU time of a call hides none of its Python.

    python bench/host_overhead.py                      # this tree's program against the plain-torch floor
    python bench/host_overhead.py --before HEAD~2      # ... and against lowering/program.py as of HEAD~2

Rank 0's program of the 8-way GPT-3 TP and TP+SP plans (bench/plans) replayed at tiny float32 shapes
(bench/runtime.py's smoke plans), collectives replaced by stand-ins. Triton kernels do not run on a CPU
without the interpreter, whose cost has nothing to do with a GPU launch, so here (and only here) each
fused call is replaced by a stub that hands back the outputs its kernel wrote on a real run: what is
timed is the ATen calls and the program's own bookkeeping. `--cuda-path` prepares the program as for
CUDA tensors (a linear as the one mm, sdpa through torch's dispatcher): the calls a GPU host makes.

Rows, in µs of this thread's CPU time per run of the program (the least of --reps repetitions of --iters runs,
the variants interleaved repetition by repetition, so a busy machine slows them alike):
* floor: the same ATen ops written as plain torch calls (F.linear, view/transpose, sdpa), the fused
  outputs taken as given, as torch eager would run them;
* now / before: the prepared program (stubs for fused calls);
and per call: each call of this tree's program alone, to see which ones cost what.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused calls' one real run, to record their outputs

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import egraph_did as ed  # noqa: E402
from egraph_did.lowering import program as current  # noqa: E402
from egraph_did.shards import Operand, RankContext  # noqa: E402

import runtime  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def program_module_at(rev: str):
    """lowering/program.py as of git revision rev, imported beside this tree's (as
    egraph_did.lowering._program_<rev>): its relative imports resolve to this tree's modules."""
    source = subprocess.run(["git", "show", f"{rev}:lowering/program.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    name = "egraph_did.lowering._program_" + "".join(c if c.isalnum() else "_" for c in rev)
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "egraph_did.lowering"
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    exec(compile(source, f"{rev}:lowering/program.py", "exec"), module.__dict__)  # noqa: S102 - our own file
    return module


def local_tensors(plan, names, seed: int = 0) -> list[torch.Tensor]:
    ctx, g = RankContext(plan.mesh, plan.mesh.ranks[0]), torch.Generator().manual_seed(seed)
    out = []
    for name in names:
        v = plan.values[name]
        out.append(torch.randn(ctx.local_shape(Operand(v.shape, v.layout)), generator=g) * 0.1)
    return out


def stubbed_program(module, plan, cuda_path: bool):
    """(program with fused calls stubbed, its inputs): rank 0's program prepared by `module` (this tree's
    lowering/program.py or an older one), each fused call replaced by its recorded outputs."""
    names = module.program_inputs(plan)
    ins = local_tensors(plan, names)
    dsts = [c.dst for c in plan.steps if isinstance(c, ed.Collective)]
    stand_ins = dict(zip(dsts, local_tensors(plan, dsts, seed=1)))
    aten_calls = module._aten_calls
    if cuda_path:  # prepare as for CUDA tensors: the calls a GPU host makes (numerics not compared)
        module._aten_calls = lambda *a, **k: aten_calls(*a[:4], True)
    try:
        prog = module.prepare(plan, plan.mesh.ranks[0], ins, lambda p, c, t, r: stand_ins[c.dst])
    finally:
        module._aten_calls = aten_calls
    slots = [None] * prog.nslots
    slots[:len(ins)] = ins
    calls = []
    for call in prog.calls:
        out = tuple((call.first_fn or call.fn)(*[slots[a] for a in call.args]))
        for o, t in zip(call.outs, out):
            slots[o] = t
        if prog.segments[call.segment].kind == "fused":
            call = dataclasses.replace(call, fn=lambda *ts, out=out: out, first_fn=None)
        calls.append(call)
    stubbed = dataclasses.replace(prog, calls=calls, runs=0, _straight=None, graph=None)
    for _ in range(3):  # the checked first run, then the straight-line function
        stubbed.run(ins)
    return stubbed, ins


def floor_fn(prog, ins, cuda_path: bool):
    """The GPT-3 layer's ATen ops as plain torch calls on the program's tensors (fused outputs as given):
    what torch eager pays for the same ops. sdpa as the program computes it on a CPU (the math backend's
    op) unless cuda_path."""
    inputs = dict(zip(prog.inputs, ins))
    fused = [c.fn() for c in prog.calls if prog.segments[c.segment].kind == "fused"]
    ln1, ln2, gelu = fused[0][0], fused[1][-1], fused[2][0]
    wq, wk, wv, wo, w1, w2 = (next(t for n, t in inputs.items() if n.startswith(w + ":"))
                              for w in ("wq", "wk", "wv", "wo", "w1", "w2"))
    b, s, hd = 1, runtime.SMALL["seq"], runtime.SMALL["hidden"] // runtime.SMALL["heads"]
    ln1 = ln1 if ln1.shape[1] == s else ln1.repeat(1, s // ln1.shape[1], 1)  # TP+SP: the gathered norm
    ln2 = ln2 if ln2.shape[1] == s else ln2.repeat(1, s // ln2.shape[1], 1)
    math_sdpa = torch.ops.aten._scaled_dot_product_attention_math

    def sdpa(q, k, v):
        if cuda_path:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return math_sdpa(q, k, v, None, 0.0, True, None)[0]

    def layer():
        q = F.linear(ln1, wq).view(b, s, -1, hd).transpose(1, 2)
        k = F.linear(ln1, wk).view(b, s, -1, hd).transpose(1, 2)
        v = F.linear(ln1, wv).view(b, s, -1, hd).transpose(1, 2)
        o = sdpa(q, k, v).transpose(1, 2).reshape(b, s, -1)
        p1 = F.linear(o if o.shape[-1] == wo.shape[-1] else o.repeat(1, 1, wo.shape[-1] // o.shape[-1]), wo)
        p2 = F.linear(gelu, w2)
        return F.linear(ln2, w1), p1, p2
    return layer


def interleaved(fns: dict, iters: int, reps: int) -> dict[str, float]:
    """Least µs per call of each fn over the repetitions (the least disturbed), the fns timed in turn within each repetition. The clock is this
    thread's CPU time (torch runs on this thread alone: set_num_threads(1)): time the thread spends
    descheduled on a busy machine is not counted."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.thread_time_ns()
            for _ in range(iters):
                fn()
            times[name].append((time.thread_time_ns() - t0) * 1e-3 / iters)
    return {k: min(v) for k, v in times.items()}


def per_call(prog, ins, iters: int, reps: int) -> list[tuple[str, str, float]]:
    """(kind, segment description, median µs) of each call of a (stubbed) program, alone."""
    slots = [None] * prog.nslots
    slots[:len(ins)] = ins
    rows = []
    for call in prog.calls:
        args = [slots[a] for a in call.args]
        us = interleaved({"c": lambda: call.fn(*args)}, iters, reps)["c"]
        for o, t in zip(call.outs, call.fn(*args)):
            slots[o] = t
        rows.append((prog.segments[call.segment].kind, prog.described[call.segment], us))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="git revision whose lowering/program.py to time beside this tree's")
    ap.add_argument("--cuda-path", action="store_true", help="prepare the calls a GPU host makes")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--per-call", action="store_true", help="also time each call of this tree's program")
    args = ap.parse_args()
    torch.set_num_threads(1)
    modules = {"now": current, **({f"before ({args.before})": program_module_at(args.before)} if args.before else {})}
    print(f"torch {torch.__version__}, CPU, fused calls stubbed, {'CUDA' if args.cuda_path else 'CPU'} call path; "
          f"us per program run, least of {args.reps} x {args.iters}")
    for sp in (False, True):
        plan = runtime.smoke_plan(sp)
        progs = {name: stubbed_program(m, plan, args.cuda_path) for name, m in modules.items()}
        prog, ins = progs["now"]
        fns = {"floor (plain torch)": floor_fn(prog, ins, args.cuda_path),
               **{name: (lambda p=p, i=i: p.run(i)) for name, (p, i) in progs.items()}}
        result = interleaved(fns, args.iters, args.reps)
        print(f"\n{'TP+SP' if sp else 'TP'} 8-way rank 0 ({sum(1 for c in prog.calls if prog.segments[c.segment].kind == 'aten')}"
              f" ATen calls now)")
        for name, us in result.items():
            print(f"  {name:<28}{us:9.2f} us")
        for name, (p, i) in progs.items():  # sdpa's own compute is most of a CPU run: the rest apart
            rows = per_call(p, i, args.iters, args.reps)
            rest = sum(us for kind, what, us in rows if " = sdpa(" not in what)
            print(f"  {name:<28}{rest:9.2f} us in its {len(rows)} calls but sdpa, each timed alone")
            if args.per_call and name == "now":
                for kind, what, us in rows:
                    print(f"    {kind:<6}{us:8.2f}  {what[:80]}")


if __name__ == "__main__":
    main()
