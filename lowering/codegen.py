"""Triton source generation shared by the schedulers: index arithmetic over a loop nest, loads and
stores with masks, and one Triton expression per primitive op.

A scheduler (lowering/schedulers.py) describes its kernel as a loop over the axes of a loop shape L,
tiled into groups: a group is a run of loop axes whose row-major flattened coordinate is one expression
of the generated source (`offs`, `rows`, `cols`, ...), shaped to broadcast along its own tile dimension.
Every tensor of the spec is aligned to the loop through a frame (the loop axes its dims right-align to):
its element offset is then a sum over groups, `flat * stride` when it covers a group whole, per-axis
coordinates otherwise. The value of a tensor inside a kernel is a Triton block broadcasting over the
tile dimensions of the groups it varies along, so numpy broadcasting of the spec falls out of Triton's.

A pointwise primitive's Triton expression is its template in the op table (egraph_did/ops.py): adding
one touches nothing here, unless it calls a helper of HELPERS below.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from string import Formatter
from typing import Any

import torch

from egraph_did.ops import OPS

# Compute types: 16-bit floats are loaded into fp32 and stored back rounded once (as inductor does).
COMPUTE_TYPE = {torch.float32: "tl.float32", torch.float16: "tl.float32", torch.bfloat16: "tl.float32",
                torch.int32: "tl.int32", torch.int64: "tl.int64", torch.bool: "tl.int1"}
STORAGE_TYPE = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
                torch.int32: "tl.int32", torch.int64: "tl.int64", torch.bool: "tl.int1"}
FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# Helpers emitted into a kernel's module only when an expression calls them (`_tanh(...)`). libdevice is
# not used: the interpreter does not run extern calls, and these are exact enough in fp32 on both.
HELPERS = {
    "tanh": '''
@triton.jit
def _tanh(x):
    # (1 - e) / (1 + e), e = exp(-2|x|), cancels near 0: an odd Taylor series takes |x| < 1/16 instead.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    r = tl.where(ax < 0.0625, small, big)
    return tl.where(x < 0, -r, r)
''',
    "pow": '''
@triton.jit
def _pow(a, b):
    # torch.pow for floats: |a|**b, negative bases only with integral exponents, pow(x, 0) = pow(1, y) = 1.
    r = tl.exp2(b * tl.log2(tl.abs(a)))
    b_int = b == tl.floor(b)
    b_odd = b_int & ((b - 2.0 * tl.floor(b * 0.5)) == 1.0)
    r = tl.where(a < 0, tl.where(b_int, tl.where(b_odd, -r, r), float("nan")), r)
    # nested where, not `|`: a 0-d exponent loads as a scalar, and the interpreter cannot `|` a scalar bool
    return tl.where(b == 0, 1.0, tl.where(a == 1.0, 1.0, r))
''',
}

def literal(v: Any) -> str:
    """A Python number as Triton source (bools as 0/1; inf and nan through float())."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        return repr(v)
    raise TypeError(f"not a Python number: {v!r}")


def pow_expr(a: str, b: str, a_scalar: Any = None, b_scalar: Any = None) -> str:
    """torch.pow over fp32 operands. Small integral and half exponents become multiplications and square
    roots, as torch does; the rest calls the _pow helper.

    >>> pow_expr("v", "2", b_scalar=2), pow_expr("v", "w")
    ('((v) * (v))', '_pow(v, w)')
    """
    if b_scalar is not None:
        e = float(b_scalar)
        if e == 0:
            return f"tl.where({a} == {a}, 1.0, 1.0)"
        if e.is_integer() and abs(e) <= 4:
            prod = " * ".join([f"({a})"] * int(abs(e)))
            return f"({prod})" if e > 0 else f"1.0 / ({prod})"
        if e == 0.5:
            return f"tl.sqrt_rn({a})"
        if e == -0.5:
            return f"1.0 / tl.sqrt_rn({a})"
        r = f"tl.exp2({literal(e)} * tl.log2(tl.abs({a})))"
        if e.is_integer():
            return f"tl.where({a} < 0, -{r}, {r})" if int(e) % 2 else r
        return f"tl.where({a} < 0, float(\"nan\"), {r})"
    if a_scalar is not None:
        return f"_pow(tl.zeros_like({b}) + {literal(float(a_scalar))}, {b})"
    return f"_pow({a}, {b})"


