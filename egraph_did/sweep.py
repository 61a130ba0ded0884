"""Cost-model sweeps: optimize one model over a grid of shapes, meshes, links and memory bounds, name the
plan family each point gets (TP, SP, DP, FSDP, Ulysses, ...), and table and plot where it changes.

A point is plain data (a dict of scalars); its result is cached under the SHA-256 of that dict (and
of this module's FORMAT), one JSON file per point, so an interrupted sweep resumes where it stopped and
a repeated one costs nothing. Points run in parallel over processes.

>>> rows = run_sweep(expand_grid({"model": ["mlp"], "tokens": [16, 4096], "hidden": [4096], "mesh": ["8"],
...                               "io": ["S"]}), jobs=1, progress=False)
>>> [(r["tokens"], r["family"]) for r in rows]  # few tokens: shard the weights; many: replicate them
[(16, 'TP+SP'), (4096, 'DP')]
"""
from __future__ import annotations

import concurrent.futures as cf
import csv
import dataclasses
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Any, Callable, Iterable

import torch

from . import models
from .calibrate import load_preset
from .cost import CostModel, Link
from .errors import EgraphDidError, MeshError, PlanError
from .fusion import FusionDefinition
from .layout import Layout, Placement, is_valid
from .pins import apply_layout
from .mesh import DeviceMesh
from .optimize import optimize
from .plan import Plan

FORMAT = "egraph-did-sweep/1"  # bump when a result's meaning changes: old cache entries are then ignored

# ------------------------------------------------------------------ models by name


def gpt_decode(batch: int, context: int, hidden: int, heads: int, dtype=torch.float32) -> FusionDefinition:
    """One decode step of a pre-norm GPT layer: one new token per sequence attends to a KV cache of
    `context` positions (inputs k_cache, v_cache [batch, heads, context, head_dim]), then the MLP.
    The new token's own k/v projections are left out (the IR has no concat to append them to the cache):
    2 of the layer's 12 h^2 weights.

    >>> fd = gpt_decode(batch=2, context=8, hidden=16, heads=4)
    >>> fd["k_cache"].shape, fd["y"].shape
    ((2, 4, 8, 4), (2, 1, 16))
    """
    hd = hidden // heads
    with FusionDefinition() as fd:
        x = fd.define_tensor((batch, 1, hidden), dtype, name="x", axis_names=("b", "s", "h"))
        kc = fd.define_tensor((batch, heads, context, hd), dtype, name="k_cache", axis_names=("b", "nh", "kv", "d"))
        vc = fd.define_tensor((batch, heads, context, hd), dtype, name="v_cache", axis_names=("b", "nh", "kv", "d"))
        g1, b1, g2, b2 = (fd.define_tensor((hidden,), dtype, name=n, axis_names=("h",))
                          for n in ("ln1_w", "ln1_b", "ln2_w", "ln2_b"))
        wq, wo = (fd.define_tensor((hidden, hidden), dtype, name=n, axis_names=("h", "h")) for n in ("wq", "wo"))
        q = fd.ops.linear(fd.ops.layer_norm(x, weight=g1, bias=b1), wq)
        q = fd.ops.permute(fd.ops.reshape(q, (batch, 1, heads, hd)), (0, 2, 1, 3))
        o = fd.ops.sdpa(q, kc, vc, is_causal=False)
        o = fd.ops.linear(fd.ops.reshape(fd.ops.permute(o, (0, 2, 1, 3)), (batch, 1, hidden)), wo)
        h = fd.ops.add(x, o)
        w1 = fd.define_tensor((4 * hidden, hidden), dtype, name="w1", axis_names=("4h", "h"))
        w2 = fd.define_tensor((hidden, 4 * hidden), dtype, name="w2", axis_names=("h", "4h"))
        m = fd.ops.linear(fd.ops.gelu(fd.ops.linear(fd.ops.layer_norm(h, weight=g2, bias=b2), w1)), w2)
        fd.add_output(fd.ops.add(h, m), name="y")
    return fd


