"""Command line: `egraph-did COMMAND` (or `python -m egraph_did COMMAND`).

  demo        the tensor-parallel MLP on a CPU mesh: layouts, shards, numerics
  optimize    optimize a model by name (or a Python file defining a fusion); write the plan JSON, explain it
  explain     explain a plan JSON as text; draw it with --png / --svg
  sweep       optimize over a grid (shapes, meshes, links, memory, scenarios): CSV, JSON, plots, crossovers
  calibrate   measure collectives on a live gloo process group, fit a link, save a cost-model preset

Exit status: 0 on success, 1 on a user error (a message on stderr naming the problem), 2 on bad
arguments (with a usage message).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

from .calibrate import calibrated, fit_link, load_preset, measure_collectives, predicted, save_preset
from .cost import CostModel
from .demo import main as demo_main
from .errors import EgraphDidError
from .fusion import FusionDefinition
from .launcher import launch
from .mesh import DeviceMesh
from .optimize import optimize
from .plan import Plan
from .plan_graph import draw
from .sweep import (GRID_KEYS, MODELS, apply_io, apply_pins, build_model, choose_x, cost_model_for, crossovers,
                    expand_grid, parse_bytes, parse_mesh, plan_family, plot_sweep, run_sweep, varying, write_tables)

PROG = "egraph-did"


class UserError(Exception):
    """A problem with what the user asked for (a missing file, a file without a fusion): exit 1."""


# ------------------------------------------------------------------ argument types


def _mesh_spec(text: str) -> str:
    parts = text.lower().split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts) or not 1 <= len(parts) <= 3:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh: write axis sizes outermost first, e.g. 8, "
                                         f"2x4 or 2x2x2")
    return "x".join(str(int(p)) for p in parts)


def _list_of(conv, what: str):
    def parse(text: str):
        out = []
        for part in text.split(","):
            try:
                out.append(conv(part.strip()))
            except (ValueError, argparse.ArgumentTypeError):
                raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not {what}") from None
        return out
    return parse


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise ValueError(text)
    return v


def _bytes_spec(text: str) -> str:
    try:
        parse_bytes(text)
    except EgraphDidError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _per_axis_spec(text: str) -> str:
    if text.lower() != "none":
        for part in text.split(":"):
            float(part)
    return text


SHAPES = ("tokens", "hidden", "heads", "seq", "batch", "layers", "context")
DTYPE_CHOICES = ("bfloat16", "float16", "float32", "float64", "bf16", "fp16", "fp32")


def _add_cost_options(p: argparse.ArgumentParser, many: bool) -> None:
    wrap = (lambda conv, what: _list_of(conv, what)) if many else (lambda conv, what: conv)
    s = "comma-separated values" if many else "one value"
    p.add_argument("--cost-model", type=wrap(str, "a cost model"), metavar="NAME|PRESET.json",
                   help=f"h200 (NVLink), h200_multinode (outer axis InfiniBand) or a preset file from "
                        f"`{PROG} calibrate` ({s}; default h200)")
    p.add_argument("--alpha", type=wrap(_per_axis_spec, "a latency"), metavar="SECONDS",
                   help="link latency per collective, one for every mesh axis or 'a:b' per axis outermost first")
    p.add_argument("--bandwidth", type=wrap(_per_axis_spec, "a bandwidth"), metavar="BYTES/S",
                   help="link bandwidth per rank, one for every mesh axis or 'a:b' per axis outermost first")
    p.add_argument("--memory-limit", type=wrap(_bytes_spec, "a size"), metavar="BYTES",
                   help="per-device memory bound, e.g. 80GiB, 40e9 or none")
    p.add_argument("--extractor", type=wrap(_choice(("greedy", "exact")), "greedy or exact"),
                   help="greedy (DAG-greedy, default) or exact (0/1 program, small graphs)")
    p.add_argument("--io", type=wrap(_choice(("free", "R", "S", "fsdp")), "free, R, S or fsdp"),
                   help="scenario pins of a named model: free (optimizer picks x and y), R (x, y replicated), "
                        "S (x, y split along tokens: a layer inside a data/sequence-parallel stack), fsdp (as S, "
                        "and weights stored split along their first axis)")


def _choice(options):
    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(options)}")
        return text
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand.

    >>> args = build_parser().parse_args(["optimize", "mlp", "--tokens", "64", "--mesh", "2x4"])
    >>> args.cmd, args.model, args.tokens, args.mesh
    ('optimize', 'mlp', 64, '2x4')
    """
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="tensor-parallel MLP on a CPU mesh: layouts, shards, numerics")
    demo.add_argument("--tokens", type=_positive_int, default=8)
    demo.add_argument("--hidden", type=_positive_int, default=16)
    demo.add_argument("--ndev", type=_positive_int, default=4)
    demo.add_argument("--no-launch", action="store_true", help="simulate only; no gloo processes")

    opt = sub.add_parser("optimize", help="optimize a model; write the plan JSON and explain it",
                         description="Optimize MODEL (a name: mlp, attention, gpt, gpt_decode, layer_norm; or a "
                                     "Python file defining a FusionDefinition `fd` or a function `fusion()` "
                                     "returning one) on a mesh, write the plan as JSON and print its explanation.")
    opt.add_argument("model", metavar="MODEL")
    for s in SHAPES:
        opt.add_argument(f"--{s}", type=_positive_int, help=f"{s} of a named model")
    opt.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16")
    opt.add_argument("--mesh", type=_mesh_spec, default=None, help="axis sizes outermost first: 8, 2x4, 2x2x2 "
                     "(default 8, or a `mesh` the Python file defines)")
    opt.add_argument("--axis-names", help="mesh axis names outermost first, comma-separated (e.g. dp,tp)")
    _add_cost_options(opt, many=False)
    opt.add_argument("--pin", action="append", default=[], metavar="NAME=LAYOUT",
                     help="pin a tensor: a layout code per mesh axis joined by '.', e.g. x=S1, w1=S0.R, y=R")
    opt.add_argument("-o", "--out", metavar="PLAN.json", help="write the plan here")
    opt.add_argument("--png", metavar="FILE", help="also draw the plan (PNG)")
    opt.add_argument("--svg", metavar="FILE", help="also draw the plan (SVG)")
    opt.add_argument("-q", "--quiet", action="store_true", help="print one summary line, not the explanation")

    exp = sub.add_parser("explain", help="explain a plan JSON; draw it with --png/--svg")
    exp.add_argument("plan", metavar="PLAN.json")
    exp.add_argument("--png", metavar="FILE", help="draw the plan as a graph (PNG)")
    exp.add_argument("--svg", metavar="FILE", help="draw the plan as a graph (SVG)")

    sw = sub.add_parser("sweep", help="optimize over a grid; CSV, JSON, plots and crossovers",
                        description="Optimize every combination of the comma-separated values given, in parallel, "
                                    "caching each point by content hash (an interrupted sweep resumes); write "
                                    "sweep.csv, sweep.json and sweep.png (predicted time, bytes moved and plan "
                                    "family against --x, crossovers marked) under --out-dir.")
    sw.add_argument("--model", type=_list_of(str, "a model name"), help="mlp, attention, gpt, gpt_decode, layer_norm")
    for s in SHAPES:
        sw.add_argument(f"--{s}", type=_list_of(_positive_int, "a positive integer"))
    sw.add_argument("--dtype", type=_list_of(_choice(DTYPE_CHOICES), "a dtype"))
    sw.add_argument("--mesh", type=_list_of(_mesh_spec, "a mesh such as 8 or 2x4"))
    sw.add_argument("--axis-names", help="mesh axis names, comma-separated (every mesh of the grid has that rank)")
    _add_cost_options(sw, many=True)
    sw.add_argument("--x", help="the plots' x axis (default: the numeric parameter with the most values)")
    sw.add_argument("--out-dir", default="sweep-out", help="where tables and plots go (default sweep-out)")
    sw.add_argument("--cache-dir", help="cache of point results (default OUT_DIR/cache)")
    sw.add_argument("--no-cache", action="store_true")
    sw.add_argument("-j", "--jobs", type=_positive_int, default=None, help="processes (default: every core)")
    sw.add_argument("--limit", type=_positive_int, help="optimize at most N new points, then stop (resume later)")
    sw.add_argument("--plot-format", choices=("png", "svg", "pdf"), default="png")
    sw.add_argument("--no-plot", action="store_true")
    sw.add_argument("--title", default="")
    sw.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    cal = sub.add_parser("calibrate", help="fit link latency and bandwidth on a live gloo group; save a preset",
                         description="Spawn NPROCS gloo processes, time allgather, reduce_scatter, allreduce and "
                                     "alltoall over a range of sizes, fit alpha and bandwidth by least squares and "
                                     "save the base cost model with that link as a preset JSON (use it with "
                                     "--cost-model PRESET.json).")
    cal.add_argument("--nprocs", type=_positive_int, default=2)
    cal.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    cal.add_argument("--sizes", type=_list_of(_positive_int, "a size in bytes"), default=[1 << 12, 1 << 16, 1 << 20])
    cal.add_argument("--iters", type=_positive_int, default=5)
    cal.add_argument("--base", default="h200", help="the cost model whose link is replaced (h200, h200_multinode, "
                     "or a preset file)")
    cal.add_argument("--name", default="calibrated", help="the fitted link's name")
    cal.add_argument("--out", default="preset.json", metavar="PRESET.json")
    return parser