def _cast(spec, args, val, out_dt) -> str:
    return cast_expr(val(args["x"]), spec.dtype(args["x"]), out_dt)


def _pow(spec, args, val, out_dt) -> str:
    a, b = args["a"], args["b"]
    return pow_expr(val(a), val(b), None if spec.is_tensor(a) else a, None if spec.is_tensor(b) else b)


def cast_expr(x: str, src: torch.dtype, dst: torch.dtype) -> str:
    """cast(x, dst) where x holds a src tensor in its compute type; rounds through a 16-bit float
    destination so that later ops see the value torch would."""
    if dst == torch.bool:
        return f"({x} != 0)"
    if dst == src or (COMPUTE_TYPE[dst] == COMPUTE_TYPE[src] and dst == torch.float32):
        return x
    if dst in (torch.float16, torch.bfloat16):
        if not src.is_floating_point:  # bool and ints through float32, as torch converts: Triton's interpreter
            x = f"{x}.to(tl.float32)"  # cannot cast int1 to 16 bits and reads an integer's bits as one (2 -> nan)
        return f"{x}.to({STORAGE_TYPE[dst]}).to(tl.float32)"
    return f"{x}.to({COMPUTE_TYPE[dst]})"


# Ops whose Triton form depends on dtypes or on a literal operand; the op table's template is their
# general form. cast rounds through a 16-bit destination (later ops see what torch would) and casts to
# bool as `!= 0`; pow turns small integral and half exponents into products and square roots.
SPECIALIZED = {"cast": _cast, "pow": _pow}


def ident(name: str) -> str:
    """A Python identifier for a tensor name."""
    s = re.sub(r"\W", "_", name)
    return s if s and not s[0].isdigit() else "_" + s


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for e in reversed(shape):
        strides.append(acc)
        acc *= e
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Group:
    """Loop axes (in row-major order) whose flattened coordinate is the source expression `flat`;
    `mask` bounds it (None when the grid never overshoots, e.g. coordinates taken from program ids)."""

    axes: tuple[int, ...]
    flat: str
    mask: str | None


class Phase:
    """The groups visible at one place of a kernel (inside a reduction loop, after it, ...)."""

    def __init__(self, loop: tuple[int, ...], groups: list[Group]):
        self.loop = loop
        self.groups = groups

    def group_of(self, axis: int) -> Group | None:
        return next((g for g in self.groups if axis in g.axes), None)

    def coord(self, axis: int) -> str:
        """The coordinate along one loop axis, from its group's flat expression."""
        g = self.group_of(axis)
        inner = math.prod(self.loop[b] for b in g.axes[g.axes.index(axis) + 1:])
        first = all(self.loop[b] == 1 for b in g.axes[:g.axes.index(axis)])
        expr = g.flat if inner == 1 else f"({g.flat} // {inner})"
        return expr if first else f"({expr} % {self.loop[axis]})"

    def index(self, shape: tuple[int, ...], align: tuple[int | None, ...]) -> tuple[str, list[Group]]:
        """Element offset of a contiguous tensor of `shape` whose dim d lies on loop axis align[d] (None
        for extent-1 dims), and the groups it varies along."""
        strides = contiguous_strides(shape)
        terms, used = [], []
        for g in self.groups:
            hits = [(d, align[d]) for d in range(len(shape)) if align[d] is not None and align[d] in g.axes
                    and shape[d] > 1]
            if not hits:
                continue
            used.append(g)
            dims = [d for d, _ in hits]
            whole = [a for a in g.axes if self.loop[a] > 1]
            ordered = [a for _, a in hits] == whole and all(
                strides[dims[i]] == strides[dims[i + 1]] * shape[dims[i + 1]] for i in range(len(dims) - 1))
            if ordered:
                s = strides[dims[-1]]
                terms.append(g.flat if s == 1 else f"{g.flat} * {s}")
            else:
                for d, a in hits:
                    c = self.coord(a)
                    terms.append(c if strides[d] == 1 else f"{c} * {strides[d]}")
        return (" + ".join(terms) if terms else "0"), used

    def uncovered(self, shape: tuple[int, ...], align: tuple[int | None, ...]) -> list[int]:
        """Loop axes of this phase (extent > 1) a tensor does not vary along: a store of it must keep
        to coordinate 0 there, or every program along that axis would write it again."""
        covered = {a for d, a in enumerate(align) if a is not None and shape[d] > 1}
        return [a for g in self.groups for a in g.axes if self.loop[a] > 1 and a not in covered]