# name -> (builder, the shape options it takes, the token axis of x: what io "S" splits)
MODELS: dict[str, tuple[Callable, tuple[str, ...], int]] = {
    "mlp": (models.mlp, ("tokens", "hidden"), 0),
    "attention": (models.attention, ("batch", "seq", "hidden", "heads"), 1),
    "gpt": (models.gpt_layer, ("batch", "seq", "hidden", "heads", "layers"), 1),
    "gpt_decode": (gpt_decode, ("batch", "context", "hidden", "heads"), 0),
    "layer_norm": (lambda tokens, hidden, dtype: models.layer_norm(tokens, hidden, dtype), ("tokens", "hidden"), 0),
}
SHAPE_DEFAULTS = {"tokens": 1024, "hidden": 4096, "heads": 32, "seq": 2048, "batch": 1, "layers": 1,
                  "context": 8192}
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}
IO = ("free", "R", "S", "fsdp")


def build_model(name: str, dtype: str = "bfloat16", **shape: int) -> FusionDefinition:
    """The fusion of model `name` (see MODELS) at the given shape options; options it does not take are
    ignored, missing ones take SHAPE_DEFAULTS.

    >>> fd = build_model("mlp", dtype="float32", tokens=8, hidden=16, heads=3)  # heads: not an mlp option
    >>> fd["x"].shape, fd["w1"].shape
    ((8, 16), (64, 16))
    """
    if name not in MODELS:
        raise PlanError(f"unknown model {name!r}; models are {', '.join(MODELS)} (or a .py file defining a fusion)")
    if dtype not in DTYPES:
        raise PlanError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    builder, params, _ = MODELS[name]
    kwargs = {p: int(shape.get(p) if shape.get(p) is not None else SHAPE_DEFAULTS[p]) for p in params}
    if "heads" in kwargs and kwargs["hidden"] % kwargs["heads"]:
        raise PlanError(f"{name}: hidden {kwargs['hidden']} is not a multiple of heads {kwargs['heads']}")
    return builder(**kwargs, dtype=DTYPES[dtype])


# ------------------------------------------------------------------ meshes, links, memory


def parse_mesh(spec: str, axis_names: str | Iterable[str] | None = None) -> DeviceMesh:
    """A mesh from '8', '2x4' or '2x2x2' (outermost axis first); axis names default to z, y, x.

    >>> parse_mesh("2x4", "dp,tp")
    DeviceMesh(dp=2, tp=4)
    """
    try:
        shape = tuple(int(s) for s in str(spec).lower().split("x"))
    except ValueError:
        raise MeshError(f"mesh {spec!r}: write the axis sizes outermost first, e.g. 8, 2x4 or 2x2x2") from None
    if any(s < 1 for s in shape):
        raise MeshError(f"mesh {spec!r}: every axis needs at least one device")
    names = axis_names.split(",") if isinstance(axis_names, str) else axis_names
    return DeviceMesh(torch.arange(math.prod(shape)).reshape(shape), axis_names=names)


def parse_bytes(text: str | float | None) -> float | None:
    """Bytes from '80GiB', '40e9', '512MiB' or 'none'.

    >>> parse_bytes("80GiB"), parse_bytes("1.5e9"), parse_bytes("none")
    (85899345920.0, 1500000000.0, None)
    """
    if text is None or str(text).lower() in ("", "none", "inf"):
        return None
    s = str(text).strip()
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
             "b": 1}
    for u, f in units.items():
        if s.lower().endswith(u):
            return float(s[: -len(u)]) * f
    try:
        return float(s)
    except ValueError:
        raise PlanError(f"memory size {text!r}: write bytes, e.g. 80GiB, 40e9 or none") from None


def _per_axis(text, ndim: int, what: str) -> list[float] | None:
    if text is None or str(text).lower() in ("", "none"):
        return None
    parts = [float(p) for p in str(text).split(":")]
    if len(parts) == 1:
        return parts * ndim
    if len(parts) != ndim:
        raise PlanError(f"{what} {text!r} gives {len(parts)} values for a {ndim}-D mesh; give one, or one "
                        f"per mesh axis outermost first separated by ':'")
    return parts


