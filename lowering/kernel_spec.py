"""KernelSpec: what a Triton scheduler compiles. A small DAG of primitive ops over one rank's local
tensors (local shapes: DID axes are extent 1 and dropped, uneven shards give their own shapes).

Segmentation (lowering/segment.py) builds specs from a plan's fusible steps, decomposing composites
(gelu, softmax, layer_norm, rms_norm, ...) into the primitives below; schedulers
(lowering/schedulers.py) classify a spec and generate, compile and launch its kernel.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from egraph_did.ops import ops_where

# Primitive ops a kernel may hold: the op table's kernel primitives (a template or a permutation).
POINTWISE_UNARY = ops_where(kind="pointwise", arity=1, in_kernels=True)
POINTWISE_BINARY = ops_where(kind="pointwise", arity=2, in_kernels=True)
REDUCTIONS = ops_where(kind="reduction", in_kernels=True)  # attrs: dims (tuple of ints), keepdim (bool)
TRANSPOSES = ops_where(permutes=True)
KERNEL_OPS = ops_where(in_kernels=True)


@dataclass(frozen=True)
class KernelOp:
    """out = op(**args); an arg is the name of a tensor of the spec or a literal (number, tuple, dtype).

    >>> op = KernelOp("y", "sum", (("x", "in0"), ("dims", (1,)), ("keepdim", False)))
    >>> op.op, dict(op.args)["x"]
    ('sum', 'in0')
    """

    out: str
    op: str
    args: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class KernelSpec:
    """inputs and outputs are tensor names; tensors maps every name (inputs, intermediates, outputs) to
    its local (shape, dtype); ops are in topological order.

    >>> import egraph_did as ed
    >>> from egraph_did.lowering.segment import spec_from_fusion
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((4, 8), name="x")
    ...     fd.add_output(fd.ops.sum(fd.ops.relu(x), 1), name="y")
    >>> spec = spec_from_fusion(fd.fusion)
    >>> spec.inputs, [op.op for op in spec.ops], spec.shape("y"), spec.is_tensor("relu_0"), len(spec.key())
    (('x',), ['relu', 'sum'], (4,), True, 16)
    """

    inputs: tuple[str, ...]
    ops: tuple[KernelOp, ...]
    outputs: tuple[str, ...]
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    def shape(self, name: str) -> tuple[int, ...]:
        """The local shape of tensor `name`."""
        return next(s for n, s, _ in self.tensors if n == name)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of tensor `name`."""
        return next(d for n, _, d in self.tensors if n == name)

    def is_tensor(self, v) -> bool:
        """Whether an op argument names a tensor of the spec (rather than being a literal)."""
        return isinstance(v, str) and any(n == v for n, _, _ in self.tensors)

    def key(self) -> str:
        """A content hash: equal specs share one compiled kernel."""
        def enc(v):
            return str(v) if isinstance(v, torch.dtype) else v
        body = json.dumps([self.inputs, [(o.out, o.op, [(k, enc(v)) for k, v in o.args]) for o in self.ops],
                           self.outputs, [(n, s, str(d)) for n, s, d in self.tensors]], default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:16]
