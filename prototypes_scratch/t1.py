from __future__ import annotations
import json
from egglog import *

class T(Expr): pass
@function
def Input(name: StringLike, n: i64Like) -> T: ...
@function(cost=7)
def Relu(x: T) -> T: ...
@function
def rows(t: T) -> i64: ...

class D(Expr): pass
@function(unextractable=True)
def At(t: T, l: i64Like) -> D: ...
@function
def DRelu(d: D) -> D: ...
@function(cost=0)
def Load(name: StringLike) -> D: ...

rs = ruleset(name="r")
t, x = vars_("t x", T); name = var("name", String); n = var("n", i64); l = var("l", i64)
rs.register(
    rule(eq(t).to(Input(name, n))).then(set_(rows(t)).to(n)),
    rule(eq(t).to(Relu(x)), At(x, l), eq(n).to(rows(x))).then(
        set_(rows(t)).to(n),
        union(At(t, l)).with_(DRelu(At(x, l))),
        set_cost(DRelu(At(x, l)), n * 3 / 2),
    ),
)
eg = EGraph()
x0 = Input("x", 10)
eg.register(union(At(x0, 0)).with_(Load("x")), Relu(Relu(x0)))
rep = eg.run(rs.saturate())
print("report:", rep)
s = eg._serialize()
print(type(s))
js = json.loads(s.to_json())
print(json.dumps(js, indent=1))