def cost_model_for(preset: str, mesh: DeviceMesh, alpha=None, bandwidth=None, memory_limit=None) -> CostModel:
    """The cost model named by `preset` ('h200', 'h200_multinode' or a JSON preset file from
    `egraph-did calibrate`), its links overridden per mesh axis by alpha (seconds) and bandwidth
    (bytes/s): a number for every axis, or 'a:b' one per axis outermost first.

    >>> cm = cost_model_for("h200", parse_mesh("2x4"), bandwidth="45e9:370e9", memory_limit="80GiB")
    >>> [(l.alpha, l.bandwidth) for l in cm.links], cm.memory_limit == 80 * 2**30
    ([(1e-05, 45000000000.0), (1e-05, 370000000000.0)], True)
    """
    if preset in ("h200", "h200_multinode"):
        cm = getattr(CostModel, preset)()
    elif os.path.isfile(preset):
        try:
            cm = load_preset(preset)
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"cost model {preset}: not a preset written by egraph-did calibrate ({e})") from None
    else:
        raise PlanError(f"cost model {preset!r}: use h200, h200_multinode or a preset JSON file")
    alphas = _per_axis(alpha, mesh.ndim, "alpha")
    bws = _per_axis(bandwidth, mesh.ndim, "bandwidth")
    if alphas or bws:
        base = [cm.link(m, mesh.ndim) if len(cm.links) in (1, mesh.ndim) else cm.links[-1]
                for m in range(mesh.ndim)]
        cm = dataclasses.replace(cm, links=tuple(
            Link(f"{mesh.axis_names[m]}-link", alphas[m] if alphas else base[m].alpha,
                 bws[m] if bws else base[m].bandwidth) for m in range(mesh.ndim)))
    elif len(cm.links) not in (1, mesh.ndim):
        raise PlanError(f"cost model {cm.name} has {len(cm.links)} links but the mesh is {mesh.ndim}-D; give "
                        f"--bandwidth/--alpha per mesh axis or a {len(cm.links)}-D mesh")
    lim = parse_bytes(memory_limit)
    return dataclasses.replace(cm, memory_limit=lim) if lim is not None or memory_limit is not None else cm


# ------------------------------------------------------------------ pins


def activations_and_weights(fd_or_plan) -> tuple[list[str], list[str]]:
    """Split a fusion's (or plan's) inputs into activations (an axis named b, s, t or kv: they grow
    with tokens) and weights (the rest); without axis names, the first input is the activation.

    >>> activations_and_weights(build_model("mlp", tokens=8, hidden=16))
    (['x'], ['w1', 'w2'])
    """
    if isinstance(fd_or_plan, Plan):
        axes = {t: fd_or_plan.values[vs[0]].axes for t, vs in fd_or_plan.inputs.items()}
    else:
        axes = {tv.name: tuple(d.name for d in tv.logical_domain) for tv in fd_or_plan.fusion.inputs}
    act = [t for t, a in axes.items() if set(a) & {"b", "s", "t", "kv", "tokens", "batch", "seq"}]
    if not act and axes:
        act = [next(iter(axes))]
    return act, [t for t in axes if t not in act]


def _split_all(axis: int, mesh: DeviceMesh) -> Layout:
    return Layout(tuple(Placement("S", axis) if size > 1 else Placement("R") for size in mesh.shape))


def apply_io(fd: FusionDefinition, mesh: DeviceMesh, io: str, token_axis: int = 0) -> None:
    """Pin a model's x and y as a scenario: 'free' (the optimizer picks), 'R' (both replicated), 'S' (both
    split along the token axis over every mesh axis: a layer inside a data- or sequence-parallel stack),
    'fsdp' (as 'S', and every weight stored split along its first axis over every mesh axis).

    >>> fd = build_model("mlp", dtype="float32", tokens=8, hidden=16)
    >>> apply_io(fd, parse_mesh("4"), "fsdp")
    >>> fd["x"].loop_str(), fd["w2"].loop_str()
    ('[DIDx{4}, s/4, h]', '[DIDx{4}, h/4, 4h]')
    """
    if io not in IO:
        raise PlanError(f"io {io!r}: use one of {', '.join(IO)}")
    if io == "free":
        return
    names = [n for n in ("x", "y") if n in fd.fusion.tensors]
    for n in names:
        tv = fd[n]
        if io == "R":
            tv.set_device_mesh(mesh)
        else:
            _pin(tv, _split_all(token_axis, mesh), mesh)
    if io == "fsdp":
        for w in activations_and_weights(fd)[1]:
            _pin(fd[w], _split_all(0, mesh), mesh)


