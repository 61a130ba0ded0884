"""Differential fuzzer: random fusions x meshes x pins x cost models x extractors, checked against the
single-device reference, with failures minimized to small runnable repros.

    .venv/bin/python bench/fuzz.py --cases 500 --seed 1 [--gloo-every 25] [--report /tmp/fuzz.md]
    .venv/bin/python bench/fuzz.py --seed 1 --case 17 --show        # print one case as a Python script

Every case is plain data (a dict: mesh, inputs, ops, outputs, pins, cost model), generated from
(seed, case index) alone, and rendered to a Python script (`case_source`) that is exactly what runs:
the repro printed for a failure is that script plus the failing check. Per case:

- build: the fusion, its pins (the loop-domain API: outer splits on any axis, non-outermost splits,
  nested splits over two mesh axes in either order, partials, splits that leave a rank empty) and inputs;
- optimize with the greedy and the exact extractor: a plan, or an egraph_did error (EgraphDidError)
  that names a tensor of the fusion (a refusal, counted but not a failure);
- simulate (lowered, the default, and lowered=False) equals ed.evaluate (float64 cases: 1e-6 relative
  to the output's scale; float32 2e-4; 16-bit floats looser);
- pins honoured: plan.loop_domain(t) is the pinned loop domain of every pinned tensor t;
- Plan.from_json(plan.to_json()) simulates bit for bit the same;
- like= replays the greedy plan (optimize(fd, mesh, like=Plan.from_json(plan.to_json()))), and a replay
  that differs simulates to the reference; every output's loop domain and plan.explain() are reported;
- an input no output reads (drawn as "unread") is ignored: evaluate without it gives the same outputs, the
  plan lists it in plan.unread, simulate and gloo take it;
- exact <= greedy in predicted time; a memory bound is respected; no collective on a mesh axis of size 1;
- a reshard probe (add_reshard, issue 29), pinned beside the case, runs the collectives DTensor would: an
  uneven S(a) -> S(b) with a rank left empty is one alltoall, a view keeping a size-1 axis moves nothing;
- every --gloo-every'th case also runs on real gloo processes (ed.launch + plan.run).

Cases run in a worker process (spawned, its own process group): a crash or a hang (--timeout) ends that
case only. A failure is minimized by delta debugging (drop outputs, cut ops into fresh inputs, bypass
ops, drop or simplify pins, shrink the mesh and the extents, drop the memory bound, float32 -> float64)
while the same failure class persists, and printed as a runnable script.

Library use (what tests/face/test_fuzz.py does):

>>> spec = generate_case(seed=0, index=3)
>>> [k for k in ("mesh", "inputs", "ops", "outputs", "pins", "cost") if k in spec]
['mesh', 'inputs', 'ops', 'outputs', 'pins', 'cost']
>>> "fd.add_output(" in case_source(spec)
True
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import functools
import os
import random
import re
import statistics
import sys
import time
import traceback
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (no GPU here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLOATS = ("float64", "float32", "bfloat16", "float16")
INTS = ("int64", "int32")
PROJECT_DIRS = ("egraph_did", "rewrites", "lowering")
DID = {1: ("DIDx",), 2: ("DIDy", "DIDx"), 3: ("DIDz", "DIDy", "DIDx")}

# Checks, in the order they run. A failure class starts with the check's name.
CHECKS = ("build", "evaluate", "optimize", "exact", "memory", "size1", "pins", "lowered", "eager", "json",
          "like", "gloo")


# =========================================================================== the generator

class _T:
    """A tensor the generator can use: shape, dtype and what is known of its values."""

    def __init__(self, name, shape, dtype, pos=False, bound=4.0, stats=False, is_input=False):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        self.pos, self.bound, self.stats, self.is_input = pos, bound, stats, is_input

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def is_float(self):
        return self.dtype in FLOATS


def _tensor_arg(name: str) -> dict:
    return {"t": name}


def _is_tensor_arg(v) -> bool:
    return isinstance(v, dict) and set(v) == {"t"}


class _Gen:
    """Builds one case's ops over a pool of tensors, creating fresh inputs where an operand must fit."""

    MAX_ELEMS = 512

    def __init__(self, rng: random.Random, dtype: str, ops: list[str]):
        self.rng, self.dtype, self.allowed = rng, dtype, ops
        self.inputs: dict[str, dict] = {}
        self.ops: list[dict] = []
        self.pool: list[_T] = []
        self.n_in = self.n_t = 0

    # ------------------------------------------------------------ tensors
    def ext(self, small=False) -> int:
        r = self.rng.random()
        if r < 0.15:
            return 1
        if small or r < 0.9:
            return self.rng.randint(2, 6 if small else 7)
        return self.rng.randint(8, 13)

    def shape(self, ndim=None, small=False) -> tuple:
        ndim = self.rng.choice((1, 2, 2, 2, 3, 3)) if ndim is None else ndim
        for _ in range(20):
            s = tuple(self.ext(small) for _ in range(ndim))
            if math.prod(s) <= self.MAX_ELEMS:
                return s
        return (2,) * ndim

    def new_input(self, shape, dtype=None, data="randn", high=None) -> _T:
        name = f"x{self.n_in}"
        self.n_in += 1
        dtype = dtype or self.dtype
        spec = {"shape": list(shape), "dtype": dtype, "data": data}
        if high is not None:
            spec["high"] = high
        self.inputs[name] = spec
        t = _T(name, shape, dtype, pos=data == "pos", bound={"randn": 4.0, "pos": 4.5, "small": 2.0}.get(data, 1.0),
               is_input=True)
        if data != "int":
            self.pool.append(t)
        return t

    def pick(self, pred=lambda t: True, float_only=True, new_ok=True, ndim=None) -> _T | None:
        """An operand: a recent tensor of the pool (chains form), or a fresh input."""
        cands = [t for t in self.pool if not t.stats and (t.is_float or not float_only) and pred(t)
                 and (ndim is None or t.ndim in ((ndim,) if isinstance(ndim, int) else ndim))]
        if cands and (not new_ok or self.rng.random() < 0.8):
            weights = [1.0 + 3.0 * (not t.is_input) + i / 2 for i, t in enumerate(cands)]
            return self.rng.choices(cands, weights)[0]
        if not new_ok:
            return None
        nd = ndim if isinstance(ndim, int) else (self.rng.choice(ndim) if ndim else None)
        for _ in range(20):
            t = _T("?", self.shape(nd), self.dtype)
            if pred(t):
                return self.new_input(t.shape)
        return None

    # ------------------------------------------------------------ emitting
    def emit(self, op: str, args: list, n_out=1, stats=False, pos=False, bound=None) -> list[_T]:
        """Append op(args); shapes and dtypes from the op table's own shape rule (ShapeError: rejected)."""
        from egraph_did.ops import OPS, TensorSpec

        env = {t.name: t for t in self.pool}
        env.update({n: _T(n, s["shape"], s["dtype"]) for n, s in self.inputs.items() if n not in env})

        def spec_of(v):
            if _is_tensor_arg(v):
                t = env[v["t"]]
                return TensorSpec(t.name, t.shape, _torch_dtype(t.dtype), tuple(f"a{i}" for i in range(t.ndim)))
            return _decode_literal(v)

        outs = OPS[op].infer(**{k: spec_of(v) for k, v in args})
        tensors_in = [env[v["t"]] for _, v in args if _is_tensor_arg(v)]
        b = bound if bound is not None else max([t.bound for t in tensors_in] or [1.0])
        names = []
        made = []
        for o in outs[:n_out] if n_out else outs:
            name = f"t{self.n_t}"
            self.n_t += 1
            t = _T(name, o.shape, str(o.dtype).replace("torch.", ""), pos=pos, bound=min(b, 1e30), stats=stats)
            made.append(t)
            names.append(name)
        self.ops.append({"op": op, "args": [[k, v] for k, v in args], "outs": names})
        self.pool.extend(made)
        return made

    def positive(self, t: _T) -> _T:
        """t itself when its values are >= 0.5, else abs(t) + 0.5 (two more ops), or a fresh positive input."""
        if t.pos:
            return t
        if t.is_input and self.rng.random() < 0.5:
            return self.new_input(t.shape, t.dtype if t.is_float else None, data="pos")
        (a,) = self.emit("abs", [["x", _tensor_arg(t.name)]])
        (p,) = self.emit("add", [["a", _tensor_arg(a.name)], ["b", 0.5]], pos=True, bound=t.bound + 0.5)
        return p

    def tame(self, t: _T, limit=8.0) -> _T:
        """tanh(t) when t may be large (keeps exp, pow and products finite)."""
        if t.bound <= limit or not t.is_float:
            return t
        (u,) = self.emit("tanh", [["x", _tensor_arg(t.name)]], bound=1.0)
        return u

    def bcast_shape(self, shape: tuple) -> tuple:
        """A shape that broadcasts against `shape`: a suffix of it, some axes set to 1."""
        k = self.rng.randint(1, len(shape)) if shape else 0
        out = [1 if self.rng.random() < 0.3 else e for e in shape[len(shape) - k:]]
        return tuple(out)

    def dims(self, t: _T, allow_none=True):
        if allow_none and self.rng.random() < 0.2:
            return None
        k = self.rng.randint(1, t.ndim)
        ds = sorted(self.rng.sample(range(t.ndim), k))
        ds = [d - t.ndim if self.rng.random() < 0.3 else d for d in ds]
        return ds[0] if len(ds) == 1 and self.rng.random() < 0.5 else ds

    @staticmethod
    def count(t: _T, dims) -> int:
        if dims is None:
            return math.prod(t.shape)
        ds = [dims] if isinstance(dims, int) else dims
        return math.prod(t.shape[d] for d in ds)

    # ------------------------------------------------------------ one op of each family
    def gen(self, op: str) -> bool:
        from egraph_did.ops import ops_where
        g = getattr(self, f"g_{op}", None)
        if g is None:
            if op in ops_where(kind="pointwise", arity=2):
                return self.g_binary(op)
            if op in ops_where(kind="pointwise", arity=1) + ("gelu", "silu"):  # a new unary op is fuzzed at once
                return self.g_unary(op)
            if op in ("sum", "amax", "mean"):
                return self.g_reduce(op)
            raise KeyError(op)
        return g()

    def g_binary(self, op):
        rng = self.rng
        int_ok = op in ("add", "sub", "mul", "maximum", "minimum") and rng.random() < 0.15
        a = self.pick(float_only=not int_ok, pred=lambda t: t.dtype != "bool")
        if a is None:
            return False
        form = rng.choices(["scalar", "tensor", "left"], [3, 6, 1])[0]
        if op == "pow":
            if not a.is_float:
                return False
            if form == "left":  # 2 ** t
                return bool(self.emit("pow", [["a", 2.0], ["b", _tensor_arg(self.tame(a, 4).name)]]))
            base = self.positive(self.tame(a, 4))
            if form == "scalar":
                e = rng.choice([2, 3, 0.5, -1, 1.5, 2.0])
                return bool(self.emit("pow", [["a", _tensor_arg(base.name)], ["b", e]], bound=base.bound ** 3))
            ex = self.new_input(self.bcast_shape(base.shape) if rng.random() < 0.7 else (), data="small")
            return bool(self.emit("pow", [["a", _tensor_arg(base.name)], ["b", _tensor_arg(ex.name)]],
                                  bound=base.bound ** 2 + 4))
        if form == "scalar":
            s = rng.choice([2.0, 0.5, -1.5, 3, 1]) if a.is_float else rng.choice([2, 3, -1])
            bound = a.bound * 3 + 3
            if op == "div":
                bound = a.bound * 2
            return bool(self.emit(op, [["a", _tensor_arg(a.name)], ["b", s]], bound=bound))
        if form == "left":
            if op == "div":
                a = self.positive(self.tame(a))
                return bool(self.emit(op, [["a", 2.0], ["b", _tensor_arg(a.name)]], bound=4.0))
            return bool(self.emit(op, [["a", rng.choice([2.0, -1.0, 3])], ["b", _tensor_arg(a.name)]],
                                  bound=a.bound * 3 + 3))
        # tensor with tensor: an existing one that broadcasts, or a fresh one of a broadcast shape
        def fits(t):
            try:
                _broadcast(a.shape, t.shape)
                return t.name != a.name or rng.random() < 0.3
            except ValueError:
                return False
        b = self.pick(pred=fits, float_only=a.is_float, new_ok=False) if rng.random() < 0.5 else None
        if b is None:
            if rng.random() < 0.25 and 1 in a.shape:  # b is the wider one
                shape = tuple(self.ext() if e == 1 else e for e in a.shape)
                if math.prod(shape) > self.MAX_ELEMS:
                    shape = a.shape
            else:
                shape = self.bcast_shape(a.shape)
            dtype = a.dtype
            if a.is_float and rng.random() < 0.15:
                dtype = rng.choice(["float32", "float64"])
            b = self.new_input(shape, dtype if a.is_float else a.dtype)
        if op == "div":
            b = self.positive(self.tame(b))
        if op == "mul":
            a, b = self.tame(a, 100), self.tame(b, 100)
        args = [["a", _tensor_arg(a.name)], ["b", _tensor_arg(b.name)]]
        if rng.random() < 0.3:
            args = [["a", args[1][1]], ["b", args[0][1]]] if op != "div" else args
        bound = {"mul": a.bound * b.bound, "div": a.bound * 2}.get(op, a.bound + b.bound)
        return bool(self.emit(op, args, bound=bound))

    def g_unary(self, op):
        t = self.pick(float_only=op not in ("neg", "relu", "abs"), pred=lambda t: t.dtype != "bool")
        if t is None:
            return False
        if op in ("log", "rsqrt", "sqrt"):
            t = self.positive(self.tame(t, 1e4))
        if op == "exp":
            t = self.tame(t)
        args = [["x", _tensor_arg(t.name)]]
        if op == "gelu" and self.rng.random() < 0.5:
            args.append(["approximate", "tanh"])
        bound = {"exp": math.exp(min(t.bound, 50)), "tanh": 1.0, "sigmoid": 1.0, "erf": 1.0, "log": 5.0,
                 "rsqrt": 2.0, "sqrt": math.sqrt(t.bound)}.get(op, t.bound)
        pos = op in ("sqrt",) and t.pos
        return bool(self.emit(op, args, bound=bound, pos=pos))

    def g_cast(self):
        t = self.pick(float_only=False)
        if t is None:
            return False
        r = self.rng.random()
        if r < 0.6:
            target = "float64" if t.dtype != "float64" else "float32"
        elif r < 0.75:
            target = self.rng.choice(["bfloat16", "float16"])
        else:
            target = self.rng.choice(["int32", "int64", "bool"])
        lit = target if self.rng.random() < 0.3 else {"dtype": target}
        return bool(self.emit("cast", [["x", _tensor_arg(t.name)], ["dtype", lit]], bound=t.bound))

    def g_causal_mask(self):
        t = self.pick(ndim=(2, 3, 4))
        if t is None:
            return False
        args = [["x", _tensor_arg(t.name)]]
        if self.rng.random() < 0.3:
            args.append(["offset", 1])
        (m,) = self.emit("causal_mask", args)
        if self.rng.random() < 0.7:  # -inf is for a softmax
            self.emit("softmax", [["x", _tensor_arg(m.name)], ["dim", -1]], bound=1.0)
        return True

    def g_reduce(self, op):
        t = self.pick(float_only=op == "mean", pred=lambda t: t.dtype != "bool" or op == "sum")
        if t is None:
            return False
        dims = self.dims(t)
        args = [["x", _tensor_arg(t.name)], ["dims", dims]]
        if self.rng.random() < 0.5:
            args.append(["keepdim", True])
        bound = t.bound * (self.count(t, dims) if op == "sum" else 1)
        return bool(self.emit(op, args, bound=bound))

    def g_var_mean(self):
        t = self.pick()
        if t is None:
            return False
        dims = self.dims(t)
        corr = 1 if self.count(t, dims) >= 2 and self.rng.random() < 0.6 else 0
        args = [["x", _tensor_arg(t.name)], ["dims", dims], ["correction", corr]]
        if self.rng.random() < 0.4:
            args.append(["keepdim", True])
        return bool(self.emit("var_mean", args, n_out=2, bound=t.bound ** 2))

    def _blocks(self) -> _T | None:
        t = self.pick(pred=lambda t: t.ndim <= 3)
        if t is None:
            return None
        d = self.rng.randrange(t.ndim)
        d = d - t.ndim if self.rng.random() < 0.4 else d
        ext = t.shape[d]
        blocks = self.rng.randint(1, max(1, min(5, ext))) if self.rng.random() < 0.9 else self.rng.randint(1, 5)
        (s,) = self.emit("welford_blocks", [["x", _tensor_arg(t.name)], ["dim", d], ["blocks", blocks]],
                         stats=True, bound=t.bound ** 2 * 16)
        s.welford = (d % t.ndim, ext, ext // blocks)  # (blocks axis, its extent, smallest block)
        return s

    def g_welford_blocks(self):
        return self._blocks() is not None

    def g_welford_merge(self):
        stats = [t for t in self.pool if t.stats]
        s = self.rng.choice(stats) if stats and self.rng.random() < 0.5 else self._blocks()
        if s is None:
            return False
        inner = s.ndim - 1
        d = self.rng.randrange(inner)
        d = d - inner if self.rng.random() < 0.5 else d
        args = [["stats", _tensor_arg(s.name)], ["dim", d]]
        baxis, ext, smallest = getattr(s, "welford", (None, 0, 0))
        total = ext if d % inner == baxis else s.shape[d % inner] * smallest
        if self.rng.random() < 0.5 or total < 2:  # correction 1 over one element is 0/0
            args.append(["correction", 0])
        if self.rng.random() < 0.4:
            args.append(["keepdim", True])
        return bool(self.emit("welford_merge", args, n_out=2, bound=s.bound))

    def g_softmax(self):
        t = self.pick()
        if t is None:
            return False
        args = [["x", _tensor_arg(t.name)]]
        if self.rng.random() < 0.6:
            d = self.rng.randrange(t.ndim)
            args.append(["dim", d - t.ndim if self.rng.random() < 0.4 else d])
        return bool(self.emit("softmax", args, bound=1.0))

    def _norm(self, op):
        t = self.pick()
        if t is None:
            return False
        k = 1 if t.ndim == 1 or self.rng.random() < 0.7 else 2
        trailing = t.shape[t.ndim - k:]
        args = [["x", _tensor_arg(t.name)]]
        weight = self.rng.random() < 0.5
        form = self.rng.random()
        if form < 0.4 or (not weight and k > 1):
            args.append(["normalized_shape", list(trailing) if (k > 1 or self.rng.random() < 0.5) else trailing[0]])
        elif weight is False and k == 1:
            pass  # the default: the last axis
        if weight:
            w = self.new_input(trailing, t.dtype)
            args.append(["weight", _tensor_arg(w.name)])
        if op == "layer_norm" and self.rng.random() < 0.4:
            b = self.new_input(trailing, t.dtype)
            args.append(["bias", _tensor_arg(b.name)])
        if self.rng.random() < 0.3:
            args.append(["eps", 1e-3])
        return bool(self.emit(op, args, bound=8.0 * (1 + weight * 4)))

    def g_layer_norm(self):
        return self._norm("layer_norm")

    def g_rms_norm(self):
        return self._norm("rms_norm")

    def g_linear(self):
        x = self.pick(pred=lambda t: t.dtype in ("float32", "float64"))
        if x is None:
            return False
        x = self.tame(x, 50)
        out = self.ext()
        w = self.new_input((out, x.shape[-1]) if x.ndim else (out, 1), x.dtype)
        if x.ndim == 0:
            return False
        args = [["x", _tensor_arg(x.name)], ["weight", _tensor_arg(w.name)]]
        if self.rng.random() < 0.5:
            b = self.new_input((out,), x.dtype)
            args.append(["bias", _tensor_arg(b.name)])
        return bool(self.emit("linear", args, bound=x.bound * 4 * x.shape[-1] + 4))

    def g_matmul(self):
        a = self.pick(ndim=(2, 3), pred=lambda t: t.dtype in ("float32", "float64"))
        if a is None:
            return False
        a = self.tame(a, 50)
        batch = self.bcast_shape(a.shape[:-2]) if a.ndim > 2 and self.rng.random() < 0.7 else ()
        if a.ndim == 2 and self.rng.random() < 0.3:
            batch = (self.ext(small=True),)
        b = self.new_input(batch + (a.shape[-1], self.ext()), a.dtype)
        args = [["a", _tensor_arg(a.name)], ["b", _tensor_arg(b.name)]]
        return bool(self.emit("matmul", args, bound=a.bound * 4 * a.shape[-1]))

    def _attention_args(self) -> list:
        """sdpa's arguments: q (an existing 4-D float tensor, tamed, or a new one), new k and v."""
        q = self.pick(ndim=4, new_ok=False, pred=lambda t: t.dtype in ("float32", "float64"))
        if q is None or self.rng.random() < 0.4:
            q = self.new_input(self.shape(4, small=True))
        q = self.tame(q, 10)
        b, h, sq, d = q.shape
        causal = self.rng.random() < 0.4
        sk = sq if causal or self.rng.random() < 0.5 else self.ext(small=True)
        k = self.new_input((b, h, sk, d), q.dtype)
        v = self.new_input((b, h, sk, self.ext(small=True)), q.dtype)
        args = [["q", _tensor_arg(q.name)], ["k", _tensor_arg(k.name)], ["v", _tensor_arg(v.name)]]
        if causal:
            args.append(["is_causal", True])
        if self.rng.random() < 0.3:
            args.append(["scale", 0.5])
        return args

    def g_sdpa(self):
        return bool(self.emit("sdpa", self._attention_args(), bound=4.0))

    def g_sdpa_lse(self):
        # the logsumexp of scores of at most 10 * 10 * 4 per term (q tamed, k and v drawn small), over few keys
        return bool(self.emit("sdpa_lse", self._attention_args(), n_out=2, bound=500.0))

    def g_sdpa_backward(self):
        args = self._attention_args()
        out, lse = self.emit("sdpa_lse", args, n_out=2, bound=500.0)
        g = self.new_input(out.shape, out.dtype)
        tensors = [["g", _tensor_arg(g.name)]] + args[:3] + [["output", _tensor_arg(out.name)],
                                                             ["lse", _tensor_arg(lse.name)]]
        return bool(self.emit("sdpa_backward", tensors + args[3:], n_out=3, bound=500.0))

    def g_attention_blocks(self):
        # sdpa's rfactor half: blocks 1..5 (the key blocks rule applies where they are a mesh axis's size)
        args = self._attention_args() + [["blocks", self.rng.randint(1, 5)]]
        return bool(self.emit("attention_blocks", args, n_out=2, bound=500.0))

    def g_embedding(self):
        w = self.pick(ndim=2, new_ok=False, pred=lambda t: t.is_float) if self.rng.random() < 0.5 else None
        w = w or self.new_input((self.ext(), self.ext()))
        ids = self.new_input(self.shape(self.rng.choice((1, 2))), self.rng.choice(INTS), data="int",
                             high=[w.name, 0])
        return bool(self.emit("embedding", [["indices", _tensor_arg(ids.name)], ["weight", _tensor_arg(w.name)]]))

    def g_take_along_axis(self):
        x = self.pick()
        if x is None:
            return False
        d = self.rng.randrange(x.ndim)
        shape = list(x.shape)
        shape[d] = self.ext()
        idx = self.new_input(shape, "int64", data="int", high=[x.name, d])
        dim = d - x.ndim if self.rng.random() < 0.4 else d
        return bool(self.emit("take_along_axis", [["x", _tensor_arg(x.name)], ["index", _tensor_arg(idx.name)],
                                                  ["dim", dim]]))

    def g_scatter_add(self):
        x = self.pick()
        if x is None:
            return False
        d = self.rng.randrange(x.ndim)
        shape = list(x.shape)
        shape[d] = self.ext()  # more or fewer entries than x has along d; repeated positions add up
        idx = self.new_input(shape, "int64", data="int", high=[x.name, d])
        src = self.new_input(shape, x.dtype)
        dim = d - x.ndim if self.rng.random() < 0.4 else d
        return bool(self.emit("scatter_add", [["x", _tensor_arg(x.name)], ["dim", dim],
                                              ["index", _tensor_arg(idx.name)], ["src", _tensor_arg(src.name)]],
                              bound=x.bound + src.bound * shape[d]))

    def g_cross_entropy(self):
        logits = self.pick(ndim=2, new_ok=False) if self.rng.random() < 0.5 else None
        logits = self.tame(logits or self.new_input(self.shape(2)), 20)
        target = self.new_input((logits.shape[0],), "int64", data="int", high=[logits.name, 1])
        args = [["logits", _tensor_arg(logits.name)], ["target", _tensor_arg(target.name)]]
        if self.rng.random() < 0.6:
            args.append(["reduction", self.rng.choice(["sum", "none", "mean"])])
        return bool(self.emit("cross_entropy", args, bound=logits.bound * 2 + 5))

    def g_reshape(self):
        t = self.pick(float_only=False)
        if t is None:
            return False
        rng, shape = self.rng, list(t.shape)
        r = rng.random()
        if r < 0.15:
            new = shape  # identity
        elif r < 0.3:
            new = [math.prod(shape)]
        elif r < 0.5 and len(shape) >= 2:
            i = rng.randrange(len(shape) - 1)
            new = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2:]
        elif r < 0.75:
            i = rng.randrange(len(shape))
            divs = [f for f in range(2, shape[i]) if shape[i] % f == 0]
            if divs:
                f = rng.choice(divs)
                new = shape[:i] + [f, shape[i] // f] + shape[i + 1:]
            else:
                new = shape[:i] + [1, shape[i]] + shape[i + 1:]
        else:
            new = [e for e in shape if e != 1] or [1]
            if len(new) == len(shape):
                new = new + [1]
        if rng.random() < 0.2 and new:
            new = list(new)
            new[rng.randrange(len(new))] = -1
        return bool(self.emit("reshape", [["x", _tensor_arg(t.name)], ["shape", list(new)]]))

    def g_permute(self):
        t = self.pick(float_only=False, pred=lambda t: t.ndim >= 2)
        if t is None:
            return False
        dims = list(range(t.ndim))
        self.rng.shuffle(dims)
        dims = [d - t.ndim if self.rng.random() < 0.2 else d for d in dims]
        return bool(self.emit("permute", [["x", _tensor_arg(t.name)], ["dims", dims]]))

    def g_transpose(self):
        t = self.pick(float_only=False, pred=lambda t: t.ndim >= 2)
        if t is None:
            return False
        a, b = self.rng.sample(range(t.ndim), 2)
        if self.rng.random() < 0.3:
            b -= t.ndim
        return bool(self.emit("transpose", [["x", _tensor_arg(t.name)], ["dim0", a], ["dim1", b]]))

    def g_unsqueeze(self):
        t = self.pick(float_only=False, pred=lambda t: t.ndim <= 3)
        if t is None:
            return False
        d = self.rng.randint(-t.ndim - 1, t.ndim)
        return bool(self.emit("unsqueeze", [["x", _tensor_arg(t.name)], ["dim", d]]))

    def g_expand(self):
        t = self.pick(float_only=False, pred=lambda t: 1 in t.shape or t.ndim <= 2)
        if t is None:
            return False
        new = [self.ext() if e == 1 else (-1 if self.rng.random() < 0.3 else e) for e in t.shape]
        if t.ndim <= 2 and self.rng.random() < 0.4:
            new = [self.ext(small=True)] + new
        if math.prod(abs(e) if e != -1 else t.shape[i - (len(new) - t.ndim)] for i, e in enumerate(new)) > self.MAX_ELEMS:
            return False
        return bool(self.emit("expand", [["x", _tensor_arg(t.name)], ["shape", new]]))

    def g_slice(self):
        t = self.pick(float_only=False)
        if t is None:
            return False
        d = self.rng.randrange(t.ndim)
        n = t.shape[d]
        if n == 0:
            return False
        # a non-empty range (an empty one leaves an index nothing to pick: test_ops has that case), written
        # in torch's bounds: negative from the end, past the end clamps, no end
        lo = self.rng.randrange(n)
        hi = self.rng.randint(lo + 1, n)
        start = lo - n if self.rng.random() < 0.3 else lo
        end = self.rng.choice([None, n + 3]) if hi == n else (hi - n if self.rng.random() < 0.3 else hi)
        args = [["x", _tensor_arg(t.name)], ["dim", d - t.ndim if self.rng.random() < 0.3 else d], ["start", start]]
        if end is not None:
            args.append(["end", end])
        return bool(self.emit("slice", args))

    def g_cat(self):
        a = self.pick(float_only=False, pred=lambda t: t.ndim >= 1)
        if a is None:
            return False
        d = self.rng.randrange(a.ndim)
        shape = list(a.shape)
        shape[d] = self.ext(small=True)
        b = self.pick(float_only=False, new_ok=False, pred=lambda t: t.dtype == a.dtype and t.ndim == a.ndim and all(
            i == d or x == y for i, (x, y) in enumerate(zip(t.shape, a.shape)))) if self.rng.random() < 0.4 else None
        if b is None:
            if math.prod(shape) > self.MAX_ELEMS:
                return False
            b = self.new_input(shape, a.dtype if a.dtype != "bool" else None)
            if b.dtype != a.dtype:
                return False
        pair = [a, b] if self.rng.random() < 0.5 else [b, a]
        return bool(self.emit("cat", [["a", _tensor_arg(pair[0].name)], ["b", _tensor_arg(pair[1].name)],
                                      ["dim", d - a.ndim if self.rng.random() < 0.3 else d]],
                              bound=max(a.bound, b.bound)))

    def g_silu_backward(self):
        """silu's gradient silu_backward(dy, x): dy of x's shape, an existing tensor or a fresh one"""
        x = self.pick()
        if x is None:
            return False
        dy = self.pick(pred=lambda t: t.shape == x.shape, new_ok=False) or self.new_input(x.shape)
        dy = self.tame(dy, 100)
        return bool(self.emit("silu_backward", [["dy", _tensor_arg(dy.name)], ["x", _tensor_arg(x.name)]],
                              bound=dy.bound * 1.1))

    def g_where(self):
        a = self.pick()
        if a is None:
            return False
        c = self.pick(pred=lambda t: _fits_broadcast(t.shape, a.shape), new_ok=False) or self.new_input(
            self.bcast_shape(a.shape))
        (cond,) = self.emit(self.rng.choice(["gt", "lt", "le", "ge", "ne"]), [["a", _tensor_arg(c.name)], ["b", 0.0]])
        form = self.rng.choice(["tensor", "fill", "fill-left"])
        if form == "tensor":
            b = self.pick(pred=lambda t: _fits_broadcast(t.shape, a.shape) and t.dtype == a.dtype,
                          new_ok=False) or self.new_input(self.bcast_shape(a.shape), a.dtype)
            ab = [_tensor_arg(a.name), _tensor_arg(b.name)]
            bound = max(a.bound, b.bound)
        else:
            fill = self.rng.choice([0.0, -1.5, 2.0])
            ab = [_tensor_arg(a.name), fill] if form == "fill" else [fill, _tensor_arg(a.name)]
            bound = max(a.bound, abs(fill))
        return bool(self.emit("where", [["cond", _tensor_arg(cond.name)], ["a", ab[0]], ["b", ab[1]]], bound=bound))

    # masks and positions (issue 11): a mask from a comparison, combined, reduced or scanned
    def _mask(self, like=None) -> _T | None:
        t = self.pick() if like is None else (self.pick(pred=lambda t: _fits_broadcast(t.shape, like.shape),
                                                        new_ok=False) or self.new_input(self.bcast_shape(like.shape)))
        if t is None:
            return None
        (m,) = self.emit(self.rng.choice(["gt", "lt", "ne"]), [["a", _tensor_arg(t.name)], ["b", 0.0]])
        return m

    def _bitwise(self, op):
        m = self._mask()
        if m is None:
            return False
        other = self.rng.choice([True, False]) if self.rng.random() < 0.3 else _tensor_arg(self._mask(m).name)
        ab = [_tensor_arg(m.name), other] if self.rng.random() < 0.5 else [other, _tensor_arg(m.name)]
        return bool(self.emit(op, [["a", ab[0]], ["b", ab[1]]], bound=1.0))

    def g_bitwise_and(self):
        return self._bitwise("bitwise_and")

    def g_bitwise_or(self):
        return self._bitwise("bitwise_or")

    def g_bitwise_xor(self):
        return self._bitwise("bitwise_xor")

    def _truth(self, op):
        m = self._mask()
        if m is None:
            return False
        args = [["x", _tensor_arg(m.name)], ["dims", self.dims(m)]]
        if self.rng.random() < 0.5:
            args.append(["keepdim", True])
        return bool(self.emit(op, args, bound=1.0))

    def g_any(self):
        return self._truth("any")

    def g_all(self):
        return self._truth("all")

    def g_amin(self):
        return self.g_reduce("amin")

    def g_prod(self):
        t = self.pick()
        if t is None:
            return False
        t = self.tame(t, 1.0)  # |values| <= 1: the product of any count stays finite
        args = [["x", _tensor_arg(t.name)], ["dims", self.dims(t)]]
        if self.rng.random() < 0.5:
            args.append(["keepdim", True])
        return bool(self.emit("prod", args, bound=max(t.bound, 1.0)))

    def g_full(self):
        shape = [self.rng.choice([1, 2, 3, 4, 5, 6]) for _ in range(self.rng.randint(0, 3))]
        dtype = self.rng.choice(["float32", "float64"])
        value = self.rng.choice([0.0, 1.0, -2.5, 0.125])
        return bool(self.emit("full", [["shape", shape], ["value", value], ["dtype", dtype]], bound=abs(value)))

    def g_opaque(self):
        t = self.pick(float_only=False, pred=lambda t: t.ndim >= 1)
        if t is None:
            return False
        dims = sorted(self.rng.sample(range(t.ndim), self.rng.randint(1, t.ndim)))
        call = json.dumps({"args": [{"tensor": 0}, dims]})  # torch.flip(t, dims): an ATen op with no fusion op
        args = [["a", _tensor_arg(t.name)], ["target", "aten.flip.default"], ["call", call],
                ["shape", list(t.shape)], ["dtype", t.dtype]]
        return bool(self.emit("opaque", args, bound=t.bound))

    def g_opaque_grad(self):
        t = self.pick(pred=lambda t: t.ndim >= 1)
        if t is None:
            return False
        dims = sorted(self.rng.sample(range(t.ndim), self.rng.randint(1, t.ndim)))
        g = self.new_input(t.shape, t.dtype)  # the cotangent of flip(t, dims): its gradient is g flipped back
        call = json.dumps({"args": [{"tensor": 0}, dims]})
        args = [["a", _tensor_arg(t.name)], ["g", _tensor_arg(g.name)], ["target", "aten.flip.default"],
                ["call", call], ["wrt", 0]]
        return bool(self.emit("opaque_grad", args, bound=g.bound))

    def g_dropout(self):
        t = self.pick()
        if t is None:
            return False
        seed = self.new_input((), "int64", data="int", high=2 ** 40)  # a seed input (0-d), as from_torch's rng.seed
        p = self.rng.choice([0.1, 0.5, 0.75])
        args = [["x", _tensor_arg(t.name)], ["seed", _tensor_arg(seed.name)], ["p", p]]
        if self.rng.random() < 0.3:
            args.append(["offset", self.rng.randint(1, 500)])
        return bool(self.emit("dropout", args, bound=t.bound / (1 - p)))

    def g_cumsum(self):
        t = self.pick(pred=lambda t: t.ndim >= 1)
        if t is None:
            return False
        d = self.rng.randrange(t.ndim)
        args = [["x", _tensor_arg(t.name)], ["dim", d - t.ndim if self.rng.random() < 0.3 else d]]
        return bool(self.emit("cumsum", args, bound=t.bound * t.shape[d]))

    # mixture of experts (issue 28 item 4): tokens sorted by expert, counted, a matmul per expert's rows
    def _expert_offsets(self, rows: int, experts: int) -> _T:
        """offsets as transformers computes them: cumsum(histc(ids, experts, 0, experts - 1)) of int ids in
        [0, experts] (an id of `experts` falls outside: rows past offsets[-1]), cast to int64."""
        ids = self.new_input((rows,), "int64", data="int", high=experts + 1)
        f = self.emit("cast", [["x", _tensor_arg(ids.name)], ["dtype", {"dtype": self.dtype}]], bound=experts)[0]
        top = experts - 1 if experts > 1 else 0.5
        counts = self.emit("histc", [["x", _tensor_arg(f.name)], ["bins", experts], ["min", 0], ["max", top]],
                           bound=rows)[0]
        c = self.emit("cumsum", [["x", _tensor_arg(counts.name)], ["dim", 0]], bound=rows)[0]
        return self.emit("cast", [["x", _tensor_arg(c.name)], ["dtype", {"dtype": "int64"}]], bound=rows)[0]

    def g_argsort(self):
        # of integer keys (ties sorted stably; float keys a plan rounds otherwise could swap)
        ids = self.new_input(self.shape(self.rng.choice((1, 2))), "int64", data="int", high=self.rng.randint(2, 5))
        d = self.rng.randrange(len(ids.shape))
        args = [["x", _tensor_arg(ids.name)], ["dim", d - len(ids.shape) if self.rng.random() < 0.3 else d]]
        if self.rng.random() < 0.4:
            args.append(["descending", True])
        return bool(self.emit("argsort", args, bound=1.0))

    def g_histc(self):
        t = self.pick(ndim=(1, 2))
        if t is None:
            return False
        return bool(self.emit("histc", [["x", _tensor_arg(t.name)], ["bins", self.rng.randint(1, 6)],
                                        ["min", -t.bound / 2], ["max", t.bound / 2]], bound=math.prod(t.shape)))

    def g_grouped_mm(self):
        x = self.pick(ndim=2)
        if x is None:
            return False
        experts = self.rng.randint(1, 5)
        w = self.new_input((experts, x.shape[1], self.ext()))
        if self.rng.random() < 0.3:  # transformers' [experts, f, d] weight, transposed
            w = self.new_input((experts, w.shape[2], x.shape[1]))
            w = self.emit("transpose", [["x", _tensor_arg(w.name)], ["dim0", 1], ["dim1", 2]], bound=w.bound)[0]
        off = self._expert_offsets(x.shape[0], experts)
        args = [["x", _tensor_arg(x.name)], ["w", _tensor_arg(w.name)], ["offsets", _tensor_arg(off.name)]]
        return bool(self.emit("grouped_mm", args, bound=x.bound * w.bound * x.shape[1]))

    def g_grouped_mm_wgrad(self):
        x = self.pick(ndim=2)
        if x is None:
            return False
        g = self.new_input((x.shape[0], self.ext()))
        off = self._expert_offsets(x.shape[0], self.rng.randint(1, 5))
        args = [["x", _tensor_arg(x.name)], ["g", _tensor_arg(g.name)], ["offsets", _tensor_arg(off.name)]]
        return bool(self.emit("grouped_mm_wgrad", args, bound=x.bound * g.bound * x.shape[0]))

    def g_broadcast_in_dim(self):
        t = self.pick(float_only=False, pred=lambda t: t.ndim <= 3)
        if t is None:
            return False
        n_out = t.ndim + self.rng.randint(0, 2)
        bdims = sorted(self.rng.sample(range(n_out), t.ndim))
        shape = [self.ext(small=True) for _ in range(n_out)]
        for i, d in enumerate(bdims):
            shape[d] = t.shape[i] if t.shape[i] != 1 or self.rng.random() < 0.5 else shape[d]
        if math.prod(shape) > self.MAX_ELEMS:
            return False
        return bool(self.emit("broadcast_in_dim", [["x", _tensor_arg(t.name)], ["shape", shape],
                                                   ["broadcast_dims", bdims]]))


def _broadcast(a: tuple, b: tuple) -> tuple:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError("no broadcast")
        out.append(max(x, y) if 1 in (x, y) else x)
    return tuple(out)


def _fits_broadcast(a: tuple, b: tuple) -> bool:
    """Whether a and b broadcast together."""
    try:
        _broadcast(a, b)
        return True
    except ValueError:
        return False


def _torch_dtype(name: str):
    import torch
    return getattr(torch, name)


def _decode_literal(v):
    if isinstance(v, dict) and set(v) == {"dtype"}:
        return _torch_dtype(v["dtype"])
    if isinstance(v, list):
        return tuple(v)
    return v


def _ptype(mesh_ndim: int, m: int) -> str:
    return DID[mesh_ndim][m]


MESHES_1D = [[1], [2], [3], [4], [5], [6], [8]]
MESHES_2D = [[2, 2], [2, 3], [3, 2], [4, 1], [1, 4], [2, 1], [2, 4]]
MESHES_3D = [[2, 2, 2], [2, 1, 2], [1, 2, 2], [2, 2, 1]]


def default_ops() -> list[str]:
    """Every op of the op table (the generator has a builder for each; see tests/face/test_fuzz.py).

    >>> "sdpa" in default_ops() and "welford_merge" in default_ops()
    True
    """
    import egraph_did as ed
    return ed.op_names()


# Ops added after seeds were fixed: drawn from a stream of their own (generate_case), so that a case that
# draws none of them is the case the seed gave before they existed
LATE_OPS = ("attention_blocks", "argsort", "histc", "grouped_mm", "grouped_mm_wgrad", "silu_backward")
P_LATE = 0.15


def generate_case(seed: int, index: int, ops: Iterable[str] | None = None, gloo: bool = False,
                  max_ops: int = 6, mesh_ndims: Iterable[int] = (1, 2, 3), exact: bool = True, *,
                  meshes: Iterable[Iterable[int]] | None = None, pin_styles=("outer", "nonouter", "inner-first"),
                  partial_pins: bool = True, empty_shards: bool = True, intermediate_pins: bool = True,
                  memory_bounds: bool = True, multinode: bool = True, float32: bool = True, edges: bool = True,
                  reshards: bool = True) -> dict:
    """The case (plain data) for (seed, index); the same arguments give the same case.

    ops: the op families to draw from (default: every op); gloo: also run it on gloo processes (the
    mesh then has at most 4 ranks); exact: run the exact extractor too. The keyword-only knobs narrow
    what is drawn (a CI slice leaves out what is known broken): meshes (mesh shapes to draw from),
    pin_styles ('outer': outer DID splits; 'nonouter': the axis split in 2 first, the inner half sharded;
    'inner-first': an axis split over two mesh axes with the inner mesh axis outside), partial_pins (P and
    Pmax), empty_shards (splits that leave a rank nothing), intermediate_pins, memory_bounds, multinode
    (the h200_multinode cost model), float32 (else every case is float64), edges (add_edges: reshape chains
    and unread inputs, drawn from a stream of their own: edges=False gives the cases drawn before them),
    reshards (add_reshard: a pinned uneven reshard or size-1 view beside the case, from a stream of its own).

    >>> a, b = generate_case(7, 1), generate_case(7, 1)
    >>> a == b and a["ops"] != generate_case(7, 2)["ops"]
    True
    >>> generate_case(7, 1, ops=["relu"])["ops"][-1]["op"]
    'relu'
    """
    rng = random.Random(f"egraph-did-fuzz:{seed}:{index}")
    ops = sorted(ops) if ops is not None else default_ops()
    main_ops = [o for o in ops if o not in LATE_OPS] or ops
    mesh_ndims = tuple(mesh_ndims)
    dtype = "float64" if rng.random() < 0.55 or not float32 else "float32"

    def draw(gen, op):
        saved = (len(gen.ops), dict(gen.inputs), list(gen.pool), gen.n_in, gen.n_t)
        try:
            gen.gen(op)
        except Exception:  # noqa: BLE001 - an operand the shape rule rejects: draw again
            n, gen.inputs, gen.pool, gen.n_in, gen.n_t = saved
            del gen.ops[n:]
    for _attempt in range(50):
        gen = _Gen(rng, dtype, main_ops)
        n_ops = rng.randint(1, max_ops)
        tries = 0
        while len(gen.ops) < n_ops and tries < 40:
            tries += 1
            draw(gen, rng.choice(main_ops))
        if gen.ops:
            break
    late_ops = [o for o in ops if o not in main_ops]
    late = random.Random(f"egraph-did-fuzz-late:{seed}:{index}")
    if late_ops and late.random() < P_LATE:  # the main stream's draws above and below are unchanged
        gen.rng = late
        draw(gen, late.choice(late_ops))
        gen.rng = rng
    produced = [t for t in gen.pool if not t.is_input]
    used = {v["t"] for o in gen.ops for _, v in o["args"] if _is_tensor_arg(v)}
    sinks = [t.name for t in produced if t.name not in used]
    extra = [t.name for t in produced if t.name in used and rng.random() < 0.15]
    outputs = (sinks + extra)[-4:] or [produced[-1].name]
    # the mesh
    by_ndim = {1: MESHES_1D, 2: MESHES_2D, 3: MESHES_3D}
    if meshes is not None:
        by_ndim = defaultdict(list)
        for m in meshes:
            by_ndim[len(tuple(m))].append(list(m))
    mesh_ndims = [d for d in mesh_ndims if by_ndim.get(d)]
    ndim = rng.choice(mesh_ndims)
    shape = rng.choice(by_ndim[ndim])
    for _ in range(100):
        if not gloo or math.prod(shape) <= 4:
            break
        ndim = rng.choice(mesh_ndims)
        shape = rng.choice(by_ndim[ndim])
    names = None
    if ndim > 1 and rng.random() < 0.5:
        names = {2: ["dp", "tp"], 3: ["pp", "dp", "tp"]}[ndim]
    spec = {"seed": seed, "index": index, "dtype": dtype, "mesh": list(shape), "axis_names": names,
            "inputs": gen.inputs, "ops": gen.ops, "outputs": outputs, "pins": {},
            "cost": {"preset": "h200", "memory_frac": None}, "extractors": ["greedy"] + (["exact"] if exact else []),
            "gloo": gloo}
    spec = prune(spec)
    # the cost model
    if rng.random() < 0.25 and (ndim == 2 or rng.random() < 0.05) and multinode:
        spec["cost"]["preset"] = "h200_multinode"
    if rng.random() < 0.2 and memory_bounds:
        spec["cost"]["memory_frac"] = rng.choice([0.3, 0.5, 0.7, 0.9, 1.0])
    # pins
    shapes = infer_shapes(spec) or {}
    for name, (tshape, tdtype) in shapes.items():
        is_in, is_out = name in spec["inputs"], name in spec["outputs"]
        p = 0.5 if is_in or is_out else (0.1 if intermediate_pins else 0.0)
        if rng.random() >= p:
            continue
        pin = _random_pin(rng, tshape, shape, partial_ok=partial_pins and (not is_in or rng.random() < 0.2),
                          empty_ok=empty_shards)
        if pin["style"] not in pin_styles:
            pin["style"] = "outer"
        spec["pins"][name] = pin
    if edges:
        spec = add_edges(spec, random.Random(f"egraph-did-fuzz-edges:{seed}:{index}"),
                         pins=intermediate_pins, pin_styles=pin_styles)
    if reshards and empty_shards:
        spec = add_reshard(spec, random.Random(f"egraph-did-fuzz-reshard:{seed}:{index}"))
    return spec


def add_reshard(spec: dict, rng: random.Random, p: float = 0.25) -> dict:
    """Issue 29 item 4 added to a case, with probability p: beside its program, a new input r0 pinned split
    on one mesh axis of size d >= 2 and an output r1 pinned on the same mesh axis, the extents mostly uneven
    with a rank left empty (5 over 4: 2, 2, 1, 0). Either an elementwise op between splits of two axes
    (r0 S(a) -> r1 S(b): one alltoall, DTensor's redistribute) or a view that keeps or drops a size-1
    leading axis ([1, n] S(1) <-> [n] S(0): no communication). spec["reshard"] states the collectives the
    plan must run on r0 and r1 (the optimize check), while the case still holds the probe as drawn.

    >>> spec = add_reshard(generate_case(0, 0, ops=["relu"], reshards=False) | {"mesh": [4]}, random.Random(1), p=1.0)
    >>> spec["reshard"]["collectives"], spec["pins"]["r0"]["pl"], spec["inputs"]["r0"]["shape"]  # 3, 3, 3, 1 -> 1, 1, 0, 0
    (['alltoall'], ['S0'], [10, 2])
    """
    spec = copy.deepcopy(spec)
    axes = [m for m, size in enumerate(spec["mesh"]) if size >= 2]
    if rng.random() >= p or not axes or {"r0", "r1"} & (set(spec["inputs"]) | set(spec.get("pins", {}))):
        return spec
    m = rng.choice(axes)
    d = spec["mesh"][m]
    empty = [n for n in range(1, 3 * d) if n % d and -(-n // d) * (d - 1) >= n]  # some rank holds nothing
    uneven = [n for n in range(d + 1, 3 * d) if n % d and n not in empty]

    def extent():
        return rng.choice(empty if empty and (rng.random() < 0.75 or not uneven) else uneven)

    def pin(a):
        return {"pl": [f"S{a}" if k == m else "R" for k in range(len(spec["mesh"]))], "style": "outer"}
    if rng.random() < 0.6:  # r0 S(a) -> r1 S(b): one alltoall
        shape = [extent() for _ in range(rng.choice([2, 2, 3]))]
        a, b = rng.sample(range(len(shape)), 2)
        op = {"op": rng.choice(["relu", "neg", "abs"]), "args": [["x", _tensor_arg("r0")]], "outs": ["r1"]}
        pins, want = {"r0": pin(a), "r1": pin(b)}, ["alltoall"]
    else:  # [1, n, ...] S(1) <-> [n, ...] S(0): a view every rank computes on its own shard
        inner = [extent()] + ([rng.randint(2, 3)] if rng.random() < 0.3 else [])
        drop = rng.random() < 0.6  # [1, n, ...] -> [n, ...], else [n, ...] -> [1, n, ...]; n itself may be 1
        shape, target = ([1] + inner, inner) if drop else (inner, [1] + inner)
        op = {"op": "reshape", "args": [["x", _tensor_arg("r0")], ["shape", list(target)]], "outs": ["r1"]}
        pins, want = {"r0": pin(int(drop)), "r1": pin(int(not drop))}, []
    spec["inputs"]["r0"] = {"shape": shape, "dtype": spec["dtype"], "data": "randn"}
    spec["ops"].append(op)
    spec["outputs"].append("r1")
    spec["pins"].update(pins)
    # copies: a minimizer's edit of the case (extents, pins) must not edit the probe it is checked against
    spec["reshard"] = copy.deepcopy({"op": op, "pins": pins, "mesh": spec["mesh"], "shape": shape,
                                     "collectives": want})
    return spec


def reshard_intact(spec: dict) -> bool:
    """Whether the case still holds its reshard probe as drawn (the minimizer may cut or change it).

    >>> reshard_intact({"mesh": [4]}), reshard_intact(add_reshard({"mesh": [4], "dtype": "float64", "inputs": {},
    ...     "ops": [], "outputs": [], "pins": {}}, random.Random(0), p=1.0))
    (False, True)
    """
    probe = spec.get("reshard")
    return bool(probe) and probe["op"] in spec["ops"] and spec["mesh"] == probe["mesh"] and "r1" in spec["outputs"] \
        and spec["inputs"].get("r0", {}).get("shape") == probe["shape"] \
        and all(spec["pins"].get(k) == v for k, v in probe["pins"].items())


def add_edges(spec: dict, rng: random.Random, pins: bool = True, pin_styles=("outer", "nonouter", "inner-first"),
              p_chain: float = 0.3, p_unread: float = 0.3, p_ignore: float = 0.4) -> dict:
    """Issue 29's edges added to a case: with probability p_chain a reshape chain on one of its tensors (merge
    every axis, split, merge and split again: equal terms the e-graph shares one value between), its last
    tensor an output and each other one an output with probability 0.4, each pinned with probability 0.3
    (view pins among them); with probability p_unread an input no output reads ("unread": prune keeps it;
    evaluate, simulate and plan.run must take it and ignore it, and the plan list it in plan.unread); with
    probability p_ignore each cross_entropy of 3 classes or more ignores one of them (ignore_index).

    >>> spec = generate_case(0, 0, ops=["relu"], edges=False)
    >>> edged = add_edges(spec, random.Random(0), p_chain=1.0, p_unread=1.0)
    >>> [o["op"] for o in edged["ops"][len(spec["ops"]):]][:2], edged["inputs"]["u0"]["unread"]
    (['reshape', 'reshape'], True)
    """
    spec = copy.deepcopy(spec)
    shapes = infer_shapes(spec) or {}
    if rng.random() < p_chain:
        cands = [n for n, (sh, dt) in shapes.items() if math.prod(sh) >= 4 and dt in FLOATS]
        if cands:
            src = rng.choice(cands)
            own, n = list(shapes[src][0]), math.prod(shapes[src][0])
            divs = [f for f in range(2, n) if n % f == 0] or [1]

            def split():
                f = rng.choice(divs)
                return [f, n // f] if rng.random() < 0.7 or len(divs) < 2 else [f, 1, n // f]
            prev, made = src, []
            for i in range(rng.randint(2, 4)):
                target = [n] if i % 2 == 0 else (own if rng.random() < 0.3 else split())
                name = f"c{i}"
                spec["ops"].append({"op": "reshape", "args": [["x", _tensor_arg(prev)], ["shape", list(target)]],
                                    "outs": [name]})
                made.append((name, tuple(target)))
                prev = name
            spec["outputs"] += [m for m, _ in made[:-1] if rng.random() < 0.4] + [made[-1][0]]
            for name, shape in made:
                if pins and rng.random() < 0.3:
                    pin = _random_pin(rng, shape, spec["mesh"], partial_ok=False, empty_ok=False)
                    spec["pins"][name] = pin if pin["style"] in pin_styles else dict(pin, style="outer")
    if rng.random() < p_unread:
        shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 2))]
        spec["inputs"]["u0"] = {"shape": shape, "dtype": spec["dtype"], "data": "randn", "unread": True}
        if pins and rng.random() < 0.3:
            pin = _random_pin(rng, tuple(shape), spec["mesh"], partial_ok=False, empty_ok=False)
            spec["pins"]["u0"] = pin if pin["style"] in pin_styles else dict(pin, style="outer")
    for op in spec["ops"]:  # drawn last: the draws above, and so every case without a cross_entropy, stay
        if op["op"] == "cross_entropy" and rng.random() < p_ignore:
            logits = dict(op["args"])["logits"]["t"]
            classes = shapes[logits][0][1] if logits in shapes else 0
            if classes >= 3:  # a class the targets hold: its rows count 0, a mean is over the others
                op["args"].append(["ignore_index", rng.randrange(classes)])
    return spec


def _random_pin(rng: random.Random, tshape: tuple, mesh: list, partial_ok: bool, empty_ok: bool = True) -> dict:
    """Per mesh axis R, S<a>, P or M (pending max); a style for the split axes."""
    pl = []
    for size in mesh:
        r = rng.random()
        if r < 0.4 or not tshape or (size == 1 and rng.random() < 0.9):
            pl.append("P" if tshape == () and partial_ok and r < 0.1 else "R")
        elif r < 0.88 or not partial_ok:
            fits = [a for a, e in enumerate(tshape) if e >= size]
            a = rng.choice(fits) if fits and rng.random() < 0.85 else rng.randrange(len(tshape))
            pl.append(f"S{a}")
        elif rng.random() < 0.5:
            pl.append("P" if rng.random() < 0.8 else "M")
        else:
            pl.append("R")
    # mostly splits that leave no rank empty (torch.chunk of n over k ways: ceil(n/k) * (k-1) < n)
    for a in range(len(tshape)):
        ways = math.prod(size for size, p in zip(mesh, pl) if p == f"S{a}")
        if ways > 1 and -(-tshape[a] // ways) * (ways - 1) >= tshape[a] and (rng.random() < 0.93 or not empty_ok):
            pl = ["R" if p == f"S{a}" else p for p in pl]
    style = "outer"
    r = rng.random()
    if r < 0.06:
        style = "nonouter"  # a merged gate/up weight: split the axis in 2, shard the inner half
    elif r < 0.16:
        style = "inner-first"  # two mesh axes on one tensor axis, the inner mesh axis outside
    return {"pl": pl, "style": style}


# =========================================================================== plain-data helpers

def infer_shapes(spec: dict) -> dict[str, tuple[tuple, str]] | None:
    """{tensor: (shape, dtype)} of every tensor of the case, through the op table's shape rules; None
    when some op rejects its operands (an invalid candidate while minimizing).

    >>> spec = generate_case(0, 0, ops=["relu"])
    >>> all(isinstance(s, tuple) for s, _ in infer_shapes(spec).values())
    True
    """
    from egraph_did.ops import OPS, TensorSpec

    env = {n: (tuple(s["shape"]), s["dtype"]) for n, s in spec["inputs"].items()}
    try:
        for o in spec["ops"]:
            def conv(v):
                if _is_tensor_arg(v):
                    shape, dt = env[v["t"]]
                    return TensorSpec(v["t"], shape, _torch_dtype(dt), tuple(f"a{i}" for i in range(len(shape))))
                return _decode_literal(v)
            outs = OPS[o["op"]].infer(**{k: conv(v) for k, v in o["args"]})
            for name, out in zip(o["outs"], outs):
                env[name] = (tuple(out.shape), str(out.dtype).replace("torch.", ""))
    except Exception:  # noqa: BLE001
        return None
    for name, s in spec["inputs"].items():
        if "high" in s and isinstance(s["high"], list):
            ref, axis = s["high"]
            if ref not in env or axis >= len(env[ref][0]) or env[ref][0][axis] < 1:
                return None
    return env


def prune(spec: dict) -> dict:
    """Drop ops no output needs, inputs no op reads (but those drawn "unread"), pins on tensors that are gone."""
    spec = copy.deepcopy(spec)
    need = set(spec["outputs"])
    keep = []
    for o in reversed(spec["ops"]):
        if need & set(o["outs"]):
            keep.append(o)
            need |= {v["t"] for _, v in o["args"] if _is_tensor_arg(v)}
    spec["ops"] = list(reversed(keep))
    for s in spec["inputs"].values():  # an index input's range follows a tensor: keep that tensor
        if "high" in s and isinstance(s["high"], list):
            pass
    used = {v["t"] for o in spec["ops"] for _, v in o["args"] if _is_tensor_arg(v)} | set(spec["outputs"])
    spec["inputs"] = {n: s for n, s in spec["inputs"].items() if n in used or s.get("unread")}
    alive = set(spec["inputs"]) | {n for o in spec["ops"] for n in o["outs"]}
    # an int input whose range refers to a tensor that is gone: take the range it had
    for n, s in spec["inputs"].items():
        if isinstance(s.get("high"), list) and s["high"][0] not in alive:
            s["high"] = s.get("high_value", 2)
    spec["pins"] = {n: p for n, p in spec["pins"].items() if n in alive}
    spec["outputs"] = [n for n in spec["outputs"] if n in alive and n not in spec["inputs"]]
    return spec


def case_size(spec: dict) -> tuple:
    """(ops, outputs, pins, mesh ranks, input elements): what the minimizer shrinks."""
    return (len(spec["ops"]), len(spec["outputs"]), len(spec["pins"]), math.prod(spec["mesh"]),
            sum(math.prod(s["shape"]) for s in spec["inputs"].values()))


# =========================================================================== rendering a case as Python

def _lit(v) -> str:
    if _is_tensor_arg(v):
        return v["t"]
    if isinstance(v, dict) and set(v) == {"dtype"}:
        return f"torch.{v['dtype']}"
    if isinstance(v, list):
        return "(" + ", ".join(_lit(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def _mesh_source(spec: dict) -> str:
    shape = spec["mesh"]
    if len(shape) == 1:
        return f"ed.DeviceMesh.arange({shape[0]})"
    names = f", axis_names={tuple(spec['axis_names'])!r}" if spec.get("axis_names") else ""
    return f"ed.DeviceMesh(torch.arange({math.prod(shape)}).reshape{tuple(shape)!r}{names})"


def pin_source(var: str, pin: dict, mesh: list) -> str:
    """One pin as a chain of loop-domain calls on the TensorView `var`.

    >>> pin_source("w", {"pl": ["S0", "R"], "style": "outer"}, [2, 3])
    'w.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, DIDy)'
    >>> pin_source("w", {"pl": ["S1"], "style": "nonouter"}, [4])
    'w.set_device_mesh(mesh).split(1, 2, inner_split=False).outer_split(2, 4).parallelize(2, DIDx)'
    >>> pin_source("y", {"pl": ["P", "S0"], "style": "outer"}, [2, 2])
    'y.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, DIDx).add_partial(DIDy)'
    """
    nd = len(mesh)
    calls = [f"{var}.set_device_mesh(mesh)"]
    by_axis: dict[int, list[int]] = defaultdict(list)
    for m, p in enumerate(pin["pl"]):
        if p.startswith("S"):
            by_axis[int(p[1:])].append(m)
    for a in sorted(by_axis, reverse=True):  # right to left: earlier loop positions stay put
        ms = by_axis[a]
        if pin.get("style") == "inner-first" and len(ms) > 1:
            ms = list(reversed(ms))
        pos = a
        if pin.get("style") == "nonouter":
            calls.append(f"split({pos}, 2, inner_split=False)")
            pos += 1
        for m in ms:
            calls.append(f"outer_split({pos}, {mesh[m]})")
            calls.append(f"parallelize({pos}, {_ptype(nd, m)})")
            pos += 1
    for m, p in enumerate(pin["pl"]):
        if p == "P":
            calls.append(f"add_partial({_ptype(nd, m)})")
        elif p == "M":
            calls.append(f"add_partial({_ptype(nd, m)}, 'max')")
    return ".".join(calls)


def _input_source(name: str, s: dict) -> str:
    shape = tuple(s["shape"])
    dt = f"torch.{s['dtype']}"
    if s["data"] == "int":
        high = s["high"]
        high = f"{high[0]}.shape[{high[1]}]" if isinstance(high, list) else str(high)
        return f"torch.randint(0, {high}, {shape!r}, generator=g).to({dt})"
    base = f"torch.randn({shape!r}, generator=g, dtype=torch.float64)"
    if s["data"] == "pos":
        base = f"({base}.abs() + 0.5)"
    elif s["data"] == "small":
        base = f"(torch.rand({shape!r}, generator=g, dtype=torch.float64) * 4 - 2)"
    return f"{base}.to({dt})"


def case_source(spec: dict, memory_limit: float | None = None) -> str:
    """The case as a Python script: mesh, fusion, pins, cost model, inputs (names fd, mesh, cost_model,
    inputs), exactly what the fuzzer runs.

    >>> src = case_source(generate_case(0, 0, ops=["exp"]))
    >>> ns = {}; exec(src, ns); sorted(k for k in ("fd", "mesh", "cost_model", "inputs") if k in ns)
    ['cost_model', 'fd', 'inputs', 'mesh']
    """
    return "\n".join(_source_parts(spec, memory_limit))


def reference64(spec: dict, inputs: dict, ed):
    """The case's fusion evaluated with its float inputs (and float16/bfloat16/float32 tensors) in float64, on
    the same values upcast: integer and bool outputs that differ from the case's own reference are decided
    by rounding, not by the program (seed 35 case 8279: logical_and of a layer_norm's row sums, which are
    0 in exact arithmetic and +-1e-7 by summation order), so no plan can be held to them.

    >>> import torch, egraph_did as ed
    >>> spec = {"seed": 0, "index": 0, "dtype": "float32", "mesh": [1], "axis_names": None,
    ...         "inputs": {"x": {"shape": [2], "dtype": "float32", "data": "randn"}},
    ...         "ops": [{"op": "neg", "args": [["x", {"t": "x"}]], "outs": ["t0"]}], "outputs": ["t0"], "pins": {},
    ...         "cost": {"preset": "h200", "memory_frac": None}, "extractors": ["greedy"], "gloo": False}
    >>> reference64(spec, {"x": torch.tensor([1.0, 2.0])}, ed)["t0"].dtype
    torch.float64
    """
    wide = copy.deepcopy(spec)
    for inp in wide["inputs"].values():
        if inp["dtype"] in ("float16", "bfloat16", "float32"):
            inp["dtype"] = "float64"
    head, build = _source_parts(wide)[:2]
    ns: dict[str, Any] = {}
    exec(compile(head + "\n" + build, "<fuzz case, float64>", "exec"), ns)
    return ed.evaluate(ns["fd"], {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()})


def compare_outputs(out: dict, ref: dict, tol: float, ref64=None) -> dict[str, str]:
    """{output: what differs} over ref's outputs (compare); an integer or bool output that differs only where
    ref64() (reference64, computed once on demand) disagrees with ref is decided by rounding and passes, and a
    float output within tolerance of ref64() passes where ref's own rounding is what differs (seed 49 case 8629:
    rms_norm over one element of gelu(-3.48) = -8.7e-4, where float32 gelu's cancellation, amplified by the
    norm, puts torch's float32 reference 8.0e-4 from float64's and the plan's kernel 1.9e-5).

    >>> import torch
    >>> ref = {"b": torch.tensor([True, False])}
    >>> compare_outputs({"b": torch.tensor([True, True])}, ref, 1e-6, lambda: {"b": torch.tensor([True, True])})
    {}
    >>> compare_outputs({"b": torch.tensor([False, False])}, ref, 1e-6, lambda: {"b": torch.tensor([True, True])})
    {'b': 'integer/bool values differ at (0,): got False, want True'}
    >>> wide = lambda: {"y": torch.tensor([1.0, -1.29259], dtype=torch.float64)}
    >>> ref = {"y": torch.tensor([1.0, -1.29339])}
    >>> compare_outputs({"y": torch.tensor([1.0, -1.29261])}, ref, 2e-4, wide)  # ref is off, the output is not
    {}
    >>> list(compare_outputs({"y": torch.tensor([1.0, -1.29400])}, ref, 2e-4, wide))  # both off: a mismatch
    ['y']
    """
    import torch

    bad = {}
    for k, want in ref.items():
        why = compare(out.get(k), want, tol)
        if why and ref64 is not None and not want.is_floating_point() and why.startswith("integer/bool"):
            steady = ref64()[k].to(want.dtype) == want  # entries the precision does not decide
            if bool((out[k][steady] == want[steady]).all()):
                why = None
        elif why and ref64 is not None and want.is_floating_point() and isinstance(out.get(k), torch.Tensor):
            if compare(out[k], ref64()[k].to(want.dtype), tol) is None:
                why = None
        if why:
            bad[k] = why
    return bad


def _source_parts(spec: dict, memory_limit: float | None = None) -> list[str]:
    head = ['import os', 'os.environ.setdefault("TRITON_INTERPRET", "1")', "import torch",
            "import egraph_did as ed", "DIDx, DIDy, DIDz = ed.ParallelType.DIDx, ed.ParallelType.DIDy, "
            "ed.ParallelType.DIDz", "", f"mesh = {_mesh_source(spec)}"]
    build = ["with ed.FusionDefinition() as fd:"]
    for name, s in spec["inputs"].items():
        build.append(f"    {name} = fd.define_tensor({tuple(s['shape'])!r}, torch.{s['dtype']}, name={name!r})")
    for o in spec["ops"]:
        args = []
        for k, v in o["args"]:
            args.append(f"{k}={_lit(v)}")
        lhs = ", ".join(o["outs"]) if len(o["outs"]) > 1 else o["outs"][0]
        if o["op"] in ("var_mean", "welford_merge") and len(o["outs"]) == 2:
            lhs = ", ".join(o["outs"])
        build.append(f"    {lhs} = fd.ops.{o['op']}({', '.join(args)})")
    for n in spec["outputs"]:
        build.append(f"    fd.add_output({n}, name={n!r})")
    pins = [pin_source(n, p, spec["mesh"]) for n, p in spec["pins"].items()]
    preset = spec["cost"]["preset"]
    frac = spec["cost"].get("memory_frac")
    if frac is not None and memory_limit is not None:
        cost = [f"cost_model = ed.CostModel.{preset}(memory_limit={memory_limit!r})"
                f"  # {frac} x the unbounded plan's memory"]
    else:
        cost = [f"cost_model = ed.CostModel.{preset}()"]
    inputs = ["g = torch.Generator().manual_seed(0)", "inputs = {"]
    for name, s in spec["inputs"].items():
        inputs.append(f"    {name!r}: {_input_source(name, s)},")
    inputs.append("}")
    return ["\n".join(head), "\n".join(build), "\n".join(pins), "\n".join(cost), "\n".join(inputs)]


# =========================================================================== running one case

class _Fail(Exception):
    pass


def _project_frame(tb) -> str:
    """'file:function' of the innermost frame in egraph_did/, rewrites/ or lowering/."""
    where = ""
    for fr in traceback.extract_tb(tb):
        parts = fr.filename.replace("\\", "/").split("/")
        if any(d in parts for d in PROJECT_DIRS) and "bench" not in parts and "<fuzz" not in fr.filename:
            where = f"{parts[-1]}:{fr.name}"
    return where or "outside the project"


def _crash_class(check: str, e: BaseException) -> str:
    return f"{check}-crash: {type(e).__name__} in {_project_frame(e.__traceback__)}"


def _names_a_tensor(msg: str, names: Iterable[str]) -> bool:
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", msg))
    return bool(words & set(names)) or bool(re.search(r"\b[a-z_]+_\d+\b", msg))


def _tolerance(dtypes: Iterable[str]) -> float:
    ds = set(dtypes)
    if "bfloat16" in ds:
        return 5e-2
    if "float16" in ds:
        return 1e-2
    if "float32" in ds:
        return 2e-4
    return 1e-6


def compare(got, want, tol: float) -> str | None:
    """None when got matches want (tol relative to the larger of 1 and want's largest finite entry,
    plus tol relative per entry; nan and inf where want has them), else what differs.

    >>> import torch
    >>> compare(torch.ones(3), torch.ones(3) + 1e-9, 1e-6) is None
    True
    >>> compare(torch.ones(3), 3 * torch.ones(3), 1e-6)
    'max abs error 2 at (0,) (got 1, want 3), scale 3'
    """
    import torch

    if not isinstance(got, torch.Tensor):
        return f"got a {type(got).__name__}, want a tensor"
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return f"got shape {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    if not want.is_floating_point():
        if torch.equal(got, want):
            return None
        idx = (got != want).nonzero()[0].tolist()
        return f"integer/bool values differ at {tuple(idx)}: got {got[tuple(idx)].item()}, want {want[tuple(idx)].item()}"
    g, w = got.double(), want.double()
    if g.numel() == 0:
        return None
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        idx = (nan_g != nan_w).nonzero()[0].tolist()
        return f"nan where want has none (or the reverse) at {tuple(idx)}: got {g[tuple(idx)].item():.6g}, " \
               f"want {w[tuple(idx)].item():.6g}"
    inf_w = torch.isinf(w)
    if not torch.equal(g[inf_w], w[inf_w]) or torch.isinf(g[~inf_w]).any():
        return "inf where want has none (or the reverse)"
    fin = ~(nan_w | inf_w)
    if not fin.any():
        return None
    scale = max(1.0, w[fin].abs().max().item())
    err = (g - w).abs().where(fin, torch.zeros_like(g))
    bad = err > tol * scale + tol * w.abs().where(fin, torch.zeros_like(w))
    if not bad.any():
        return None
    idx = tuple(int(i) for i in (err == err.max()).nonzero()[0].tolist())
    return (f"max abs error {err.max().item():.3g} at {idx} (got {g[idx].item():.6g}, want {w[idx].item():.6g}), "
            f"scale {scale:.3g}")


def _gloo_work(rank, plan_json, inputs):
    """One gloo rank: load the plan and run it with global inputs and outputs."""
    import egraph_did as ed
    return ed.Plan.from_json(plan_json).run(inputs, inputs="global", outputs="global")


def run_case(spec: dict, checks: Iterable[str] | None = None, stop_on: str | None = None,
             stage: Callable[[str], None] = lambda s: None) -> dict:
    """Run one case in this process: {'failures': [{'cls', 'detail', 'extractor'}], 'refusal': message or
    None, 'gap': greedy/exact - 1 or None, 'memory_limit', 'times', 'plans'}.

    checks: the subset of CHECKS to run (None: all); stop_on: return at the first failure of this class.

    >>> res = run_case(generate_case(0, 0, ops=["relu"], exact=False))
    >>> res["failures"], res["refusal"]
    ([], None)
    """
    import torch

    import egraph_did as ed

    checks = set(CHECKS if checks is None else checks)
    if spec.get("_inject") == "hang":  # tests of the fuzzer itself: a case that never returns
        stage("build")
        time.sleep(1e6)
    if spec.get("_inject") == "die":  # ... and one whose process dies
        stage("build")
        os._exit(3)
    res: dict[str, Any] = {"failures": [], "refusal": None, "gap": None, "memory_limit": None, "times": {},
                           "plans": {}, "methods": {}}

    def fail(cls, detail, extractor=None):
        res["failures"].append({"cls": cls, "detail": str(detail)[:2000], "extractor": extractor})
        if stop_on is not None and cls == stop_on:
            raise _Fail()

    def timed(key, fn):
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            res["times"][key] = res["times"].get(key, 0.0) + time.perf_counter() - t0

    try:
        _run_checks(spec, checks, res, fail, timed, stage, torch, ed)
    except _Fail:
        pass
    return res


def _run_checks(spec, checks, res, fail, timed, stage, torch, ed):
    head, build, pins, cost, inputs_src = _source_parts(spec)
    ns: dict[str, Any] = {}
    stage("build")
    try:
        exec(compile(head + "\n" + build, "<fuzz case>", "exec"), ns)
    except Exception as e:  # noqa: BLE001
        fail(_crash_class("build", e) if not isinstance(e, ed.EgraphDidError) else
             f"build-error: {type(e).__name__}", f"{type(e).__name__}: {e}")
        return
    fd, mesh = ns["fd"], ns["mesh"]
    try:
        exec(compile(pins, "<fuzz pins>", "exec"), ns)
    except ed.EgraphDidError as e:
        res["refusal"] = f"pin: {e}"
        if not _names_a_tensor(str(e), fd.fusion.tensors):
            fail(f"pin-error-unnamed: {type(e).__name__}", str(e))
        return
    except Exception as e:  # noqa: BLE001
        fail(_crash_class("pin", e), f"{type(e).__name__}: {e}")
        return
    exec(compile(inputs_src, "<fuzz inputs>", "exec"), ns)
    inputs = ns["inputs"]
    tol = _tolerance([str(t.dtype).replace("torch.", "") for t in fd.fusion.tensors.values()])
    stage("evaluate")
    try:
        ref = timed("evaluate", lambda: ed.evaluate(fd, inputs))
    except Exception as e:  # noqa: BLE001
        fail(_crash_class("evaluate", e), f"{type(e).__name__}: {e}")
        return
    unread = sorted(n for n, s in spec["inputs"].items() if s.get("unread"))
    if unread:  # an input no output reads may be left out (issue 29): the same outputs, bit for bit
        try:
            read_only = ed.evaluate(fd, {k: v for k, v in inputs.items() if k not in unread})
            diff = [k for k in ref if not _bit_equal(read_only.get(k), ref[k])]
            if diff:
                fail("evaluate-unread-input-changes-outputs", f"outputs {diff} differ without {unread}")
        except Exception as e:  # noqa: BLE001
            fail(_crash_class("evaluate-without-unread", e), f"{type(e).__name__}: {e}")
    # on the first integer/bool mismatch only (compare_outputs), once
    ref64 = functools.cache(lambda: reference64(spec, inputs, ed))
    # the cost model, with the memory bound a fraction of the unbounded greedy plan's memory
    exec(compile(cost, "<fuzz cost>", "exec"), ns)
    cm = ns["cost_model"]
    names = set(fd.fusion.tensors)
    frac = spec["cost"].get("memory_frac")
    pinned = {n: ns[n] for n in spec["pins"]}  # TensorViews, named as the fusion names them now
    if frac is not None:
        try:
            free = ed.optimize(fd, mesh, cost_model=cm)
            res["memory_limit"] = float(frac * free.memory) if free.memory > 0 else 1.0
            exec(compile(f"cost_model = ed.CostModel.{spec['cost']['preset']}(memory_limit="
                         f"{res['memory_limit']!r})", "<fuzz cost>", "exec"), ns)
            cm = ns["cost_model"]
        except Exception:  # noqa: BLE001 - the unbounded plan fails: the bounded run says how
            cm = ns["cost_model"]
    plans = {}
    errors = {}
    for ex in spec["extractors"]:
        if ex == "exact" and not ({"exact", "lowered", "eager", "json", "pins", "memory", "size1"} & checks):
            continue
        stage(f"optimize-{ex}")
        t0 = time.perf_counter()
        try:
            limit = spec.get("exact_time_limit") if ex == "exact" else None
            plans[ex] = ed.optimize(fd, mesh, cost_model=cm, extractor=ex, **({"time_limit": limit} if limit else {}))
            res["methods"][ex] = getattr(plans[ex], "method", "")
        except ed.EgraphDidError as e:
            errors[ex] = e
            msg = str(e)
            res["refusal"] = res["refusal"] or f"optimize: {type(e).__name__}: {msg}"
            # an error about no tensor must say which argument is wrong: the mesh, the cost model or its bound
            about_args = re.search(r"\b(mesh|cost model|memory bound)\b", msg, re.I) is not None
            if "optimize" in checks and not (_names_a_tensor(msg, names) or about_args):
                fail(f"optimize-error-unnamed: {type(e).__name__}", msg, ex)
            if "optimize" in checks and len(re.findall(r"\b0\.00 GiB", msg)) >= 2:
                fail("optimize-error-unreadable: both sizes print as 0.00 GiB", msg, ex)
            if "memory" in checks and frac is not None and frac >= 1 and res["memory_limit"] and "memory" in msg:
                fail("memory-bound-refused-though-the-unbounded-plan-fits",
                     f"bound {res['memory_limit']:.0f} B = the unbounded greedy plan's memory; {msg}", ex)
        except Exception as e:  # noqa: BLE001
            errors[ex] = e
            if "optimize" in checks:
                fail(_crash_class("optimize", e), f"{type(e).__name__}: {e}\n{_short_tb(e)}", ex)
        res["times"][f"optimize_{ex}"] = time.perf_counter() - t0
    # the default 60 s limit reached is a finding; a campaign that sets a shorter limit (the CI slice) accepts
    # an unproven exact plan, which is still checked against greedy below
    if "exact" in plans and not spec.get("exact_time_limit") and res["times"].get("optimize_exact", 0) > 50:
        if "exact" in checks:
            fail("exact-hit-time-limit", f"exact took {res['times']['optimize_exact']:.0f} s; method "
                                          f"{res['methods'].get('exact')!r}", "exact")
    def fits(p):
        return cm.memory_limit is None or p.memory <= cm.memory_limit * (1 + 1e-9)
    if "greedy" in plans and "exact" in plans and fits(plans["greedy"]) and fits(plans["exact"]):
        g, x = plans["greedy"].predicted_time, plans["exact"].predicted_time
        res["gap"] = g / x - 1 if x > 0 else 0.0
        limit = spec.get("gap_limit")
        if "exact" in checks and limit is not None and res["gap"] > limit:
            fail(f"greedy-over-{limit:.0%}-worse-than-exact", f"greedy {g * 1e6:.3f} us vs exact {x * 1e6:.3f} us "
                 f"({res['gap']:+.1%})", "greedy")
        if "exact" in checks and x > g * (1 + 1e-9) + 1e-15:
            fail("exact-worse-than-greedy", f"exact {x * 1e6:.3f} us > greedy {g * 1e6:.3f} us "
                                            f"({x / g - 1:+.1%}); method {res['methods'].get('exact')!r}", "exact")
    for a, b in (("greedy", "exact"), ("exact", "greedy")):
        if a in plans and fits(plans[a]) and b in errors and isinstance(errors[b], ed.EgraphDidError) and "exact" in checks:
            fail(f"{b}-refuses-where-{a}-plans", f"{type(errors[b]).__name__}: {errors[b]}", b)
    res["plans"] = {ex: p.to_json() for ex, p in plans.items()}
    seen_steps = {}
    for ex, plan in plans.items():
        key = json.dumps([str(s) for s in plan.steps])
        duplicate = key in seen_steps
        seen_steps[key] = ex
        if "memory" in checks and cm.memory_limit is not None and plan.memory > cm.memory_limit * (1 + 1e-9):
            fail("memory-bound-exceeded", f"plan memory {plan.memory:.0f} B > bound {cm.memory_limit:.0f} B", ex)
        if "size1" in checks:
            bad = [c for c in plan.collectives if mesh.shape[c.mesh_axis] == 1]
            if bad:
                fail("collective-on-size-1-mesh-axis", "; ".join(map(str, bad)), ex)  # as explain names them
        if "optimize" in checks and reshard_intact(spec):  # issue 29: alltoall, or nothing, as DTensor does
            got = [c.kind for c in plan.collectives if c.tensor in ("r0", "r1")]
            if got != spec["reshard"]["collectives"]:
                fail("optimize-reshard-moves-more-than-needed", f"r0 {spec['inputs']['r0']['shape']} pinned "
                     f"{spec['pins']['r0']['pl']} -> r1 pinned {spec['pins']['r1']['pl']} ({spec['reshard']['op']['op']}) "
                     f"on mesh {spec['mesh']}: collectives {got}, want {spec['reshard']['collectives']}", ex)
        if "optimize" in checks and sorted(plan.unread) != sorted(fd.fusion.unread_inputs()):
            fail("optimize-unread-misreported", f"plan.unread {plan.unread}, the fusion's unread inputs "
                                                f"{fd.fusion.unread_inputs()}", ex)
        if "pins" in checks:  # what the plan reports of each output: its loop domain and the explanation
            stage(f"report-{ex}")
            try:
                for o in fd.fusion.outputs:
                    plan.loop_domain(o)
                plan.explain()
            except Exception as e:  # noqa: BLE001
                fail("pins-report-fails", f"{type(e).__name__}: {e}\n{_short_tb(e)}", ex)
        if "pins" in checks:
            stage(f"pins-{ex}")
            for sname, tv in pinned.items():
                try:
                    got = plan.loop_domain(tv.name)
                except Exception as e:  # noqa: BLE001
                    fail("pins-missing-from-plan", f"{tv.name} (pinned {tv.loop_str()}): "
                                                   f"{type(e).__name__}: {e}", ex)
                    continue
                if got != tv.loop_str():
                    same = _same_sharding(plan, tv, mesh)
                    fail("pins-not-honoured" if not same else "pins-reported-differently",
                         f"{tv.name}: pinned {tv.loop_str()}, plan.loop_domain gives {got}", ex)
        if duplicate:
            continue  # the same steps as the greedy plan: simulated already
        lowered, eager_failed = None, False
        for mode in ("eager", "lowered"):
            if mode not in checks and not (mode == "lowered" and "json" in checks):
                continue
            stage(f"simulate-{mode}-{ex}")
            try:
                out = timed(f"simulate_{mode}", lambda: ed.simulate(plan, inputs, lowered=mode == "lowered"))
            except Exception as e:  # noqa: BLE001
                if mode in checks and not (mode == "lowered" and eager_failed):
                    fail(_crash_class(f"simulate-{mode}", e), f"{type(e).__name__}: {e}\n{_short_tb(e)}"
                         f"{_nonfinite_note(ref)}", ex)
                eager_failed = eager_failed or mode == "eager"
                continue
            if mode == "lowered":
                lowered = out
            if mode not in checks or (mode == "lowered" and eager_failed):
                continue  # the plan is wrong already: the lowered run says nothing new
            bad = compare_outputs(out, ref, tol, ref64)
            if bad:
                eager_failed = eager_failed or mode == "eager"
                fail(f"simulate-{mode}-mismatch", "; ".join(f"{k}: {v}" for k, v in bad.items()), ex)
        if "json" in checks and lowered is not None:
            stage(f"json-{ex}")
            try:
                again = ed.Plan.from_json(plan.to_json())
                out2 = ed.simulate(again, inputs)
                diff = [k for k in lowered if not _bit_equal(out2.get(k), lowered[k])]
                if diff:
                    fail("json-roundtrip-differs", f"outputs {diff} differ after Plan.from_json(plan.to_json())",
                         ex)
            except Exception as e:  # noqa: BLE001
                fail(_crash_class("json", e), f"{type(e).__name__}: {e}\n{_short_tb(e)}", ex)
    if "like" in checks and "greedy" in plans:  # the plan replayed (issue 29: an unread input broke it)
        stage("like")
        plan = plans["greedy"]
        try:
            again = ed.optimize(fd, mesh, cost_model=cm, like=ed.Plan.from_json(plan.to_json()))
        except ed.EgraphDidError as e:
            fail(f"like-replay-refused: {type(e).__name__}", f"{e}", "greedy")
        except Exception as e:  # noqa: BLE001
            fail(_crash_class("like", e), f"{type(e).__name__}: {e}\n{_short_tb(e)}", "greedy")
        else:
            if [str(s) for s in again.steps] != [str(s) for s in plan.steps]:
                try:
                    bad = compare_outputs(ed.simulate(again, inputs, lowered=False), ref, tol, ref64)
                    if bad:
                        fail("like-replay-mismatch", "; ".join(f"{k}: {v}" for k, v in bad.items()), "greedy")
                except Exception as e:  # noqa: BLE001
                    fail(_crash_class("like-simulate", e), f"{type(e).__name__}: {e}\n{_short_tb(e)}", "greedy")
    if "gloo" in checks and spec.get("gloo") and "greedy" in plans:
        stage("gloo")
        plan = plans["greedy"]
        try:
            outs = timed("gloo", lambda: ed.launch(_gloo_work, nprocs=mesh.size, backend="gloo",
                                                   args=(plan.to_json(), inputs), timeout=180))
        except Exception as e:  # noqa: BLE001
            fail(_crash_class("gloo", e), f"{type(e).__name__}: {str(e)[:1500]}", "greedy")
            return
        for r, o in enumerate(outs):
            bad = compare_outputs(o, ref, tol, ref64)
            if bad:
                fail("gloo-mismatch", f"rank {r}: " + "; ".join(f"{k}: {v}" for k, v in bad.items()), "greedy")
                break


def _nonfinite_note(ref: dict) -> str:
    """A note for triage when the reference itself holds nan or inf."""
    import torch
    bad = [k for k, v in ref.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    return f"\n(the reference outputs {bad} hold nan or inf)" if bad else ""


def _bit_equal(a, b) -> bool:
    import torch
    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _same_sharding(plan, tv, mesh) -> bool:
    """Whether the plan's layout of tv gives every rank the same elements and pending reductions as the pin."""
    try:
        from egraph_did.sharding import local_indices, partial_mesh_axes
        name = tv.name
        layout = plan.layout_of(name)
        view = next(plan.value_view(v.name) for v in plan.values.values()
                    if v.tensor == name and v.layout == layout)
        def pending(t):  # a pending reduction over one rank is no reduction
            return [m for m in partial_mesh_axes(t) if mesh.shape[m] > 1]
        if pending(view) != pending(tv):
            return False
        return all([i.tolist() for i in local_indices(view, r)] == [i.tolist() for i in local_indices(tv, r)]
                   for r in mesh.ranks)
    except Exception:  # noqa: BLE001
        return False


def _short_tb(e: BaseException, n: int = 4) -> str:
    frames = traceback.extract_tb(e.__traceback__)[-n:]
    return "".join(f"  {os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT) else f.filename}:"
                   f"{f.lineno} in {f.name}\n" for f in frames)


# =========================================================================== the worker process

def _worker_main(conn) -> None:
    """Serve cases from the parent until told to stop; in a process group of its own, so a timed-out case
    (and any gloo ranks it started) is ended as a whole."""
    os.setpgrp()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(1)
    import egraph_did  # noqa: F401 - import once, before the first case's clock
    conn.send(("ready", None))  # the case clock starts after this (a loaded machine takes seconds to import)
    parent = os.getppid()
    while True:
        try:
            while not conn.poll(2.0):
                if os.getppid() != parent:  # the campaign is gone: so is this worker
                    return
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        spec, kw = msg
        try:
            res = run_case(spec, stage=lambda s: conn.send(("stage", s)), **kw)
        except BaseException as e:  # noqa: BLE001
            res = {"failures": [{"cls": _crash_class("fuzzer", e), "detail": traceback.format_exc()[-2000:],
                                 "extractor": None}], "refusal": None, "gap": None, "times": {}}
        conn.send(("result", res))


STARTUP_TIMEOUT = 300.0  # seconds a fresh worker may take to import torch and egraph_did


class Runner:
    """Runs cases in a spawned worker process with a per-case timeout; restarts it after a crash or a hang.

    >>> with Runner(timeout=120) as runner:
    ...     res = runner.run(generate_case(0, 0, ops=["neg"], exact=False))
    >>> res["failures"]
    []
    """

    def __init__(self, timeout: float = 120.0):
        self.timeout = timeout
        self.proc = None
        self.conn = None

    def _start(self) -> None:
        import atexit
        import multiprocessing as mp
        atexit.register(self._kill)
        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=False, name="egraph-did-fuzz-worker")
        self.proc.start()
        child.close()
        # the worker's imports are not the first case's time: wait for it to be ready (seconds on a loaded
        # machine; a hang test with a 5 s timeout saw 'timeout in start' beside another test run)
        if not self.conn.poll(STARTUP_TIMEOUT):
            self._kill()
            raise RuntimeError(f"the fuzz worker did not start within {STARTUP_TIMEOUT:.0f} s")
        try:
            kind, _ = self.conn.recv()
        except EOFError:
            code = self.proc.exitcode
            self._kill()
            raise RuntimeError(f"the fuzz worker died while starting (exit code {code})") from None
        assert kind == "ready", kind

    def _kill(self) -> None:
        import signal
        if self.proc is not None and self.proc.pid:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker's own group: it and its gloo ranks
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.join(5)
        self.proc = self.conn = None

    def run(self, spec: dict, timeout: float | None = None, **kw) -> dict:
        """Run one case; a hang past `timeout` or a dead worker is a failure of class 'timeout in <stage>'
        or 'worker-died in <stage>'."""
        if self.proc is None or not self.proc.is_alive():
            self._start()
        timeout = timeout or self.timeout
        where = "start"
        try:
            self.conn.send((spec, kw))
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self.conn.poll(left):
                    self._kill()
                    return {"failures": [{"cls": f"timeout in {_stage_family(where)}",
                                          "detail": f"no result within {timeout:.0f} s (stage {where})",
                                          "extractor": None}], "refusal": None, "gap": None, "times": {}}
                kind, val = self.conn.recv()
                if kind == "stage":
                    where = val
                else:
                    return val
        except (EOFError, OSError, BrokenPipeError):
            code = self.proc.exitcode if self.proc is not None else None
            self._kill()
            return {"failures": [{"cls": f"worker-died in {_stage_family(where)}",
                                  "detail": f"the worker process died (exit code {code}) in stage {where}",
                                  "extractor": None}], "refusal": None, "gap": None, "times": {}}

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(10)
            except (OSError, BrokenPipeError):
                pass
            if self.proc.is_alive():
                self._kill()
        self.proc = self.conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stage_family(stage: str) -> str:
    return re.sub(r"-(greedy|exact)$", "", stage)


# =========================================================================== minimizing

def _candidates(spec: dict, shapes: dict) -> Iterable[tuple[str, dict]]:
    """Smaller variants of spec, most reducing first: (what changed, new spec)."""
    def variant(desc, fn):
        s = copy.deepcopy(spec)
        fn(s)
        return desc, prune(s)

    outs = spec["outputs"]
    if len(outs) > 1:
        for o in outs:
            yield variant(f"drop output {o}", lambda s, o=o: s["outputs"].remove(o))
    # cut an op: its results become fresh inputs (everything upstream goes)
    for k, op in enumerate(spec["ops"]):
        if any(o not in shapes for o in op["outs"]):
            continue

        def cut(s, k=k, op=op):
            s["ops"].pop(k)
            for o in op["outs"]:
                shape, dt = shapes[o]
                data = "randn" if dt in FLOATS else "int"
                s["inputs"][o] = {"shape": list(shape), "dtype": dt, "data": data}
                if data == "int":
                    s["inputs"][o]["high"] = 2
        yield variant(f"cut {op['op']} ({', '.join(op['outs'])}) into inputs", cut)
    # bypass an op: its result is replaced by an operand of the same shape and dtype
    for k, op in enumerate(spec["ops"]):
        if len(op["outs"]) != 1 or op["outs"][0] not in shapes:
            continue
        for _, v in op["args"]:
            if _is_tensor_arg(v) and v["t"] in shapes and shapes[v["t"]] == shapes[op["outs"][0]]:
                def bypass(s, k=k, op=op, src=v["t"]):
                    out = op["outs"][0]
                    s["ops"].pop(k)
                    for o in s["ops"]:
                        o["args"] = [[a, {"t": src} if _is_tensor_arg(x) and x["t"] == out else x] for a, x in o["args"]]
                    s["outputs"] = [src if n == out else n for n in s["outputs"]]
                    if out in s["pins"]:
                        s["pins"][src] = s["pins"].pop(out)
                yield variant(f"bypass {op['op']} ({op['outs'][0]} -> {v['t']})", bypass)
                break
    # pins: drop, then simplify
    for n in list(spec["pins"]):
        yield variant(f"drop pin on {n}", lambda s, n=n: s["pins"].pop(n))
    for n, p in spec["pins"].items():
        if p.get("style", "outer") != "outer":
            yield variant(f"pin {n} style outer", lambda s, n=n: s["pins"][n].update(style="outer"))
        for m, pl in enumerate(p["pl"]):
            if pl != "R":
                yield variant(f"pin {n} R on mesh axis {m}", lambda s, n=n, m=m: s["pins"][n]["pl"].__setitem__(m, "R"))
            if pl == "M":
                yield variant(f"pin {n} P for M", lambda s, n=n, m=m: s["pins"][n]["pl"].__setitem__(m, "P"))
    # the cost model
    if spec["cost"].get("memory_frac") is not None:
        yield variant("no memory bound", lambda s: s["cost"].update(memory_frac=None))
    if spec["cost"]["preset"] != "h200":
        yield variant("h200 cost model", lambda s: s["cost"].update(preset="h200"))
    # the mesh: drop an axis, shrink one
    mesh = spec["mesh"]
    if len(mesh) > 1:
        for m in range(len(mesh)):
            def drop_axis(s, m=m):
                s["mesh"].pop(m)
                if s.get("axis_names"):
                    s["axis_names"].pop(m)
                for p in s["pins"].values():
                    p["pl"].pop(m)
            yield variant(f"drop mesh axis {m}", drop_axis)
    for m, size in enumerate(mesh):
        for new in sorted({2, size - 1} - {size, 0, 1}) if size > 2 else ([1] if size == 2 else []):
            yield variant(f"mesh axis {m}: {size} -> {new}", lambda s, m=m, new=new: s["mesh"].__setitem__(m, new))
    # extents: one value everywhere it appears, then one input axis
    values = sorted({e for s in spec["inputs"].values() for e in s["shape"] if e > 1}, reverse=True)
    for v in values:
        for new in sorted({1, 2, v - 1} - {v}):
            if new < 1:
                continue

            def subst(s, v=v, new=new):
                for inp in s["inputs"].values():
                    inp["shape"] = [new if e == v else e for e in inp["shape"]]
                for o in s["ops"]:
                    o["args"] = [[a, [new if e == v else e for e in x] if a == "shape" and isinstance(x, list) else x]
                                 for a, x in o["args"]]
            yield variant(f"extent {v} -> {new} everywhere", subst)
    for n, inp in spec["inputs"].items():
        for i, e in enumerate(inp["shape"]):
            if e > 1:
                for new in sorted({1, e - 1}):
                    yield variant(f"{n} axis {i}: {e} -> {new}",
                                  lambda s, n=n, i=i, new=new: s["inputs"][n]["shape"].__setitem__(i, new))
    if any(s["dtype"] == "float32" for s in spec["inputs"].values()):
        def to64(s):
            for inp in s["inputs"].values():
                if inp["dtype"] == "float32":
                    inp["dtype"] = "float64"
        yield variant("float32 inputs -> float64", to64)
    if "exact" in spec["extractors"] and len(spec["extractors"]) > 1:
        yield variant("greedy only", lambda s: s.update(extractors=["greedy"]))
    if "greedy" in spec["extractors"] and len(spec["extractors"]) > 1:
        yield variant("exact only", lambda s: s.update(extractors=["exact"]))


def _checks_for(cls: str) -> set[str]:
    """The checks a failure class needs re-run (the rest are skipped while minimizing)."""
    base = {"build", "evaluate", "optimize"}
    if cls.startswith("simulate-lowered"):
        return base | {"eager", "lowered"}  # a lowered failure only counts where the plan itself is right
    for c in CHECKS:
        if cls.startswith(c) or cls.startswith(f"simulate-{c}"):
            return base | {c}
    if cls.startswith(("greedy-", "exact-")):
        return base | {"exact"}
    if cls.startswith(("timeout", "worker-died")):
        return set(CHECKS)
    if cls.startswith("collective-on-size-1"):
        return base | {"size1"}
    if cls.startswith("memory-bound"):
        return base | {"memory"}
    return set(CHECKS)


def minimize(spec: dict, cls: str, run: Callable[[dict, set, str], dict], budget_s: float = 300.0,
             max_runs: int = 200, log: Callable[[str], None] = lambda s: None) -> tuple[dict, dict, int]:
    """Delta debugging: apply the first candidate that keeps a failure of class `cls`, until none does
    (or the budget runs out). Returns (smallest spec, its result, runs used).

    run(spec, checks, cls) -> result, as Runner.run or run_case.

    >>> spec = generate_case(0, 5, ops=["add", "exp", "sum"], exact=False)
    >>> fake = lambda s, checks, cls: {"failures": [{"cls": "x"}] if any(o["op"] == "exp" for o in s["ops"]) else []}
    >>> small, _, _ = minimize(spec, "x", fake)
    >>> [o["op"] for o in small["ops"]]
    ['exp']
    """
    checks = _checks_for(cls)
    t0 = time.monotonic()
    runs = 0
    best, best_res = spec, None
    progress = True
    while progress and runs < max_runs and time.monotonic() - t0 < budget_s:
        progress = False
        shapes = infer_shapes(best) or {}
        for desc, cand in _candidates(best, shapes):
            if runs >= max_runs or time.monotonic() - t0 > budget_s:
                break
            if not cand["ops"] or not cand["outputs"] or cand == best:
                continue
            if infer_shapes(cand) is None or any(m < 1 for m in cand["mesh"]):
                continue
            runs += 1
            r = run(cand, checks, cls)
            if any(f["cls"] == cls for f in r["failures"]):
                log(f"    kept: {desc} -> size {case_size(cand)}")
                best, best_res, progress = cand, r, True
                break
    return best, best_res, runs


# =========================================================================== repro snippets

def repro(spec: dict, failure: dict, memory_limit: float | None = None) -> str:
    """A runnable script for a failure: the case's source plus the check that failed.

    >>> spec = generate_case(0, 0, ops=["relu"], exact=False)
    >>> "ed.simulate(plan, inputs)" in repro(spec, {"cls": "simulate-lowered-mismatch", "extractor": "greedy"})
    True
    """
    cls = failure["cls"]
    ex = failure.get("extractor") or spec["extractors"][0]
    src = case_source(spec, memory_limit)
    opt = f'plan = ed.optimize(fd, mesh, cost_model=cost_model, extractor="{ex}")'
    tol = _tolerance(dt for _, dt in (infer_shapes(spec) or {}).values())
    cmp = (f"ref = ed.evaluate(fd, inputs)\n"
           f"for k in ref:\n"
           f"    torch.testing.assert_close(got[k], ref[k], rtol={tol}, atol={tol} * max(1.0, ref[k].double().abs().max().item()), "
           f"equal_nan=True, msg=k)")
    if cls.startswith(("optimize", "timeout in optimize", "worker-died in optimize")):
        tail = f"{opt}  # {cls}"
    elif cls.startswith(("evaluate", "build", "pin-")):
        tail = "ref = ed.evaluate(fd, inputs)"
    elif cls.startswith("simulate-eager"):
        tail = f"{opt}\nprint(plan.explain())\ngot = ed.simulate(plan, inputs, lowered=False)\n{cmp}"
    elif cls.startswith(("simulate-lowered", "timeout in simulate", "worker-died in simulate")):
        tail = f"{opt}\nprint(plan.explain())\ngot = ed.simulate(plan, inputs)\n{cmp}"
    elif cls.startswith("pins"):
        names = ", ".join(spec["pins"])
        tail = (f"{opt}\nfor tv in ({names},):\n"
                f"    assert plan.loop_domain(tv.name) == tv.loop_str(), (tv.name, tv.loop_str(), plan.loop_domain(tv.name))")
    elif cls.startswith("json"):
        tail = (f"{opt}\nagain = ed.Plan.from_json(plan.to_json())\na, b = ed.simulate(plan, inputs), ed.simulate(again, inputs)\n"
                f"for k in a:\n    assert torch.equal(a[k], b[k]), k")
    elif cls.startswith(("exact", "greedy")):
        tail = ('greedy = ed.optimize(fd, mesh, cost_model=cost_model, extractor="greedy")\n'
                'exact = ed.optimize(fd, mesh, cost_model=cost_model, extractor="exact")\n'
                'print(greedy.explain())\nprint(exact.explain())\n'
                'print(greedy.predicted_time, exact.predicted_time, exact.method)\n'
                + ('assert greedy.predicted_time <= exact.predicted_time * 1.01' if "worse-than-exact" in cls else
                   'assert exact.predicted_time <= greedy.predicted_time * (1 + 1e-9)'))
    elif cls.startswith("memory"):
        tail = f"{opt}\nassert plan.memory <= cost_model.memory_limit, (plan.memory, cost_model.memory_limit)"
    elif cls.startswith("collective-on-size-1"):
        tail = f"{opt}\nprint(plan.explain())\nassert all(mesh.shape[c.mesh_axis] > 1 for c in plan.collectives)"
    elif "gloo" in cls:
        tail = (f"{opt}\n\ndef work(rank, plan_json, inputs):\n"
                f"    return ed.Plan.from_json(plan_json).run(inputs, inputs=\"global\", outputs=\"global\")\n\n"
                f"if __name__ == \"__main__\":\n    outs = ed.launch(work, nprocs=mesh.size, backend=\"gloo\", "
                f"args=(plan.to_json(), inputs))\n    got = outs[0]\n"
                + "\n".join("    " + line for line in cmp.splitlines()))
    else:
        tail = f"{opt}\ngot = ed.simulate(plan, inputs)\n{cmp}"
    return f"{src}\n\n{tail}\n"


# =========================================================================== the campaign

class Campaign:
    """Many cases: run, group failures by class, minimize the first few of each class, summarize.

    >>> camp = Campaign(seed=0, ops=["neg", "add"], exact=False, minimize_per_class=0, timeout=120)
    >>> camp.run(range(2)); camp.close()
    >>> camp.n_cases, dict(camp.failures)
    (2, {})
    """

    def __init__(self, seed: int, ops: Iterable[str] | None = None, gloo_every: int = 0, timeout: float = 120.0,
                 minimize_per_class: int = 1, minimize_budget: float = 300.0, exact: bool = True,
                 max_ops: int = 6, mesh_ndims: Iterable[int] = (1, 2, 3), log: Callable[[str], None] | None = None,
                 report: str | None = None, in_process: bool = False, gap_limit: float | None = None,
                 exact_time_limit: float | None = None, **profile):
        self.seed, self.ops, self.gloo_every = seed, ops, gloo_every
        self.exact, self.max_ops, self.mesh_ndims = exact, max_ops, tuple(mesh_ndims)
        self.minimize_per_class, self.minimize_budget = minimize_per_class, minimize_budget
        self.runner = Runner(timeout)
        self.in_process, self.profile, self.gap_limit = in_process, profile, gap_limit
        self.exact_time_limit = exact_time_limit
        self.log = log or (lambda s: None)
        self.report_path = report
        self.n_cases = 0
        self.failures: dict[str, list[tuple[int, dict]]] = defaultdict(list)  # class -> [(case, failure)]
        self.minimized: dict[str, list[dict]] = defaultdict(list)
        self.refusals: Counter = Counter()
        self.refusal_examples: dict[str, str] = {}
        self.gaps: list[float] = []
        self.gap_cases: list[dict] = []  # per case where both extractors planned: index, gap, ops, mesh
        self.case_times: list[float] = []
        self.op_counts: Counter = Counter()
        self.started = time.monotonic()
        self.times: Counter = Counter()

    def case(self, index: int) -> dict:
        gloo = bool(self.gloo_every) and index % self.gloo_every == self.gloo_every - 1
        spec = generate_case(self.seed, index, self.ops, gloo=gloo, max_ops=self.max_ops,
                             mesh_ndims=self.mesh_ndims, exact=self.exact, **self.profile)
        if self.gap_limit is not None:
            spec["gap_limit"] = self.gap_limit  # greedy worse than exact by more: a failure class
        if self.exact_time_limit is not None:
            spec["exact_time_limit"] = self.exact_time_limit
        return spec

    def _run(self, spec: dict, **kw) -> dict:
        """One case: in the worker process (a timeout and a crash end only the case), or here."""
        return run_case(spec, **kw) if self.in_process else self.runner.run(spec, **kw)

    def run(self, indices: Iterable[int]) -> None:
        for i in indices:
            spec = self.case(i)
            t0 = time.monotonic()
            res = self._run(spec)
            dt = time.monotonic() - t0
            self.n_cases += 1
            self.op_counts.update(o["op"] for o in spec["ops"])
            for k, v in res.get("times", {}).items():
                self.times[k] += v
            self.case_times.append(dt)
            if res.get("gap") is not None:
                self.gaps.append(res["gap"])
                self.gap_cases.append({"case": i, "gap": res["gap"], "mesh": spec["mesh"],
                                       "ops": [o["op"] for o in spec["ops"]], "cost": spec["cost"],
                                       "methods": res.get("methods", {})})
            if res.get("refusal") and not res["failures"]:
                key = _normalize(res["refusal"])
                self.refusals[key] += 1
                self.refusal_examples.setdefault(key, f"case {i}: {res['refusal'][:400]}")
            classes = sorted({f["cls"] for f in res["failures"]})
            self.log(f"case {i:5d} {dt:6.1f}s ops={len(spec['ops'])} mesh={spec['mesh']} "
                     f"{'FAIL ' + '; '.join(classes) if classes else ('refused' if res.get('refusal') else 'ok')}")
            for cls in classes:
                f = next(f for f in res["failures"] if f["cls"] == cls)
                self.failures[cls].append((i, f))
                if len(self.minimized[cls]) < self.minimize_per_class:
                    self._minimize(i, spec, f, res)
            if self.report_path and (classes or self.n_cases % 5 == 0):
                self.write_report(self.report_path)

    def _minimize(self, index: int, spec: dict, failure: dict, res: dict) -> None:
        cls = failure["cls"]
        self.log(f"  minimizing case {index} ({cls}), size {case_size(spec)}")
        timeout = self.runner.timeout
        budget = self.minimize_budget if not cls.startswith(("timeout", "exact-hit")) else min(
            self.minimize_budget, 4 * timeout)

        def run(s, checks, c):
            return self._run(s, checks=sorted(checks), stop_on=c)

        small, small_res, runs = minimize(spec, cls, run, budget_s=budget, log=self.log)
        small_res = small_res or res
        f = next((f for f in small_res["failures"] if f["cls"] == cls), failure)
        entry = {"case": index, "cls": cls, "detail": f["detail"], "size_before": case_size(spec),
                 "size_after": case_size(small), "runs": runs, "spec": small,
                 "repro": repro(small, f, small_res.get("memory_limit"))}
        self.minimized[cls].append(entry)
        self.log(f"  minimized in {runs} runs to size {entry['size_after']}")

    def close(self) -> None:
        self.runner.close()

    # ------------------------------------------------------------ summary
    def gap_summary(self) -> dict:
        """Greedy-vs-exact gap over the cases where both planned."""
        g = sorted(self.gaps)
        if not g:
            return {"n": 0}
        q = lambda p: g[min(len(g) - 1, int(math.ceil(p * len(g))) - 1)]  # noqa: E731
        return {"n": len(g), "within_1pct": sum(x <= 0.01 for x in g) / len(g), "exact_equal": sum(abs(x) < 1e-9
                for x in g) / len(g), "median": statistics.median(g), "p90": q(0.9), "max": g[-1], "min": g[0]}

    def summary(self) -> str:
        lines = [f"egraph-did fuzz: seed {self.seed}, {self.n_cases} cases in {time.monotonic() - self.started:.0f} s, "
                 f"{sum(len(v) for v in self.failures.values())} failures in {len(self.failures)} classes"]
        for cls, items in sorted(self.failures.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  {len(items):5d}  {cls}   (cases {', '.join(str(i) for i, _ in items[:8])}"
                         f"{', ...' if len(items) > 8 else ''})")
        gs = self.gap_summary()
        if gs["n"]:
            lines.append(f"greedy vs exact over {gs['n']} cases: {gs['within_1pct']:.1%} within 1%, "
                         f"{gs['exact_equal']:.1%} equal; gap median {gs['median']:.2%}, p90 {gs['p90']:.2%}, "
                         f"max {gs['max']:.2%}, min {gs['min']:.2%}")
        if self.refusals:
            lines.append(f"refusals (an egraph_did error naming the tensor; not failures): "
                         f"{sum(self.refusals.values())}")
            for k, n in self.refusals.most_common(12):
                lines.append(f"  {n:5d}  {k[:160]}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """What a campaign found, as plain data: campaigns run in shards (--start) are merged from these."""
        return {"seed": self.seed, "n_cases": self.n_cases, "seconds": time.monotonic() - self.started,
                "case_times": self.case_times,
                "failures": {cls: [{"case": i, "detail": f["detail"][:600], "extractor": f.get("extractor")}
                                   for i, f in items] for cls, items in self.failures.items()},
                "minimized": {cls: [{k: m[k] for k in ("case", "detail", "size_before", "size_after", "repro")}
                                    for m in ms] for cls, ms in self.minimized.items()},
                "refusals": dict(self.refusals), "refusal_examples": self.refusal_examples,
                "gaps": self.gap_cases, "times": dict(self.times), "op_counts": dict(self.op_counts)}

    def write_report(self, path: str) -> None:
        out = ["# egraph-did differential fuzzer: failures by class", "",
               f"Command: `.venv/bin/python bench/fuzz.py --seed {self.seed} --cases {self.n_cases} ...` "
               f"(rerun one case: `--seed {self.seed} --case N --show`)", "", "```", self.summary(), "```", ""]
        for cls, items in sorted(self.failures.items(), key=lambda kv: -len(kv[1])):
            out += [f"## {cls}", "", f"{len(items)} case(s): {', '.join(str(i) for i, _ in items[:30])}", ""]
            for m in self.minimized.get(cls, []):
                out += [f"Minimized from case {m['case']} (ops, outputs, pins, ranks, input elements: "
                        f"{m['size_before']} -> {m['size_after']}, {m['runs']} runs):", "", "```",
                        m["detail"][:1500], "```", "", "```python", m["repro"], "```", ""]
            if not self.minimized.get(cls):
                out += ["```", items[0][1]["detail"][:1500], "```", ""]
        with open(path, "w") as f:
            f.write("\n".join(out))
        jpath = os.path.splitext(path)[0] + ".json"  # beside it: for merging shards (bench/fuzz_parallel.py)
        with open(jpath + ".tmp", "w") as f:
            json.dump(self.to_json(), f)
        os.replace(jpath + ".tmp", jpath)  # a shard killed at its deadline leaves the last whole state


def _normalize(msg: str) -> str:
    """A refusal message with names and numbers blanked, to count refusals by kind."""
    msg = re.sub(r"\b[a-z]+_?\d+\b", "<t>", msg)
    msg = re.sub(r"\d+(\.\d+)?", "N", msg)
    return msg.split("\n")[0][:200]


# =========================================================================== the command line

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--case", type=int, default=None, help="run only this case index")
    ap.add_argument("--show", action="store_true", help="print the case's script (with --case)")
    ap.add_argument("--ops", default=None, help="comma-separated op families to draw from (default: every op)")
    ap.add_argument("--exclude-ops", default="", help="comma-separated op families to leave out")
    ap.add_argument("--max-ops", type=int, default=6)
    ap.add_argument("--mesh-ndims", default="1,2,3")
    ap.add_argument("--no-exact", action="store_true", help="greedy extraction only")
    ap.add_argument("--gloo-every", type=int, default=25, help="every K-th case also on gloo processes (0: never)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per case")
    ap.add_argument("--minimize-per-class", type=int, default=1)
    ap.add_argument("--minimize-budget", type=float, default=300.0, help="seconds per minimization")
    ap.add_argument("--gap-limit", type=float, default=None,
                    help="also fail cases where greedy is worse than exact by more than this (e.g. 0.01)")
    ap.add_argument("--report", default=None, help="write failures, minimized repros and the summary (markdown)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    ops = args.ops.split(",") if args.ops else default_ops()
    ops = [o for o in ops if o not in set(filter(None, args.exclude_ops.split(",")))]
    camp = Campaign(args.seed, ops, args.gloo_every, args.timeout, args.minimize_per_class, args.minimize_budget,
                    exact=not args.no_exact, max_ops=args.max_ops,
                    mesh_ndims=[int(x) for x in args.mesh_ndims.split(",")],
                    log=None if args.quiet else (lambda s: print(s, flush=True)), report=args.report,
                    gap_limit=args.gap_limit)
    if args.case is not None:
        spec = camp.case(args.case)
        if args.show:
            print(case_source(spec))
            print(json.dumps(spec))
            return 0
        indices: Iterable[int] = [args.case]
    else:
        indices = range(args.start, args.start + args.cases)
    try:
        camp.run(indices)
    finally:
        camp.close()
    print(camp.summary())
    if args.report:
        camp.write_report(args.report)
        print(f"report: {args.report}")
    return 1 if camp.failures else 0


if __name__ == "__main__":
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from bench import fuzz as _lib  # so spawned workers and gloo ranks import the functions by this name
    sys.exit(_lib.main())
