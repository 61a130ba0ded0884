from __future__ import annotations
import sys, time, json, traceback
sys.setrecursionlimit(10**6)
from egglog import *
class T(Expr): pass
@function
def Inp(name: StringLike) -> T: ...
@function
def Relu(x: T) -> T: ...
@function
def n(t: T) -> i64: ...
def attempt(label, f):
    try:
        t0 = time.perf_counter(); r = f(); print(f"{label}: OK ({time.perf_counter()-t0:.2f}s) -> {str(r)[:80]}")
        return r
    except BaseException as e:
        print(f"{label}: {type(e).__name__}: {str(e)[:150]!r}")
# rule-level primitive failure
rs = ruleset(name="ov")
t = var("t", T); k = var("k", i64)
rs.register(rule(eq(k).to(n(t))).then(set_(n(Relu(t))).to(k * k)))
eg = EGraph(); eg.register(set_(n(Inp("a"))).to(2**40))
attempt("i64 overflow inside rule action", lambda: eg.run(5, ruleset=rs))
for N in (1000, 3000, int(sys.argv[1]) if len(sys.argv) > 1 else 10000):
    print("N =", N, "recursionlimit", sys.getrecursionlimit())
    e = Inp("x")
    for _ in range(N): e = Relu(e)
    eg = EGraph()
    attempt(" register deep term", lambda: eg.register(e))
    r = attempt(" extract deep term", lambda: eg.extract(e))
    if r is not None: attempt(" str(extracted)", lambda: len(str(r)))
    attempt(" serialize+to_json", lambda: len(eg._serialize().to_json()))
