from __future__ import annotations
import json, sys, traceback
from egglog import *

class T(Expr): pass
@function
def Inp(name: StringLike) -> T: ...
@function
def Relu(x: T) -> T: ...
@function
def val(t: T) -> i64: ...
@function(merge=lambda old, new: old.min(new))
def best(t: T) -> i64: ...
class D(Expr): pass
@function
def DR(t: T) -> D: ...

def attempt(label, f):
    try:
        r = f(); print(f"{label}: OK -> {r}")
    except BaseException as e:
        print(f"{label}: {type(e).__module__}.{type(e).__name__}: {str(e)[:200]!r}  isException={isinstance(e, Exception)}")

a = Inp("a")
eg = EGraph()
eg.register(set_(best(a)).to(5), set_(best(a)).to(3), set_(best(a)).to(9))
print("merge=min best(a):", eg.lookup_function_value(best(a)))
js = json.loads(eg._serialize().to_json())
print("best nodes in json:", [(k, v["op"], v["eclass"]) for k, v in js["nodes"].items() if v["op"] == "best"])
# max / * / / in actions
eg.register(set_(val(a)).to((i64(7) * 3 / 2).max(i64(4))))
print("val(a) = (7*3/2).max(4):", eg.lookup_function_value(val(a)))
print("i64 -7/2:", eg.extract(i64(-7) / 2))
attempt("i64 overflow 2**62*4", lambda: eg.extract(i64(2**62) * 4))
attempt("i64 div by zero", lambda: eg.extract(i64(1) / 0))
# conflicting set_ on plain i64 function
attempt("conflicting set_(val)", lambda: eg.register(set_(val(a)).to(99)))
attempt("egraph still usable after", lambda: eg.lookup_function_value(val(a)))
# set_cost twice same value, then different value
eg2 = EGraph()
attempt("set_cost same twice", lambda: eg2.register(set_cost(DR(a), 4), set_cost(DR(a), 4)))
attempt("set_cost conflicting", lambda: eg2.register(set_cost(DR(a), 5)))
attempt("eg2 usable after", lambda: eg2.extract(DR(a), include_cost=True))
# conflicting set_cost from a rule
rs = ruleset(name="rs")
t = var("t", T)
rs.register(rule(DR(t)).then(set_cost(DR(t), 1)), rule(DR(t)).then(set_cost(DR(t), 2)))
eg3 = EGraph(); eg3.register(DR(Relu(a)))
attempt("conflicting set_cost in rules", lambda: eg3.run(rs.saturate()))
# panic action
eg4 = EGraph()
attempt("panic action", lambda: eg4.register(panic("boom")))
