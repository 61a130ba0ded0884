from __future__ import annotations
import json, sys
from egglog import *
exec(open("t1.py").read().split("eg = EGraph()")[0])   # reuse decls + ruleset

eg = EGraph()
x0 = Input("x", 10)
r2 = Relu(Relu(x0))
# register with a list?
try:
    eg.register([union(At(x0, 0)).with_(Load("x")), r2])
    print("register(list) OK")
except Exception as e:
    print("register(list) failed:", type(e).__name__, e)
eg.register(*[union(At(x0, 0)).with_(Load("x")), r2])
print("run(n, ruleset=):", eg.run(10, ruleset=rs).updated)
print("saturate again updated:", eg.run(rs.saturate()).updated)
# reading tables
print("lookup rows(r2):", eg.lookup_function_value(rows(r2)), type(eg.lookup_function_value(rows(r2))))
print("int(lookup):", int(eg.lookup_function_value(rows(r2))))
print("extract rows(r2):", eg.extract(rows(r2)), "eval:", eg.extract(rows(r2)).value)
print("lookup rows(Input('nope',1)):", eg.lookup_function_value(rows(Input("nope", 1))))
print("function_values(rows):", eg.function_values(rows))
print("function_size(rows):", eg.function_size(rows), "all sizes:", eg.all_function_sizes())
try: print("lookup get_cost(DRelu(At(Relu(x0),0))):", eg.lookup_function_value(get_cost(DRelu(At(Relu(x0), 0)))))
except Exception as e: print("get_cost lookup failed:", type(e).__name__, e)
print("extract At(r2,0):", eg.extract(At(r2, 0), include_cost=True))
print("extract r2:", eg.extract(r2, include_cost=True))
s = eg._serialize(split_primitive_outputs=False)
js = json.loads(s.to_json())
for k, v in js["nodes"].items():
    print(f"  {k:45s} op={v['op']!r:20s} eclass={v['eclass']:20s} children={v['children']} cost={v['cost']}")
print(s.to_dot()[:600])