def align_to(shape: tuple[int, ...], frame: tuple[int, ...], loop: tuple[int, ...]) -> tuple[int | None, ...] | None:
    """Right-align shape onto the loop axes `frame` (numpy broadcasting); None when it does not fit."""
    if len(shape) > len(frame):
        return None
    off = len(frame) - len(shape)
    out = []
    for d, e in enumerate(shape):
        a = frame[off + d]
        if e == 1:
            out.append(None)
        elif e == loop[a]:
            out.append(a)
        else:
            return None
    return tuple(out)


class Writer:
    """Lines of a kernel body, with loads cached per (tensor, frame, phase) and, for every value, the
    groups (tile dimensions) it varies along: a store's pointer must span them."""

    def __init__(self, spec, in_params: dict[str, str], out_params: dict[str, str]):
        self.spec = spec
        self.in_params, self.out_params = in_params, out_params
        self.lines: list[str] = []
        self.indent = 1
        self.helpers: set[str] = set()
        self.names: set[str] = set()
        self.loaded: dict[tuple, str] = {}
        self.spans: dict[str, frozenset[Group]] = {}
        # Cache hints (set by the scheduler): a tensor as large as the loop is read once, so its loads
        # evict first; a smaller one (a weight broadcast over rows) is re-read by every program and
        # stays (evict_last). Stores take store_policy when it is set.
        self.hints = False
        self.store_policy: str | None = None

    def policy(self, shape: tuple[int, ...], loop: tuple[int, ...]) -> str:
        """The eviction-policy argument of a load of a tensor of `shape` in a loop of `loop` ('' unhinted)."""
        if not self.hints:
            return ""
        return ', eviction_policy="evict_first"' if math.prod(shape) >= math.prod(loop) else \
            ', eviction_policy="evict_last"'

    def emit(self, line: str) -> None:
        self.lines.append("    " * self.indent + line)

    def fresh(self, base: str) -> str:
        name, i = f"v_{ident(base)}", 1
        while name in self.names:
            name, i = f"v_{ident(base)}_{i}", i + 1
        self.names.add(name)
        return name

    def load(self, name: str, frame: tuple[int, ...], phase: Phase, key: Any) -> str:
        """The value of spec input `name` in this phase (loaded once per frame and phase)."""
        k = (name, frame, key)
        if k in self.loaded:
            return self.loaded[k]
        shape, dt = self.spec.shape(name), self.spec.dtype(name)
        align = align_to(shape, frame, phase.loop)
        idx, used = phase.index(shape, align)
        mask = " & ".join(g.mask for g in used if g.mask)
        var = self.fresh(name)
        ptr = f"{self.in_params[name]} + {idx}" if idx != "0" else self.in_params[name]
        up = ".to(tl.float32)" if dt in (torch.float16, torch.bfloat16) else ""
        hint = self.policy(shape, phase.loop)
        if mask:
            self.emit(f"{var} = tl.load({ptr}, mask={mask}, other=0{hint}){up}")
        else:
            self.emit(f"{var} = tl.load({ptr}{hint}){up}")
        self.loaded[k] = var
        self.spans[var] = frozenset(used)
        return var

    def store(self, name: str, value: str, frame: tuple[int, ...], phase: Phase) -> None:
        """Store output `name` (held in `value`) rounded to its dtype, writing each element once."""
        shape, dt = self.spec.shape(name), self.spec.dtype(name)
        align = align_to(shape, frame, phase.loop)
        idx, used = phase.index(shape, align)
        conds = [f"({phase.coord(a)} == 0)" for a in phase.uncovered(shape, align)]
        wanted = set(self.spans.get(value, frozenset())) | {phase.group_of(a) for a in phase.uncovered(shape, align)}
        extra = [g for g in phase.groups if g in wanted and g not in used]
        if not used and not extra:
            # a value may still be a [1, 1] block (a keep_dims reduction): give the pointer a block shape
            extra = [g for g in phase.groups if g.mask]
        conds = [g.mask for g in used + extra if g.mask] + conds
        ptr = self.out_params[name] + (f" + {idx}" if idx != "0" else "") + "".join(
            f" + 0 * {g.flat}" for g in extra)
        v = value if COMPUTE_TYPE[dt] == STORAGE_TYPE[dt] else f"{value}.to({STORAGE_TYPE[dt]})"
        mask = " & ".join(dict.fromkeys(conds))
        hint = f', eviction_policy="{self.store_policy}"' if self.store_policy else ""
        self.emit(f"tl.store({ptr}, {v}, mask={mask}{hint})" if mask else f"tl.store({ptr}, {v}{hint})")

    def reduce(self, op: str, x: str, axis: int, keep_dims: bool, out: str, note: str = "") -> str:
        """Emit sum or amax of the block x along one tile dimension into a fresh variable for `out`."""
        kd = ", keep_dims=True" if keep_dims else ""
        var = self.fresh(out)
        if op == "sum":
            self.emit(f"{var} = tl.sum({x}, axis={axis}{kd}){note}")
            return var
        # torch.amax propagates NaN; tl.max on a GPU drops it (and a custom combine crawls when interpreted)
        src = self.fresh(out + "_in")
        self.emit(f"{src} = {x}")
        self.emit(f"{var} = tl.max({src}, axis={axis}{kd}){note}")
        self.emit(f'{var} = tl.where(tl.max(({src} != {src}).to(tl.int32), axis={axis}{kd}) > 0, float("nan"), {var})')
        return var

    def pointwise(self, op, operand) -> str:
        """Emit one pointwise op; operand(name) yields the value of a tensor of the spec."""
        spec = self.spec
        args = dict(op.args)
        out_dt = spec.dtype(op.out)
        vals: dict[str, str] = {}

        def val(v):
            if spec.is_tensor(v):
                vals[v] = operand(v)
                return vals[v]
            return literal(v)

        special = SPECIALIZED.get(op.op)
        if special is not None:
            expr = special(spec, args, val, out_dt)
        else:
            template = OPS[op.op].template
            expr = template.format(**{k: val(args[k]) for _, k, _, _ in Formatter().parse(template) if k})
        self.helpers |= {h for h in HELPERS if f"_{h}(" in expr}
        want = COMPUTE_TYPE[out_dt]
        if op.op != "cast" and any(COMPUTE_TYPE[spec.dtype(v)] != want for v in vals):
            expr = f"({expr}).to({want})"  # mixed operand types: land on the spec's result type
        var = self.fresh(op.out)
        self.emit(f"{var} = {expr}  # {op.op}" if len(expr) < 60 else f"{var} = {expr}")
        self.spans[var] = frozenset().union(*(self.spans.get(v, frozenset()) for v in vals.values()))
        return var

    def source(self, header: str, signature: str, more: tuple["Writer", str, str] | None = None) -> str:
        """The kernel's module; `more` = (writer, name, signature) adds a second jitted function (the
        finishing pass of a split reduction)."""
        helpers = "".join(HELPERS[h] for h in sorted(self.helpers | (more[0].helpers if more else set())))
        body = "\n".join(self.lines)
        extra = f"\n\n@triton.jit\ndef {more[1]}({more[2]}):\n" + "\n".join(more[0].lines) + "\n" if more else ""
        return (f"{header}\nimport triton\nimport triton.language as tl\n{helpers}\n\n"
                f"@triton.jit\ndef kernel({signature}):\n{body}\n{extra}")