def _pin(tv, layout: Layout, mesh: DeviceMesh) -> None:
    if not is_valid(layout, tv.shape, mesh):
        raise PlanError(f"{tv.name}: layout {layout} does not fit shape {tv.shape} on mesh {mesh.shape} (a rank "
                        f"would hold nothing); use more tokens or a smaller mesh")
    apply_layout(tv, layout, mesh)


def apply_pins(fd: FusionDefinition, mesh: DeviceMesh, pins: Iterable[str]) -> None:
    """Pin tensors from 'name=CODE' texts: a layout code per mesh axis outermost first joined by '.'
    (R, P, S<axis>; 'S1.R' on a 2-D mesh) or 'R' for replicated on any mesh.

    >>> fd = build_model("mlp", dtype="float32", tokens=8, hidden=16)
    >>> apply_pins(fd, parse_mesh("2"), ["w1=S0", "y=R"])
    >>> fd["w1"].loop_str()
    '[DIDx{2}, 4h/2, h]'
    """
    for text in pins:
        name, sep, code = text.partition("=")
        if not sep:
            raise PlanError(f"pin {text!r}: write name=LAYOUT, e.g. x=S1 or w1=S0.R")
        if name not in fd.fusion.tensors:
            raise PlanError(f"pin {text!r}: no tensor named {name!r}; tensors are {', '.join(fd.fusion.tensors)}")
        try:
            layout = Layout((Placement("R"),) * mesh.ndim) if code == "R" else Layout.from_code(code)
        except (ValueError, KeyError, AssertionError):
            raise PlanError(f"pin {text!r}: bad layout code {code!r}; use R, P or S<axis> per mesh axis, "
                            f"joined by '.'") from None
        if len(layout) != mesh.ndim:
            raise PlanError(f"pin {text!r}: {len(layout)} placement(s) for a {mesh.ndim}-D mesh")
        _pin(fd[name], layout, mesh)


# ------------------------------------------------------------------ plan families

FAMILY_ORDER = ("FSDP", "TP", "SP", "Ulysses", "alltoall", "CP", "DP", "VP")


