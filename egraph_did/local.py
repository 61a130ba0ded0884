"""Local kernels: run one op on one rank's shards, as a plan's compute step says.

The op's reference on local tensors, after the op's shape attributes are made local (OpDef.local_attrs);
or, where the step's rule needs the rank's place, the rank-local variant the step names (a LocalKernel
declared beside its op in egraph_did/ops.py). This module knows no op by name. Shared by simulate()
and the runtime.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .ops import OPS
from .shards import Operand, RankContext


def run_local(op: str, args: dict[str, Any], operands: dict[str, Operand], outputs: list[Operand],
              flags: Mapping[str, Sequence[int]], ctx: RankContext) -> tuple[torch.Tensor, ...]:
    """One rank's part of a compute step. args holds local tensors (by parameter) and literals; flags
    maps the local kernel the step names to the mesh axes it applies on (a plan's `step.flags`).

    >>> import torch
    >>> from egraph_did.layout import Layout
    >>> from egraph_did.mesh import DeviceMesh
    >>> x, y = Operand((2, 8), Layout.from_code("S1")), Operand((2,), Layout.from_code("P"))
    >>> ctx = RankContext(DeviceMesh.arange(2), rank=1)  # it holds 4 of x's 8 columns
    >>> args = {"x": torch.ones(2, 4), "dims": 1, "keepdim": False}
    >>> run_local("mean", args, {"x": x}, [y], {"global_count": [0]}, ctx)  # local sum / global count 8
    (tensor([0.5000, 0.5000]),)
    """
    opdef = OPS[op]
    args = dict(args)
    if opdef.local_attrs is not None:
        args.update(opdef.local_attrs(args, [ctx.local_shape(o) for o in outputs]))
    kernels = [(opdef.local_kernel(name), axes) for name, axes in flags.items()]
    # a local kernel computes the whole op (LocalKernel): two of them on one step would each claim it
    assert len(kernels) <= 1, f"{op}: local kernels {sorted(flags)} cannot combine in one step"
    if kernels:
        kernel, axes = kernels[0]
        out = kernel.fn(args, operands, outputs, ctx, list(axes))
    else:
        out = opdef.reference(**args)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