# ------------------------------------------------------------------ commands


def _load_fusion_file(path: str):
    """(fd, mesh or None) from a Python file defining `fd` (a FusionDefinition) or `fusion()`."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file")
    try:
        ns = runpy.run_path(path, run_name="egraph_did_fusion")
    except EgraphDidError:
        raise
    except Exception as e:  # the user's script failed: say where, without our traceback
        raise UserError(f"{path}: running it raised {type(e).__name__}: {e}") from None
    fd = ns.get("fd")
    if fd is None and callable(ns.get("fusion")):
        try:
            fd = ns["fusion"]()
        except EgraphDidError:
            raise
        except Exception as e:
            raise UserError(f"{path}: fusion() raised {type(e).__name__}: {e}") from None
    if not isinstance(fd, FusionDefinition):
        raise UserError(f"{path}: defines no fusion; define a FusionDefinition named `fd` or a function "
                        f"`fusion()` that returns one")
    mesh = ns.get("mesh")
    return fd, mesh if isinstance(mesh, DeviceMesh) else None


def cmd_optimize(args) -> int:
    file_mesh = None
    if args.model.endswith(".py") or os.path.sep in args.model:
        fd, file_mesh = _load_fusion_file(args.model)
    else:
        if args.model not in MODELS:
            raise UserError(f"unknown model {args.model!r}; models are {', '.join(MODELS)}, or a .py file "
                            f"defining a fusion")
        fd = build_model(args.model, args.dtype, **{s: getattr(args, s) for s in SHAPES})
    if args.mesh is not None or file_mesh is None:
        mesh = parse_mesh(args.mesh or "8", args.axis_names)
    else:
        mesh = file_mesh
    if args.io and args.io != "free":
        if args.model not in MODELS:
            raise UserError("--io applies to a named model; pin a file's tensors with --pin or in the file")
        apply_io(fd, mesh, args.io, MODELS[args.model][2])
    apply_pins(fd, mesh, args.pin)
    cm = cost_model_for(args.cost_model or "h200", mesh, args.alpha, args.bandwidth, args.memory_limit)
    plan = optimize(fd, mesh, cm, extractor=args.extractor or "greedy")
    if args.out:
        _write(args.out, plan.to_json())
    if args.quiet:
        print(f"{plan_family(plan)}: predicted {plan.predicted_time * 1e6:.1f} us, "
              f"{len(plan.collectives)} collective(s)" + (f", {len(plan.rings)} ring(s)" if plan.rings else "")
              + (f" -> {args.out}" if args.out else ""))
    else:
        print(plan.explain())
        print(f"\nplan family: {plan_family(plan)}" + (f"\nplan written to {args.out}" if args.out else ""))
    _draw(plan, args)
    return 0


def _write(path: str, text: str) -> None:
    try:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror})") from None


def _draw(plan, args) -> None:
    for path in (args.png, args.svg):
        if path:
            try:
                drawn = draw(plan, path)
            except ImportError:  # pragma: no cover - matplotlib is in the test extra
                raise UserError("drawing needs matplotlib: pip install 'egraph-did[plots]'") from None
            print(f"plan drawn to {drawn}")


def cmd_explain(args) -> int:
    try:
        with open(args.plan) as f:
            text = f.read()
    except FileNotFoundError:
        raise UserError(f"{args.plan}: no such file") from None
    except OSError as e:
        raise UserError(f"{args.plan}: cannot read ({e.strerror})") from None
    plan = Plan.from_json(text)
    print(plan.explain())
    print(f"\nplan family: {plan_family(plan)}")
    _draw(plan, args)
    return 0


def cmd_sweep(args) -> int:
    grid = {}
    for key in GRID_KEYS:
        if key == "axis_names":
            if args.axis_names:
                grid[key] = [args.axis_names]
            continue
        v = getattr(args, key, None)
        if v is not None:
            grid[key] = v
    for m in grid.get("model", []):
        if m not in MODELS:
            raise UserError(f"unknown model {m!r}; models are {', '.join(MODELS)}")
    for c in grid.get("cost_model", []):
        if c not in ("h200", "h200_multinode") and not os.path.isfile(c):
            raise UserError(f"cost model {c!r}: use h200, h200_multinode or an existing preset JSON file")
    points = expand_grid(grid)
    cache = None if args.no_cache else (args.cache_dir or os.path.join(args.out_dir, "cache"))
    rows = run_sweep(points, jobs=args.jobs, cache_dir=cache, progress=not args.quiet, limit=args.limit)
    written = write_tables(rows, args.out_dir)
    x = args.x or choose_x([r for r in rows if r.get("family")] or rows)
    if x not in GRID_KEYS:
        raise UserError(f"--x {x!r}: not a sweep parameter; use one of {', '.join(varying(rows)) or 'the grid keys'}")
    if not args.no_plot and any(r.get("family") for r in rows):
        try:
            written.append(plot_sweep(rows, os.path.join(args.out_dir, f"sweep.{args.plot_format}"), x, args.title))
        except ImportError:  # pragma: no cover
            raise UserError("plots need matplotlib: pip install 'egraph-did[plots]' (or pass --no-plot)") from None
    keys = [k for k in varying(rows) if k == x or all(r.get(k) is not None for r in rows)] or [x]
    print("  ".join(f"{k:>12}" for k in keys) + f"  {'time us':>10}  {'MiB moved':>10}  family / error")
    for r in rows:
        vals = "  ".join(f"{str(r.get(k)):>12}" for k in keys)
        if r.get("error"):
            print(f"{vals}  {'-':>10}  {'-':>10}  {r['error']}")
        else:
            print(f"{vals}  {r['time_us']:>10.1f}  {r['bytes_moved'] / 2**20:>10.2f}  {r['family']}")
    cross = crossovers(rows, x)
    if cross:
        print(f"\ncrossovers along {x}:")
        for c in cross:
            print(f"  {c['series'] or '(all)'}: {c['before']} -> {c['after']} between {x}={c['x_before']} "
                  f"and {c['x_after']}")
    left = len(points) - len(rows)
    if left:
        print(f"\n{left} point(s) not yet optimized (--limit); run the same command again to resume")
    errors = sum(1 for r in rows if r.get("error"))
    if errors:
        print(f"\n{errors} point(s) have no plan (see the error column)")
    print("\nwrote " + ", ".join(written))
    return 0


def _measure_rank(rank, sizes, iters):
    """One rank of `egraph-did calibrate` (module level: launch pickles it)."""
    return measure_collectives(sizes=tuple(sizes), iters=iters)


def cmd_calibrate(args) -> int:
    if args.base in ("h200", "h200_multinode"):
        base = getattr(CostModel, args.base)()
    elif os.path.isfile(args.base):
        try:
            base = load_preset(args.base)
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{args.base}: not a cost-model preset ({e})") from None
    else:
        raise UserError(f"--base {args.base!r}: use h200, h200_multinode or an existing preset JSON file")
    print(f"measuring collectives on {args.nprocs} {args.backend} processes ...", file=sys.stderr)
    ms = launch(_measure_rank, nprocs=args.nprocs, backend=args.backend, args=(args.sizes, args.iters))[0]
    link = fit_link(ms, args.name)
    model = calibrated(base, [link])
    _write(args.out, "")  # fail early, with our message, on an unwritable path
    save_preset(model, args.out)
    print(f"{'collective':<16}{'bytes':>12}{'measured us':>14}{'fitted us':>12}")
    for m in ms:
        print(f"{m.kind:<16}{m.nbytes:>12.0f}{m.seconds * 1e6:>14.1f}{predicted(model, m) * 1e6:>12.1f}")
    print(f"\nfitted link {link.name}: alpha {link.alpha * 1e6:.2f} us, bandwidth {link.bandwidth / 1e9:.3f} GB/s")
    print(f"preset written to {args.out} (use: {PROG} optimize MODEL --cost-model {args.out})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse argv, run the command; 0 on success, 1 on a user error, 2 on bad arguments
    (argparse prints the usage and exits).

    >>> main(["demo", "--tokens", "4", "--hidden", "8", "--ndev", "2", "--no-launch"])  # doctest: +ELLIPSIS
    egraph-did demo: ...
    0
    >>> main(["explain", "no-such-plan.json"])
    1
    """
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            return demo_main(args.tokens, args.hidden, args.ndev, launch=not args.no_launch)
        return {"optimize": cmd_optimize, "explain": cmd_explain, "sweep": cmd_sweep,
                "calibrate": cmd_calibrate}[args.cmd](args)
    except (UserError, EgraphDidError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{PROG} {args.cmd}: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