def plan_family(plan: Plan) -> str:
    """Name the parallelism each mesh axis carries, read off the plan's layouts and collectives:

    - TP: a weight is read sharded by a compute step (Megatron column/row parallel);
    - SP: TP whose activations enter or leave split along tokens (Megatron sequence parallelism);
    - FSDP: a weight stored sharded is allgathered before use;
    - Ulysses: in a model with attention, an activation is redistributed by an alltoall (sequence <->
      heads); 'alltoall' for an activation alltoall in a model without attention;
    - DP: weights replicated, activations split, no activation collective besides gathering an output;
    - CP: weights replicated, activations split along a sequence, other activation collectives (K/V);
    - VP: an embedding reads its table split along the vocabulary;
    '-' for an axis that holds everything replicated. Axes join with ' | ' as 'name:family' on N-D meshes.

    >>> import egraph_did as ed
    >>> fd = build_model("mlp", tokens=32, hidden=8192)
    >>> apply_io(fd, parse_mesh("4"), "R")
    >>> plan_family(ed.optimize(fd, parse_mesh("4")))
    'TP'
    """
    _, weights = activations_and_weights(plan)
    weights = set(weights)
    attention = any(s.op == "sdpa" for s in plan.compute_steps)
    token_axes = {"b", "s", "t", "tokens", "batch", "seq"}

    def split_on_tokens(value: str, m: int) -> bool:
        v = plan.values[value]
        p = v.layout[m]
        return p.is_shard and (not v.axes or v.axes[p.axis] in token_axes)

    def move(c) -> tuple:
        """What a collective does to its tensor's placement on its mesh axis (the families are named by
        that, not by which collective kind does it)."""
        return plan.values[c.src].layout[c.mesh_axis], plan.values[c.dst].layout[c.mesh_axis]

    def gathers(c) -> bool:  # S -> R
        return move(c)[0].is_shard and move(c)[1].kind == "R"

    def resplits(c) -> bool:  # S(a) -> S(b): sequence <-> heads
        return move(c)[0].is_shard and move(c)[1].is_shard

    def splits_or_gathers(c) -> bool:  # S -> R or P -> S: sequence parallelism's pair
        src, dst = move(c)
        return src.is_shard != dst.is_shard

    out = []
    for m in range(plan.mesh.ndim):
        if plan.mesh.shape[m] == 1:
            out.append("-")
            continue
        tags = set()
        colls = [c for c in plan.collectives if c.mesh_axis == m]
        for c in colls:
            if c.tensor in weights and gathers(c):
                tags.add("FSDP")
            elif c.tensor not in weights and resplits(c):
                tags.add("Ulysses" if attention else "alltoall")
        weight_split = act_split = False
        for s in plan.compute_steps:
            for v in s.reads:
                val = plan.values[v]
                if val.layout[m].is_shard:
                    if val.tensor in weights:
                        weight_split = True
                        if s.op == "embedding" and val.layout[m].axis == 0:
                            tags.add("VP")
                    else:
                        act_split = True
        io_split = any(split_on_tokens(v, m) for t, vs in plan.inputs.items() if t not in weights for v in vs) \
            or any(split_on_tokens(v, m) for v in plan.outputs.values())
        if weight_split:
            tags.add("TP")
            if io_split and any(splits_or_gathers(c) and c.tensor not in weights for c in colls):
                tags.add("SP")
        elif act_split or io_split:
            other = [c for c in colls if c.tensor not in weights and not resplits(c)
                     and c.tensor not in plan.outputs]
            if not tags & {"Ulysses", "FSDP"}:  # FSDP is data parallel with weights gathered per use
                tags.add("CP" if other else "DP")
        label = "+".join(t for t in FAMILY_ORDER if t in tags) or "-"
        out.append(label)
    if plan.mesh.ndim == 1:
        return out[0]
    return " | ".join(f"{n}:{f}" for n, f in zip(plan.mesh.axis_names, out))


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The numbers a sweep records for one plan.

    >>> import egraph_did as ed
    >>> s = plan_summary(ed.optimize(build_model("mlp", tokens=8, hidden=16), parse_mesh("2")))
    >>> sorted(s)
    ['bytes_moved', 'collectives', 'comm_us', 'compute_us', 'family', 'memory_mib', 'n_collectives', 'time_us']
    """
    counts: dict[str, int] = {}
    for c in plan.collectives:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    comm = sum(c.time for c in plan.collectives)
    return {"time_us": plan.predicted_time * 1e6, "comm_us": comm * 1e6,
            "compute_us": (plan.predicted_time - comm) * 1e6,
            "bytes_moved": float(sum(c.bytes for c in plan.collectives)),
            "n_collectives": len(plan.collectives),
            "collectives": " ".join(f"{k}:{n}" for k, n in sorted(counts.items())),
            "memory_mib": plan.memory / 2**20, "family": plan_family(plan)}


# ------------------------------------------------------------------ grid and points

GRID_KEYS = ("model", "dtype", "tokens", "hidden", "heads", "seq", "batch", "layers", "context", "mesh",
             "axis_names", "cost_model", "alpha", "bandwidth", "memory_limit", "io", "extractor")
POINT_DEFAULTS = {"model": "mlp", "dtype": "bfloat16", "mesh": "8", "axis_names": None, "cost_model": "h200",
                  "alpha": None, "bandwidth": None, "memory_limit": None, "io": "S", "extractor": "greedy"}


def expand_grid(grid: dict[str, list]) -> list[dict]:
    """Every combination of the grid's values (keys from GRID_KEYS), as points with defaults filled in;
    shape options a point's model does not take are dropped (so they do not multiply its points).

    >>> [(p["tokens"], p["mesh"]) for p in expand_grid({"tokens": [64, 128], "mesh": ["8", "2x4"], "seq": [1, 2]})]
    [(64, '8'), (64, '2x4'), (128, '8'), (128, '2x4')]
    """
    unknown = set(grid) - set(GRID_KEYS)
    if unknown:
        raise PlanError(f"unknown sweep parameter(s) {sorted(unknown)}; known: {', '.join(GRID_KEYS)}")
    keys = [k for k in GRID_KEYS if k in grid]
    points, seen = [], set()
    for combo in itertools.product(*(grid[k] for k in keys)):
        p = {**POINT_DEFAULTS, **dict(zip(keys, combo))}
        if p["model"] in MODELS:
            takes = MODELS[p["model"]][1]
            p = {k: v for k, v in p.items() if k not in SHAPE_DEFAULTS or k in takes}
            for k in takes:
                p.setdefault(k, SHAPE_DEFAULTS[k])
        key = point_key(p)
        if key not in seen:
            seen.add(key)
            points.append(p)
    return points


def point_key(point: dict) -> str:
    """The content hash a point's result is cached under.

    >>> point_key({"model": "mlp", "tokens": 8}) == point_key({"tokens": 8, "model": "mlp"})
    True
    """
    text = json.dumps({"format": FORMAT, **point}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def optimize_point(point: dict) -> Plan:
    """The plan of one sweep point (a model by name, scenario pins, cost model, extractor).

    >>> plan = optimize_point({"model": "mlp", "tokens": 16, "hidden": 4096, "mesh": "8", "io": "S"})
    >>> sorted(c.kind for c in plan.collectives)
    ['allgather', 'reduce_scatter']
    """
    p = {**POINT_DEFAULTS, **point}
    mesh = parse_mesh(p["mesh"], p["axis_names"])
    shape = {k: p[k] for k in SHAPE_DEFAULTS if k in p}
    fd = build_model(p["model"], p["dtype"], **shape)
    apply_io(fd, mesh, p["io"], MODELS[p["model"]][2])
    cm = cost_model_for(p["cost_model"], mesh, p["alpha"], p["bandwidth"], p["memory_limit"])
    return optimize(fd, mesh, cm, extractor=p["extractor"])


def run_point(point: dict) -> dict:
    """Optimize one point; its row: the point, plan_summary's numbers, seconds taken, or an error."""
    t0 = time.perf_counter()
    row = dict(point)
    try:
        row.update(plan_summary(optimize_point(point)))
        row["error"] = ""
    except (EgraphDidError, ValueError) as e:  # a point the grid makes impossible: recorded, not fatal
        row.update(time_us=None, comm_us=None, compute_us=None, bytes_moved=None, n_collectives=None,
                   collectives="", memory_mib=None, family="", error=f"{type(e).__name__}: {e}")
    row["optimize_s"] = time.perf_counter() - t0
    return row


class Progress:
    """A progress bar on stderr, plain text (a carriage return redraws it; one line per update when
    stderr is not a terminal would flood logs, so then it prints only every 10%)."""

    def __init__(self, total: int, cached: int, stream=None, enabled: bool = True):
        self.total, self.cached, self.done = total, cached, cached
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.t0 = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1
        self.draw()

    def step(self, n: int = 1) -> None:
        self.done += n
        self.draw()

    def draw(self) -> None:
        if not self.enabled:
            return
        frac = self.done / self.total
        decile = int(frac * 10)
        if not self.tty and decile == self._last_decile and self.done != self.total:
            return
        self._last_decile = decile
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        text = (f"sweep [{bar}] {self.done}/{self.total} points ({self.cached} cached) "
                f"{time.perf_counter() - self.t0:.0f}s")
        self.stream.write(("\r" + text) if self.tty else text + "\n")
        if self.tty and self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def _write_atomic(path: str, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # a sweep killed mid-write leaves no half-written entry


def run_sweep(points: list[dict], jobs: int | None = None, cache_dir: str | None = None, progress: bool = True,
              limit: int | None = None) -> list[dict]:
    """Rows for every point, in order: cached ones read from cache_dir, the rest optimized over `jobs`
    processes (default: every core) and cached as they finish. limit: optimize at most that many new
    points (the rest are left out of the rows; a later call resumes them).

    >>> import tempfile
    >>> cache = tempfile.mkdtemp()
    >>> pts = expand_grid({"tokens": [16, 32], "hidden": [64]})
    >>> len(run_sweep(pts, jobs=1, cache_dir=cache, progress=False, limit=1))  # interrupted after one
    1
    >>> [r["tokens"] for r in run_sweep(pts, jobs=1, cache_dir=cache, progress=False)]  # resumes
    [16, 32]
    """
    rows: dict[int, dict] = {}
    todo = []
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    for i, p in enumerate(points):
        path = os.path.join(cache_dir, point_key(p) + ".json") if cache_dir else None
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    rows[i] = json.load(f)
                continue
            except (OSError, json.JSONDecodeError):
                pass  # a damaged entry is recomputed
        todo.append(i)
    if limit is not None:
        todo = todo[:limit]
    bar = Progress(len(rows) + len(todo), len(rows), enabled=progress)

    def done(i: int, row: dict) -> None:
        rows[i] = row
        if cache_dir:
            _write_atomic(os.path.join(cache_dir, point_key(points[i]) + ".json"), row)
        bar.step()

    jobs = jobs or os.cpu_count() or 1
    if jobs == 1 or len(todo) <= 1:
        for i in todo:
            done(i, run_point(points[i]))
    else:
        # spawn, not fork: a forked worker inherits torch's and egglog's threads mid-lock and can hang
        with cf.ProcessPoolExecutor(max_workers=min(jobs, len(todo)),
                                    mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run_point, points[i]): i for i in todo}
            for fut in cf.as_completed(futures):
                done(futures[fut], fut.result())
    return [rows[i] for i in sorted(rows)]


# ------------------------------------------------------------------ tables


COLUMNS = list(GRID_KEYS) + ["family", "time_us", "comm_us", "compute_us", "bytes_moved", "n_collectives",
                             "collectives", "memory_mib", "optimize_s", "error"]


def write_tables(rows: list[dict], out_dir: str, stem: str = "sweep") -> list[str]:
    """Write rows as <stem>.csv and <stem>.json under out_dir; the paths written.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> [os.path.basename(p) for p in write_tables([{"model": "mlp", "tokens": 8, "time_us": 1.0}], d)]
    ['sweep.csv', 'sweep.json']
    """
    os.makedirs(out_dir, exist_ok=True)
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    csv_path, json_path = os.path.join(out_dir, f"{stem}.csv"), os.path.join(out_dir, f"{stem}.json")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in cols})
    with open(json_path, "w") as f:
        json.dump({"format": FORMAT, "rows": rows}, f, indent=1)
    return [csv_path, json_path]


def varying(rows: list[dict]) -> list[str]:
    """The grid keys whose values differ between rows, in GRID_KEYS order.

    >>> varying([{"tokens": 1, "mesh": "8"}, {"tokens": 2, "mesh": "8"}])
    ['tokens']
    """
    return [k for k in GRID_KEYS if len({json.dumps(r.get(k), default=str) for r in rows}) > 1]


def crossovers(rows: list[dict], x: str) -> list[dict]:
    """Where the plan family changes between neighbouring x values of one series (the rows that agree on
    every other varying key): {series, x_before, x_after, before, after}.

    >>> rows = [{"tokens": t, "family": f} for t, f in ((16, "TP"), (64, "TP"), (256, "DP"))]
    >>> crossovers(rows, "tokens")
    [{'series': '', 'x_before': 64, 'x_after': 256, 'before': 'TP', 'after': 'DP'}]
    """
    out = []
    for label, series in _series(rows, x).items():
        pts = [r for r in series if r.get("family")]
        for a, b in zip(pts, pts[1:]):
            if a["family"] != b["family"]:
                out.append({"series": label, "x_before": a[x], "x_after": b[x], "before": a["family"],
                            "after": b["family"]})
    return out


def _series(rows: list[dict], x: str) -> dict[str, list[dict]]:
    # keys only some models take (None or absent elsewhere) follow from the model: they name no series
    others = [k for k in varying(rows) if k != x and all(r.get(k) is not None for r in rows)]
    groups: dict[str, list[dict]] = {}
    for r in rows:
        label = ", ".join(f"{k}={r.get(k)}" for k in others)
        groups.setdefault(label, []).append(r)
    for g in groups.values():
        g.sort(key=lambda r: _num(r.get(x)))
    return groups


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def choose_x(rows: list[dict]) -> str:
    """The x axis of a sweep's plots: the numeric varying key with the most values (else the first
    varying key, else 'tokens').

    >>> choose_x([{"tokens": 1, "mesh": "8"}, {"tokens": 2, "mesh": "2x4"}, {"tokens": 3, "mesh": "8"}])
    'tokens'
    """
    keys = varying(rows)
    numeric = [k for k in keys if all(isinstance(_num(r.get(k)), float) for r in rows)]
    pool = numeric or keys
    if not pool:
        return "tokens"
    return max(pool, key=lambda k: len({str(r.get(k)) for r in rows}))


# ------------------------------------------------------------------ plots


def plot_sweep(rows: list[dict], path: str, x: str | None = None, title: str = "") -> str:
    """One figure, three panels sharing x: predicted time, bytes moved, plan family per series; every
    crossover (family change) drawn as a dashed line labelled 'before -> after'. Needs matplotlib.

    >>> import tempfile, os
    >>> rows = [{"tokens": t, "family": f, "time_us": t / 10, "bytes_moved": 1e6 / t}
    ...         for t, f in ((16, "TP"), (64, "TP"), (256, "DP"))]
    >>> path = plot_sweep(rows, os.path.join(tempfile.mkdtemp(), "s.png"))
    >>> os.path.getsize(path) > 1000
    True
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if r.get("family")]
    x = x or choose_x(good or rows)
    series = _series(good, x)
    families = sorted({r["family"] for r in good})
    cmap = plt.get_cmap("tab10")
    color = {f: cmap(i % 10) for i, f in enumerate(families)}
    markers = "osD^v<>ph*"
    fig, axes = plt.subplots(3, 1, figsize=(9, 9.5), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, max(1.2, 0.35 * len(series) + 0.8)]})
    xs_all = [_num(r[x]) for r in good]
    numeric = all(isinstance(v, float) for v in xs_all)
    logx = numeric and xs_all and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 16
    for si, (label, pts) in enumerate(series.items()):
        xs = [_num(r[x]) for r in pts] if numeric else [str(r[x]) for r in pts]
        mk = markers[si % len(markers)]
        for ax, key, scale in ((axes[0], "time_us", 1.0), (axes[1], "bytes_moved", 2**-20)):
            ys = [r[key] * scale for r in pts]
            ax.plot(xs, ys, "-", color="0.6", lw=1, zorder=1)
            ax.scatter(xs, ys, c=[color[r["family"]] for r in pts], marker=mk, s=36, zorder=2)
        axes[2].scatter(xs, [si] * len(xs), c=[color[r["family"]] for r in pts], marker="s", s=120)
    row = {label: i for i, label in enumerate(series)}
    for c in crossovers(good, x):
        if not numeric:
            continue
        a, b = float(c["x_before"]), float(c["x_after"])
        xc = math.sqrt(a * b) if logx else (a + b) / 2
        for ax in axes:
            ax.axvline(xc, ls="--", color="0.45", lw=0.7)
        axes[2].annotate(f"{c['before']} → {c['after']}", (xc, row[c["series"]] + 0.18), ha="center",
                         va="bottom", fontsize=6, color="0.15")
    if logx:
        for ax in axes:
            ax.set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("predicted time (µs)")
    axes[1].set_ylabel("bytes moved (MiB / device)")
    axes[2].set_yticks(range(len(series)), [s or "(all)" for s in series], fontsize=7)
    axes[2].set_ylim(-0.7, len(series) - 0.3)
    axes[2].set_ylabel("plan family")
    axes[2].set_xlabel(x)
    handles = [plt.Line2D([], [], marker="s", ls="", color=color[f], label=f) for f in families]
    axes[2].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), title="family")
    if any(series):
        axes[0].legend(handles=[plt.Line2D([], [], marker=markers[i % len(markers)], ls="-", color="0.4", label=s)
                                for i, s in enumerate(series)],
                       fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), title="series (marker)")
    fig.suptitle(title or f"egraph-did sweep over {x}", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["MODELS", "build_model", "gpt_decode", "parse_mesh", "parse_bytes", "cost_model_for", "apply_io",
           "apply_pins", "activations_and_weights", "plan_family", "plan_summary", "expand_grid", "point_key",
           "optimize_point", "run_point", "run_sweep", "write_tables", "varying", "crossovers", "choose_x",
           "plot_sweep", "Progress"]
