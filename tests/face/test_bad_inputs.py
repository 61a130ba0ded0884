"""Bad inputs, as a new user makes them: each raises an egraph_did error (ed.EgraphDidError) of the
class that fits, whose message names the tensor, the axis or the field that is wrong and says what to do.

One case per bad input (issue 12 lists the classes found: optimize given an int for the mesh or a
string for the cost model, a multinode cost model on a mesh of another rank count, a list or a meta
tensor for an input, an embedding index out of range, hand-edited plan JSON, launch with a lambda, a
memory bound of 0, like= a plan of another fusion or mesh, a plan JSON whose mesh was swapped, an extra
input key, a layer_norm weight error that blamed normalized_shape). A case is: a name, a function that
makes the bad call, the error class, and substrings the message must hold (what is named, what to do).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import egraph_did as ed
from egraph_did import DtypeError, MeshError, PlanError, ShapeError, ShardingError
from egraph_did.errors import CostModelError, UnknownNameError
from egraph_did.models import mlp, row_sum

P = ed.ParallelType
MESH2 = ed.DeviceMesh.arange(2)


@dataclass
class Bad:
    name: str
    call: Callable[[], object]
    error: type
    says: tuple[str, ...]  # substrings of the message: what is named and what to do
    xfail: str = ""


CASES: list[Bad] = []


def bad(name, error, *says, xfail=""):
    """Register the decorated function as one bad input."""
    def register(fn):
        CASES.append(Bad(name, fn, error, says, xfail))
        return fn
    return register


# ------------------------------------------------------------------ shared fusions and plans

def fusion_x(shape=(4, 6)):
    fd = ed.FusionDefinition()
    x = fd.define_tensor(shape, name="x")
    fd.add_output(fd.ops.relu(x), name="y")
    return fd, x


def embedding_fd(vocab_parallel=False):
    with ed.FusionDefinition() as fd:
        ids = fd.define_tensor((3,), torch.int64, name="ids")
        wte = fd.define_tensor((5, 4), name="wte")
        fd.add_output(fd.ops.embedding(ids, wte), name="y")
    if vocab_parallel:
        wte.set_device_mesh(MESH2).outer_split(0, 2).axis(0).parallelize(P.DIDx)
    return fd


def cross_entropy_fd():
    with ed.FusionDefinition() as fd:
        logits = fd.define_tensor((3, 5), name="logits")
        t = fd.define_tensor((3,), torch.int64, name="t")
        fd.add_output(fd.ops.cross_entropy(logits, t), name="loss")
    return fd


@functools.lru_cache(maxsize=None)
def plan_row_sum():
    """y = sum(x, 1) on 2 ranks, x [4, 6]."""
    return ed.optimize(row_sum(4, 6), MESH2)


@functools.lru_cache(maxsize=None)
def plan_collective():
    """x split along the summed axis, y pinned replicated: a collective on mesh axis 'x' of 2 ranks."""
    fd = row_sum(4, 6)
    fd["x"].set_device_mesh(MESH2).outer_split(1, 2).axis(1).parallelize(P.DIDx)
    fd["y"].set_device_mesh(MESH2)
    plan = ed.optimize(fd, MESH2)
    assert plan.collectives
    return plan


@functools.lru_cache(maxsize=None)
def plan_embedding(vocab_parallel=False):
    return ed.optimize(embedding_fd(vocab_parallel), MESH2)


@functools.lru_cache(maxsize=None)
def plan_cross_entropy():
    return ed.optimize(cross_entropy_fd(), MESH2)


def plan_json(plan=None) -> dict:
    return json.loads((plan or plan_row_sum()).to_json())


def load(d: dict):
    return ed.Plan.from_json(json.dumps(d))


X = torch.randn(4, 6)
WTE = torch.randn(5, 4)
LOGITS = torch.randn(3, 5)


# ------------------------------------------------------------------ meshes

@bad("mesh from an int", MeshError, "got the int 4", "DeviceMesh.arange(4)")
def _():
    return ed.DeviceMesh(4)


@bad("mesh with a repeated rank", MeshError, "rank(s) [0] appear more than once")
def _():
    return ed.DeviceMesh([0, 0])


@bad("ragged mesh", MeshError, "ragged nesting", "(2, 2)")
def _():
    return ed.DeviceMesh([[0, 1], [2]])


@bad("mesh of float ranks", MeshError, "ranks are ints", "0.5", "torch.arange(4)")
def _():
    return ed.DeviceMesh([0.5, 1])


@bad("mesh of bools", MeshError, "ranks are ints", "True")
def _():
    return ed.DeviceMesh([True, False])


@bad("mesh from a string", MeshError, "got the str '0,1'", "DeviceMesh.arange(4)")
def _():
    return ed.DeviceMesh("0,1")


@bad("mesh of zero ranks", MeshError, "positive number of ranks", "got 0")
def _():
    return ed.DeviceMesh.arange(0)


@bad("mesh of negative size", MeshError, "positive number of ranks", "got -2")
def _():
    return ed.DeviceMesh.arange(-2)


@bad("mesh with a negative rank", MeshError, "negative rank -1")
def _():
    return ed.DeviceMesh([-1, 0])


@bad("axis_names as one string", MeshError, "axis_names", "'tp'", "axis_names=('tp',)")
def _():
    return ed.DeviceMesh([0, 1], axis_names="tp")


@bad("too few axis names", MeshError, "1 axis names ('dp',)", "2-D mesh")
def _():
    return ed.DeviceMesh([[0, 1], [2, 3]], axis_names=("dp",))


@bad("duplicate axis names", MeshError, "duplicate axis names ('a', 'a')")
def _():
    return ed.DeviceMesh([[0, 1], [2, 3]], axis_names=("a", "a"))


@bad("4-D mesh", MeshError, "4-D meshes are not supported", "DIDx/DIDy/DIDz")
def _():
    return ed.DeviceMesh(torch.arange(16).reshape(2, 2, 2, 2))


@bad("unknown mesh axis name", MeshError, "mesh axis 'tp' does not exist", "axes are ('x',)")
def _():
    return MESH2.axis_size("tp")


@bad("rank outside the mesh", MeshError, "rank 9 is not in the mesh [0, 1]")
def _():
    return MESH2.coords(9)


@bad("mesh dict without shape", MeshError, "lacks the field 'shape'", "DeviceMesh.to_dict()")
def _():
    return ed.DeviceMesh.from_dict({"ranks": [0, 1], "axis_names": ["x"]})


@bad("axis names that are not strings", MeshError, "axis names must be non-empty strings", "[0, 1]")
def _():
    return ed.DeviceMesh([[0, 1], [2, 3]], axis_names=(0, 1))


# ------------------------------------------------------------------ building a fusion

@bad("negative extent", ShapeError, "define_tensor(a)", "axis 0", "extent -1", "non-negative ints")
def _():
    return ed.FusionDefinition().define_tensor((-1, 3), name="a")


@bad("float extent", ShapeError, "define_tensor(a)", "axis 0", "extent 2.0")
def _():
    return ed.FusionDefinition().define_tensor((2.0, 3), name="a")


@bad("duplicate tensor name", ShapeError, "'d' already exists", "pick another name")
def _():
    fd = ed.FusionDefinition()
    fd.define_tensor((2,), name="d")
    return fd.define_tensor((3,), name="d")


@bad("axis names of the wrong count", ShapeError, "define_tensor(a)", "1 axis names for 2 axes", "one name per axis")
def _():
    return ed.FusionDefinition().define_tensor((2, 3), name="a", axis_names=("s",))


@bad("a complex dtype", DtypeError, "define_tensor(z)", "complex64 is a complex dtype", "view_as_real")
def _():
    return ed.FusionDefinition().define_tensor((2,), dtype="complex64", name="z")


@bad("unknown dtype", DtypeError, "define_tensor(z)", "'float8'", "use one of float32")
def _():
    return ed.FusionDefinition().define_tensor((2,), dtype="float8", name="z")


@bad("tensor name not a string", ShapeError, "name must be a non-empty string", "got 3")
def _():
    return ed.FusionDefinition().define_tensor((2,), name=3)


@bad("output that is not a tensor", ShapeError, "add_output", "3 is not a tensor of this fusion")
def _():
    return ed.FusionDefinition().add_output(3, name="o")


@bad("input output under another name", ShapeError, "x is an input", "under its own name only")
def _():
    fd, x = fusion_x()
    return fd.add_output(x, name="x_out")


@bad("one tensor output twice", ShapeError, "y is already the output 'y'", "fd.ops.cast(t, t.dtype)")
def _():
    fd, _ = fusion_x()
    return fd.add_output(fd["y"], name="y2")


@bad("duplicate output name", ShapeError, "an output named 'y' already exists", "another name")
def _():
    fd, x = fusion_x()
    return fd.add_output(fd.ops.exp(x), name="y")


@bad("misspelled op", UnknownNameError, "no op 'gelo'", "did you mean 'gelu'")
def _():
    fd, x = fusion_x()
    return fd.ops.gelo(x)


@bad("unknown tensor name", UnknownNameError, "no tensor named 'z'", "tensors are x, y")
def _():
    fd, _ = fusion_x()
    return fd["z"]


@bad("op missing an argument", ShapeError, "add:", "missing a required argument: 'b'")
def _():
    fd, x = fusion_x()
    return fd.ops.add(x)


@bad("reduction axis out of range", ShapeError, "sum(x)", "axis 2 out of range", "x has 2 axes", "[-2, 2)")
def _():
    fd, x = fusion_x()
    return fd.ops.sum(x, 2)


@bad("reduction axis by name", ShapeError, "sum(x)", "axis must be an int", "'h'")
def _():
    fd, x = fusion_x()
    return fd.ops.sum(x, "h")


@bad("empty reduction dims", ShapeError, "sum(x)", "dims=() is ambiguous", "dims=None")
def _():
    fd, x = fusion_x()
    return fd.ops.sum(x, ())


@bad("broadcast mismatch", ShapeError, "add(x, z)", "axis 0 of z has extent 6", "axis 0 of x has 4", "equal or 1")
def _():
    fd, x = fusion_x()
    return fd.ops.add(x, fd.define_tensor((6, 4), name="z"))


@bad("linear in-features", ShapeError, "linear(x, w)", "w has in-features 5 but x's last axis is 6", "[out, in]")
def _():
    fd, x = fusion_x()
    return fd.ops.linear(x, fd.define_tensor((3, 5), name="w"))


@bad("linear 1-D weight", ShapeError, "linear(x, w)", "w must be 2-D [out, in]", "(6,)")
def _():
    fd, x = fusion_x()
    return fd.ops.linear(x, fd.define_tensor((6,), name="w"))


@bad("linear bias shape", ShapeError, "bias b has shape (6,)", "expected (3,)", "out-features")
def _():
    fd, x = fusion_x()
    return fd.ops.linear(x, fd.define_tensor((3, 6), name="w"), fd.define_tensor((6,), name="b"))


@bad("linear mixed dtypes", DtypeError, "linear(x, w)", "bfloat16", "float32", "cast them to one dtype")
def _():
    fd, x = fusion_x()
    return fd.ops.linear(x, fd.define_tensor((3, 6), torch.bfloat16, name="w"))


@bad("matmul contraction", ShapeError, "matmul(x, m)", "x's last axis is 6 but m's axis -2 is 4", "must be equal")
def _():
    fd, x = fusion_x()
    return fd.ops.matmul(x, fd.define_tensor((4, 6), name="m"))


@bad("reshape to another size", ShapeError, "reshape(x)", "cannot view shape (4, 6) (24 elements) as (5, 5)")
def _():
    fd, x = fusion_x()
    return fd.ops.reshape(x, (5, 5))


@bad("permute repeats an axis", ShapeError, "permute(x)", "(0, 0) is not a permutation of 2 axes")
def _():
    fd, x = fusion_x()
    return fd.ops.permute(x, (0, 0))


@bad("cast to a complex dtype", DtypeError, "cast(x)", "complex64 is a complex dtype", "view_as_real")
def _():
    fd, x = fusion_x()
    return fd.ops.cast(x, torch.complex64)


@bad("exp of integers", DtypeError, "exp(i)", "i is int64", "cast it first (fd.ops.cast)")
def _():
    fd = ed.FusionDefinition()
    return fd.ops.exp(fd.define_tensor((2,), torch.int64, name="i"))


@bad("sub of booleans", DtypeError, "sub(m, m)", "booleans", "cast to a number type first")
def _():
    fd = ed.FusionDefinition()
    m = fd.define_tensor((2,), torch.bool, name="m")
    return fd.ops.sub(m, m)


@bad("string operand", ShapeError, "add:", "'1' is neither a tensor of the fusion nor a Python number")
def _():
    fd, x = fusion_x()
    return fd.ops.add(x, "1")


@bad("operand of another fusion", ShapeError, "add: argument b (q) belongs to another fusion")
def _():
    fd, x = fusion_x()
    return fd.ops.add(x, ed.FusionDefinition().define_tensor((4, 6), name="q"))


@bad("sdpa on 3-D operands", ShapeError, "sdpa(q, q, q)", "q must be 4-D [batch, heads, seq, head_dim]")
def _():
    fd = ed.FusionDefinition()
    q = fd.define_tensor((2, 8, 16), name="q")
    return fd.ops.sdpa(q, q, q)


@bad("causal sdpa of unequal lengths", ShapeError, "sdpa(q, k, k)", "is_causal needs equal query and key lengths")
def _():
    fd = ed.FusionDefinition()
    q = fd.define_tensor((1, 2, 4, 8), name="q")
    k = fd.define_tensor((1, 2, 6, 8), name="k")
    return fd.ops.sdpa(q, k, k, is_causal=True)


@bad("float embedding indices", DtypeError, "embedding(f, wte)", "indices must be int32 or int64", "float32")
def _():
    fd = ed.FusionDefinition()
    return fd.ops.embedding(fd.define_tensor((3,), name="f"), fd.define_tensor((5, 4), name="wte"))


@bad("float cross_entropy target", DtypeError, "cross_entropy(logits, t)", "int64", "cast it")
def _():
    fd = ed.FusionDefinition()
    return fd.ops.cross_entropy(fd.define_tensor((3, 5), name="logits"), fd.define_tensor((3,), name="t"))


@bad("cross_entropy reduction", ShapeError, "cross_entropy(logits, t)", "reduction must be 'mean', 'sum' or 'none'")
def _():
    fd = ed.FusionDefinition()
    return fd.ops.cross_entropy(fd.define_tensor((3, 5), name="logits"),
                                fd.define_tensor((3,), torch.int64, name="t"), reduction="avg")


@bad("expand a wide axis", ShapeError, "expand(x)", "axis 1 has extent 6", "only extent-1 axes expand")
def _():
    fd, x = fusion_x()
    return fd.ops.expand(x, (4, 7))


@bad("gelu approximation", ShapeError, "gelu(x)", "approximate must be 'none' or 'tanh'", "'fast'")
def _():
    fd, x = fusion_x()
    return fd.ops.gelu(x, approximate="fast")


@bad("softmax axis out of range", ShapeError, "softmax(x)", "axis -3 out of range", "x has 2 axes")
def _():
    fd, x = fusion_x()
    return fd.ops.softmax(x, -3)


# issue 12: the error blamed a normalized_shape the user never passed
@bad("layer_norm weight of the wrong shape", ShapeError, "layer_norm(x)", "weight w has shape (5,)",
     "pass a weight of shape (6,)")
def _():
    fd, x = fusion_x()
    return fd.ops.layer_norm(x, weight=fd.define_tensor((5,), name="w"))


@bad("layer_norm bias of the wrong shape", ShapeError, "layer_norm(x)", "bias b has shape (5,)",
     "pass a bias of shape (6,)")
def _():
    fd, x = fusion_x()
    return fd.ops.layer_norm(x, weight=fd.define_tensor((6,), name="w"), bias=fd.define_tensor((5,), name="b"))


@bad("layer_norm normalized_shape", ShapeError, "layer_norm(x)", "normalized_shape (5,) must match",
     "normalized_shape=(6,)")
def _():
    fd, x = fusion_x()
    return fd.ops.layer_norm(x, normalized_shape=(5,))


@bad("rms_norm weight against normalized_shape", ShapeError, "rms_norm(x)", "weight w has shape (4, 6)",
     "pass a weight of shape (6,)")
def _():
    fd, x = fusion_x()
    return fd.ops.rms_norm(x, normalized_shape=6, weight=fd.define_tensor((4, 6), name="w"))


@bad("keepdim as a string", ShapeError, "sum: keepdim must be a bool", "'yes'")
def _():
    fd, x = fusion_x()
    return fd.ops.sum(x, 1, keepdim="yes")


@bad("eps as a string", ShapeError, "layer_norm: eps must be a number", "'1e-5'")
def _():
    fd, x = fusion_x()
    return fd.ops.layer_norm(x, eps="1e-5")


@bad("is_causal as an int", ShapeError, "sdpa: is_causal must be a bool", "1")
def _():
    fd = ed.FusionDefinition()
    q = fd.define_tensor((1, 2, 4, 8), name="q")
    return fd.ops.sdpa(q, q, q, is_causal=1)


@bad("normalized_shape as a string", ShapeError, "rms_norm(x)", "normalized_shape must be an int or a tuple of ints",
     "'6'")
def _():
    fd, x = fusion_x()
    return fd.ops.rms_norm(x, normalized_shape="6")


@bad("take_along_axis with int32 index", DtypeError, "take_along_axis(x, ix)", "index must be int64", "int32")
def _():
    fd, x = fusion_x()
    return fd.ops.take_along_axis(x, fd.define_tensor((4, 1), torch.int32, name="ix"), 1)


@bad("cross_entropy target of the wrong length", ShapeError, "cross_entropy(logits, t)", "target has shape (3,)",
     "expected (2,)")
def _():
    fd = ed.FusionDefinition()
    return fd.ops.cross_entropy(fd.define_tensor((2, 5), name="logits"),
                                fd.define_tensor((3,), torch.int64, name="t"))


# ------------------------------------------------------------------ pins and shards

@bad("split of an axis out of range", ShardingError, "x", "loop axis 5 out of range", "2 axes")
def _():
    _, x = fusion_x()
    return x.set_device_mesh(MESH2).outer_split(5, 2)


@bad("split by zero", ShardingError, "split of x axis 0", "factor must be a positive int", "got 0")
def _():
    _, x = fusion_x()
    return x.set_device_mesh(MESH2).outer_split(0, 0)


@bad("parallel type as a string", ShardingError, "expected a ParallelType", "'DIDx'")
def _():
    _, x = fusion_x()
    return x.set_device_mesh(MESH2).outer_split(0, 2).axis(0).parallelize("DIDx")


@bad("DIDx on an unsplit axis", ShardingError, "x: loop axis", "binds mesh axis 'x' of size 2",
     "use outer_split(axis, 2)")
def _():
    _, x = fusion_x()
    return x.set_device_mesh(MESH2).parallelize(0, P.DIDx)


@bad("mesh given as an int", MeshError, "x.set_device_mesh", "expected a DeviceMesh", "int")
def _():
    _, x = fusion_x()
    return x.set_device_mesh(4)


# issue 12: DIDy/DIDz on a mesh without that axis names no tensor (the message is built in ir.py)
@bad("DIDy on a 1-D mesh", MeshError, "x: ", "DIDy needs a mesh of at least 2 dimensions")
def _():
    _, x = fusion_x()
    return x.set_device_mesh(MESH2).outer_split(0, 2).axis(0).parallelize(P.DIDy)


@bad("partial before a mesh", ShardingError, "x.add_partial", "set_device_mesh first")
def _():
    _, x = fusion_x()
    return x.add_partial(P.DIDx)


# issue 12: a non-outermost or inner-first DID split now plans through a reshaped view of the tensor; where
# its splits do not divide the extent, no reshape holds it, and the refusal says what to do
@bad("non-outermost split of an odd axis", PlanError, "x: the loop domain", "non-outermost DID split",
     "axis 0 (extent 5)", "no reshape of x", "outer_split(axis, mesh size)", "leave it free")
def _():
    fd, x = fusion_x((5, 6))
    x.set_device_mesh(MESH2).outer_split(0, 2).outer_split(1, 2).parallelize(1, P.DIDx)
    return ed.optimize(fd, MESH2)


@bad("inner-first split of an axis no reshape nests", PlanError, "x: the loop domain",
     "inner mesh axis splitting first", "axis 0 (extent 5)", "no reshape of x", "leave it free")
def _():
    fd, x = fusion_x((5, 6))
    mesh = ed.DeviceMesh(torch.arange(4).reshape(2, 2))
    x.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, P.DIDx).outer_split(1, 2).parallelize(1, P.DIDy)
    return ed.optimize(fd, mesh)


@bad("partial avg", ShardingError, "x.add_partial", "got 'avg'", "pending sum of x / n", "reduce='sum'")
def _():
    _, x = fusion_x()
    return x.set_device_mesh(MESH2).add_partial(P.DIDx, reduce="avg")


@bad("partial prod", ShardingError, "x.add_partial", "got 'prod'", "pin the tensor replicated")
def _():
    _, x = fusion_x()
    return x.set_device_mesh(MESH2).add_partial(P.DIDx, reduce="prod")


@bad("a pending sum and a pending max on one tensor", PlanError, "y: the loop domain", "do not commute",
     "pin one partial")
def _():
    fd, _ = fusion_x()
    mesh = ed.DeviceMesh([[0, 1], [2, 3]])
    fd["y"].set_device_mesh(mesh).add_partial(P.DIDy).add_partial(P.DIDx, "max")
    return ed.optimize(fd, mesh)


@bad("pin on a sub-mesh", PlanError, "x is pinned to DeviceMesh(x=1)", "a sub-mesh", "set_device_mesh(mesh)")
def _():
    fd, x = fusion_x()
    x.set_device_mesh(ed.DeviceMesh([0]))
    return ed.optimize(fd, MESH2)


@bad("pin on another mesh", PlanError, "x is pinned to DeviceMesh(x=4)", "optimized for DeviceMesh(x=2)")
def _():
    fd, x = fusion_x()
    x.set_device_mesh(ed.DeviceMesh.arange(4))
    return ed.optimize(fd, MESH2)


def _split_x():
    _, x = fusion_x()
    return x.set_device_mesh(MESH2).outer_split(0, 2).axis(0).parallelize(P.DIDx)


@bad("unshard too few shards", ShardingError, "unshard_tensor(x)", "got 1 shards for the 2 ranks", "one per rank")
def _():
    return ed.unshard_tensor([torch.randn(2, 6)], _split_x())


@bad("unshard a shard of the wrong shape", ShapeError, "unshard_tensor(x)", "rank 1's shard has shape (3, 6)",
     "gives it (2, 6)")
def _():
    return ed.unshard_tensor([torch.randn(2, 6), torch.randn(3, 6)], _split_x())


@bad("shard a tensor of the wrong shape", ShapeError, "shard_tensor", "x has logical shape (4, 6)", "(4, 7)")
def _():
    return ed.shard_tensor(torch.randn(4, 7), _split_x(), 0)


@bad("shard a list", ShapeError, "shard_tensor", "expected a torch.Tensor for x", "list")
def _():
    return ed.shard_tensor([[1.0]], _split_x(), 0)


@bad("shard for a rank outside the mesh", MeshError, "rank 5 is not in the mesh")
def _():
    return ed.shard_tensor(X, _split_x(), 5)


# ------------------------------------------------------------------ optimize's arguments

@bad("optimize on an int mesh", MeshError, "optimize: mesh must be an ed.DeviceMesh", "ed.DeviceMesh.arange(4)")
def _():
    return ed.optimize(row_sum(4, 6), 4)


@bad("cost model as a string", CostModelError, "cost_model must be a CostModel", "'h200'", "ed.CostModel.h200()")
def _():
    return ed.optimize(row_sum(4, 6), MESH2, cost_model="h200")


@bad("multinode model on a 1-D mesh", CostModelError, "h200-multinode has 2 links", "DeviceMesh(x=2) is 1-D",
     "2-D mesh", "CostModel.h200()")
def _():
    return ed.optimize(row_sum(4, 6), MESH2, cost_model=ed.CostModel.h200_multinode())


@bad("multinode model on a 3-D mesh", CostModelError, "h200-multinode has 2 links", "is 3-D", "2-D mesh")
def _():
    mesh = ed.DeviceMesh(torch.arange(8).reshape(2, 2, 2))
    return ed.optimize(row_sum(4, 6), mesh, cost_model=ed.CostModel.h200_multinode())


@bad("unknown extractor", PlanError, "unknown extractor 'best'", "'greedy'", "'exact'")
def _():
    return ed.optimize(row_sum(4, 6), MESH2, extractor="best")


@bad("like= a string", PlanError, "like= takes a Plan", "'plan'", "ed.Plan.from_json")
def _():
    return ed.optimize(row_sum(4, 6), MESH2, like="plan")


@bad("like= a plan of another fusion", PlanError, "like plan is of another fusion", "['x']", "['w1', 'w2', 'x']",
     "pass a plan of this fusion")
def _():
    return ed.optimize(mlp(8, 16), MESH2, like=plan_row_sum())


@bad("like= a plan of another mesh", PlanError, "optimized for DeviceMesh(x=2)", "this call is for DeviceMesh(x=4)",
     "without like=")
def _():
    return ed.optimize(row_sum(8, 12), ed.DeviceMesh.arange(4), like=plan_row_sum())


@bad("like= a plan whose input has another rank", PlanError, "input x has 3 axes", "2", "another fusion")
def _():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((2, 4, 6), name="x")
        fd.add_output(fd.ops.sum(x, 2), name="y")
    return ed.optimize(fd, MESH2, like=plan_row_sum())


@bad("optimize a string", PlanError, "optimize: expected a FusionDefinition", "ed.FusionDefinition()")
def _():
    return ed.optimize("fd", MESH2)


@bad("optimize a fusion without outputs", PlanError, "the fusion has no outputs", "fd.add_output")
def _():
    fd = ed.FusionDefinition()
    fd.define_tensor((2,), name="x")
    return ed.optimize(fd, MESH2)


# issue 12: a bound of 0 printed "0.00 GiB" on both sides of the error
@bad("memory bound of 0", CostModelError, "memory_limit must be a positive number of bytes", "got 0",
     "80 * 2**30")
def _():
    return ed.CostModel.h200(memory_limit=0)


@bad("negative memory bound", CostModelError, "memory_limit", "got -1", "None for no bound")
def _():
    return ed.CostModel.h200(memory_limit=-1)


@bad("memory bound as a string", CostModelError, "memory_limit", "'80GB'", "80 * 2**30")
def _():
    return ed.CostModel.h200(memory_limit="80GB")


@bad("link of zero bandwidth", CostModelError, "Link ib", "bandwidth must be a positive number", "got 0")
def _():
    return ed.Link("ib", alpha=1e-6, bandwidth=0)


@bad("cost model without links", CostModelError, "CostModel mine", "links must be a non-empty tuple of Link")
def _():
    return ed.CostModel("mine", (("float32", 1e12),), 1e12, 1e-6, ())


@bad("peak_flops as a dict", CostModelError, "CostModel mine", "peak_flops must be a tuple of (dtype name, FLOP/s)",
     "('float32', 60e12)")
def _():
    return ed.CostModel("mine", {"float32": 1e12}, 1e12, 1e-6, (ed.Link("l", 1e-6, 1e9),))


@bad("cost model without CostModel's methods", CostModelError, "cost_model must be a CostModel", "collective_time",
     "the object")
def _():
    return ed.optimize(row_sum(4, 6), MESH2, cost_model=object())


@bad("a collective kind misspelled", PlanError, "unknown collective kind 'all_reduce'", "allreduce")
def _():
    return plan_row_sum().count("all_reduce")


@bad("cost model dict without a field", CostModelError, "cost model dict 'mine'", "lacks the field 'peak_flops'",
     "CostModel.to_dict()")
def _():
    return ed.CostModel.from_dict({"name": "mine"})


# ------------------------------------------------------------------ evaluate's and simulate's inputs

@bad("simulate: a list for a tensor", ShapeError, "simulate: input 'x' must be a torch.Tensor", "list",
     "torch.as_tensor")
def _():
    return ed.simulate(plan_row_sum(), {"x": X.tolist()})


# issue 12: meta inputs came back as meta outputs
@bad("simulate: a meta tensor", ShapeError, "input 'x' is on the meta device", "pass a tensor with data")
def _():
    return ed.simulate(plan_row_sum(), {"x": X.to("meta")})


@bad("simulate: an extra input", ShapeError, "unknown input(s) ['z']", "the plan takes ['x']",
     "drop the extra key")
def _():
    return ed.simulate(plan_row_sum(), {"x": X, "z": X})


@bad("simulate: a missing input", ShapeError, "missing input(s) ['x']", "the plan takes ['x']")
def _():
    return ed.simulate(plan_row_sum(), {})


@bad("simulate: a wrong shape", ShapeError, "input 'x' has shape (6, 4)", "the plan expects (4, 6)", "like=plan")
def _():
    return ed.simulate(plan_row_sum(), {"x": torch.randn(6, 4)})


@bad("simulate: a wrong dtype", DtypeError, "input 'x' is float64", "the plan expects float32", "cast it")
def _():
    return ed.simulate(plan_row_sum(), {"x": X.double()})


@bad("simulate a fusion", PlanError, "simulate: expected a Plan", "FusionDefinition", "ed.evaluate(fd, inputs)",
     "ed.optimize(fd, mesh)")
def _():
    return ed.simulate(row_sum(4, 6), {"x": X})


@bad("simulate: lowered as a string", PlanError, "simulate: lowered must be True", "or False", "'no'")
def _():
    return ed.simulate(plan_row_sum(), {"x": X}, lowered="no")


@bad("simulate: inputs as a list", ShapeError, "inputs must be a dict", "['x']", "list")
def _():
    return ed.simulate(plan_row_sum(), [X])


# issue 12: IndexError from torch, no tensor named
@bad("simulate: embedding index too large", ShapeError, "embedding(ids, wte)", "ids holds 5", "wte has 5 rows",
     "[0, 5)", "fix ids")
def _():
    return ed.simulate(plan_embedding(), {"ids": torch.tensor([0, 5, 1]), "wte": WTE})


@bad("simulate: index beyond a vocab-parallel table", ShapeError, "ids holds 7", "wte has 5 rows", "[0, 5)")
def _():
    return ed.simulate(plan_embedding(True), {"ids": torch.tensor([0, 7, 1]), "wte": WTE})


@bad("simulate (eager): negative embedding index", ShapeError, "ids holds -1", "[0, 5)")
def _():
    return ed.simulate(plan_embedding(True), {"ids": torch.tensor([0, -1, 1]), "wte": WTE}, lowered=False)


@bad("simulate: cross_entropy class too large", ShapeError, "cross_entropy(logits, t)", "t holds 9",
     "logits has 5 classes", "fix t")
def _():
    return ed.simulate(plan_cross_entropy(), {"logits": LOGITS, "t": torch.tensor([0, 9, 1])})


@bad("evaluate: embedding index too large", ShapeError, "embedding(ids, wte)", "ids holds 5 (at [1])", "[0, 5)")
def _():
    return ed.evaluate(embedding_fd(), {"ids": torch.tensor([0, 5, 1]), "wte": WTE})


@bad("evaluate: negative embedding index", ShapeError, "ids holds -2", "wte has 5 rows")
def _():
    return ed.evaluate(embedding_fd(), {"ids": torch.tensor([0, -2, 1]), "wte": WTE})


@bad("evaluate: ignore_index target", ShapeError, "t holds -100", "pass their value as ignore_index")
def _():
    return ed.evaluate(cross_entropy_fd(), {"logits": LOGITS, "t": torch.tensor([0, -100, 1])})


@bad("evaluate: a list for a tensor", ShapeError, "input 'x'", "expected a torch.Tensor, got list", "torch.as_tensor")
def _():
    return ed.evaluate(row_sum(4, 6), {"x": X.tolist()})


@bad("evaluate: an extra input", ShapeError, "unknown input(s) ['z']", "the fusion's inputs are ['x']")
def _():
    return ed.evaluate(row_sum(4, 6), {"x": X, "z": X})


@bad("evaluate: a missing input", ShapeError, "missing input 'x' of shape (4, 6)")
def _():
    return ed.evaluate(row_sum(4, 6), {})


@bad("evaluate: a wrong dtype", DtypeError, "input 'x'", "declared dtype torch.float32", "cast it")
def _():
    return ed.evaluate(row_sum(4, 6), {"x": X.double()})


@bad("evaluate: a wrong shape", ShapeError, "input 'x': declared shape (4, 6), got (6, 4)", "define_tensor((6, 4)")
def _():
    return ed.evaluate(row_sum(4, 6), {"x": X.t()})


@bad("evaluate a plan", PlanError, "evaluate: expected a FusionDefinition", "ed.simulate(plan, inputs)")
def _():
    return ed.evaluate(plan_row_sum(), {"x": X})


@bad("evaluate: inputs as a list", ShapeError, "inputs must be a dict", "['x']")
def _():
    return ed.evaluate(row_sum(4, 6), [X])


# ------------------------------------------------------------------ plan.run (checked before any collective)

def _bad_runs(rank, plan_json):
    """Run on one gloo rank: each bad call's exception, returned (exceptions pickle home)."""
    plan = ed.Plan.from_json(plan_json)
    x = torch.randn(4, 6)
    calls = {"extra": lambda: plan.run({"x": x, "z": x}), "meta": lambda: plan.run({"x": x.to("meta")}),
             "list": lambda: plan.run({"x": x.tolist()}), "missing": lambda: plan.run({}),
             "dtype": lambda: plan.run({"x": x.double()}),
             "local shape": lambda: plan.run({"x": torch.randn(3, 6)}, inputs="local"),
             "index": lambda: plan_embedding_1().run({"ids": torch.tensor([0, 5, 1]), "wte": WTE})}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - brought home to be checked
            out[name] = e
    return out


def plan_embedding_1():
    return ed.optimize(embedding_fd(), ed.DeviceMesh.arange(1))


@functools.lru_cache(maxsize=None)
def bad_runs() -> dict:
    plan = ed.optimize(row_sum(4, 6), ed.DeviceMesh.arange(1))
    return ed.launch(_bad_runs, nprocs=1, args=(plan.to_json(),), timeout=300)[0]


def _raise_run(name):
    e = bad_runs()[name]
    if e is None:
        raise AssertionError(f"plan.run accepted the bad input ({name})")
    raise e


@bad("run: an extra input", ShapeError, "run_plan on rank 0: unknown input(s) ['z']", "the plan takes ['x']",
     "drop the extra key")
def _():
    _raise_run("extra")


@bad("run: a meta tensor", ShapeError, "run_plan on rank 0: input 'x' is on the meta device",
     "pass a tensor with data")
def _():
    _raise_run("meta")


@bad("run: a list for a tensor", ShapeError, "input 'x' must be a torch.Tensor", "torch.as_tensor")
def _():
    _raise_run("list")


@bad("run: a missing input", ShapeError, "missing input(s) ['x']", "the plan takes ['x']")
def _():
    _raise_run("missing")


@bad("run: a wrong dtype", DtypeError, "input 'x' is float64", "the plan expects float32", "cast it")
def _():
    _raise_run("dtype")


@bad("run: a local shard of the wrong shape", ShapeError, "input 'x' on rank 0", "(3, 6)", "(4, 6)",
     "ed.shard_tensor")
def _():
    _raise_run("local shape")


@bad("run: embedding index too large", ShapeError, "embedding(ids, wte)", "ids holds 5", "on rank 0", "[0, 5)")
def _():
    _raise_run("index")


@bad("run: unknown inputs kind", PlanError, "inputs_kind must be one of", "'shards'")
def _():
    return plan_row_sum().run({"x": X}, inputs="shards")


@bad("run: unknown outputs kind", PlanError, "outputs_kind must be one of", "'tensor'")
def _():
    return plan_row_sum().run({"x": X}, outputs="tensor")


@bad("run: a step timeout of 0", PlanError, "step_timeout must be a positive number of seconds", "got 0")
def _():
    return plan_row_sum().run({"x": X}, step_timeout=0)


@bad("run outside a process group", PlanError, "no default process group", "init_process_group", "launch")
def _():
    return plan_row_sum().run({"x": X})


# ------------------------------------------------------------------ plan JSON, hand-edited

for _field in ("mesh", "cost_model", "values", "steps", "inputs", "outputs"):
    @bad(f"plan JSON without {_field}", PlanError, f"lacks the field '{_field}'", "plan.to_json()")
    def _(_field=_field):
        d = plan_json()
        del d[_field]
        return load(d)


@bad("plan JSON: steps not a list", PlanError, "field 'steps' must be a list", "dict")
def _():
    d = plan_json()
    d["steps"] = {"0": d["steps"][0]}
    return load(d)


@bad("plan JSON: a step without its op", PlanError, "steps[0] (compute) lacks the field 'op'", "add the field")
def _():
    d = plan_json()
    del d["steps"][0]["op"]
    return load(d)


@bad("plan JSON: a value without its shape", PlanError, "values['x:S0'] lacks the field 'shape'")
def _():
    d = plan_json()
    del d["values"]["x:S0"]["shape"]
    return load(d)


@bad("plan JSON: a step that is not an object", PlanError, "steps[0] must be an object", "str")
def _():
    d = plan_json()
    d["steps"][0] = "sum"
    return load(d)


@bad("plan JSON: an unknown step type", PlanError, "step 0: unknown step type 'kernel'", "'compute'")
def _():
    d = plan_json()
    d["steps"][0]["step"] = "kernel"
    return load(d)


@bad("plan JSON: an unknown op", PlanError, "step 0: unknown op 'summ'")
def _():
    d = plan_json()
    d["steps"][0]["op"] = "summ"
    return load(d)


@bad("plan JSON: a step reading an unknown value", PlanError, "step 0 refers to unknown value(s) ['x:S9']")
def _():
    d = plan_json()
    d["steps"][0]["args"][0][1] = "x:S9"
    return load(d)


@bad("plan JSON: a bad layout code", PlanError, "value x:S0", "bad layout 'Q7'", "e.g. '[S(0)]' or '[R, S(1)]'")
def _():
    d = plan_json()
    d["values"]["x:S0"]["layout"] = "Q7"
    return load(d)


@bad("plan JSON: a layout splitting an axis the tensor lacks", PlanError, "value x:S0", "bad layout 'S9'",
     "2-D tensor")
def _():
    d = plan_json()
    d["values"]["x:S0"]["layout"] = "S9"
    return load(d)


@bad("plan JSON: an input of unknown values", PlanError, "inputs['x']", "keys of 'values'")
def _():
    d = plan_json()
    d["inputs"]["x"] = ["x:S9"]
    return load(d)


@bad("plan JSON: an output of an unknown value", PlanError, "outputs['y']", "must name a value")
def _():
    d = plan_json()
    d["outputs"]["y"] = "y:R"
    return load(d)


@bad("plan JSON: a collective with an unknown field", PlanError, "(collective)", "unknown field(s) ['ranks']")
def _():
    d = plan_json(plan_collective())
    next(s for s in d["steps"] if s["step"] == "collective")["ranks"] = [0, 1]
    return load(d)


# issue 12: a plan JSON whose mesh was swapped was accepted silently
@bad("plan JSON: mesh swapped for a larger one", PlanError, "was planned for 2 ranks on mesh axis 'x'",
     "DeviceMesh(x=4) has 4", "re-optimize")
def _():
    d = plan_json(plan_collective())
    d["mesh"] = ed.DeviceMesh.arange(4).to_dict()
    return load(d)


@bad("plan JSON: mesh axis renamed", PlanError, "runs on mesh axis 'x'", "is 'tp'", "re-optimize")
def _():
    d = plan_json(plan_collective())
    d["mesh"] = ed.DeviceMesh.arange(2, "tp").to_dict()
    return load(d)


@bad("plan JSON: mesh of another rank count", PlanError, "value x:S0", "does not match the 2-D mesh")
def _():
    d = plan_json()
    d["mesh"] = ed.DeviceMesh([[0, 1], [2, 3]]).to_dict()
    return load(d)


@bad("plan JSON: a memory bound of 0", PlanError, "plan JSON", "memory_limit must be a positive number")
def _():
    d = plan_json()
    d["cost_model"]["memory_limit"] = 0
    return load(d)


@bad("plan JSON: a complex dtype", PlanError, "values['x:S0'].dtype", "complex64 is a complex dtype")
def _():
    d = plan_json()
    d["values"]["x:S0"]["dtype"] = "complex64"
    return load(d)


@bad("plan JSON: a negative extent", PlanError, "values['x:S0'].shape must list non-negative ints", "[4, -6]")
def _():
    d = plan_json()
    d["values"]["x:S0"]["shape"] = [4, -6]
    return load(d)


@bad("plan JSON: an unknown collective kind", PlanError, "steps[", "(collective)",
     "unknown collective kind 'all_reduce'", "kinds are allgather")
def _():
    d = plan_json(plan_collective())
    c = next(s for s in d["steps"] if s["step"] == "collective")
    c["kind"] = "all_reduce"
    return load(d)


@bad("plan JSON of another format version", PlanError, "expected format 'egraph-did-plan/2'",
     "it says format 'egraph-did-plan/3'")
def _():
    d = plan_json()
    d["format"] = "egraph-did-plan/3"
    return load(d)


@bad("plan JSON: a value under another name", PlanError, "values['x:S0'] has name 'x:R'", "its key")
def _():
    d = plan_json()
    d["values"]["x:S0"]["name"] = "x:R"
    return load(d)


@bad("plan JSON: a collective on a mesh axis the mesh lacks", PlanError, "runs on mesh axis 1",
     "has 1 axis(es)", "re-optimize")
def _():
    d = plan_json(plan_collective())
    next(s for s in d["steps"] if s["step"] == "collective")["mesh_axis"] = 1
    return load(d)


@bad("plan JSON given as a dict", PlanError, "takes the JSON text", "json.dumps(d)")
def _():
    return ed.Plan.from_json(plan_json())


@bad("plan JSON that does not parse", PlanError, "plan JSON does not parse")
def _():
    return ed.Plan.from_json("{nope")


@bad("JSON of something else", PlanError, "not an egraph-did plan", "egraph-did-plan/2")
def _():
    return ed.Plan.from_json("[]")


# ------------------------------------------------------------------ launch (checked before any process starts)

def _work(rank):  # module level: picklable
    return rank


# issue 12: a lambda failed with AssertionError("can only join a started process")
@bad("launch a lambda", ed.LaunchError, "<lambda>", "cannot be sent to the spawned processes",
     "define fn at module level")
def _():
    return ed.launch(lambda rank: rank, nprocs=2)


@bad("launch an unpicklable argument", ed.LaunchError, "args[0]", "cannot be pickled", "plain data")
def _():
    return ed.launch(_work, nprocs=2, args=((i for i in range(3)),))


@bad("launch zero processes", ed.LaunchError, "nprocs must be a positive int", "got 0")
def _():
    return ed.launch(_work, nprocs=0)


@bad("launch on an unknown backend", ed.LaunchError, "backend must be one of", "'mpi'")
def _():
    return ed.launch(_work, nprocs=2, backend="mpi")


@bad("launch with args not a tuple", ed.LaunchError, "args must be a tuple", "args=(5,)")
def _():
    return ed.launch(_work, nprocs=2, args=5)


@bad("launch something not callable", ed.LaunchError, "fn must be a function fn(rank, *args)", "int")
def _():
    return ed.launch(5, nprocs=2)


@bad("launch with a negative timeout", ed.LaunchError, "timeout must be a positive number of seconds", "-1")
def _():
    return ed.launch(_work, nprocs=2, timeout=-1)


if not torch.cuda.is_available():
    @bad("launch on NCCL without GPUs", ed.LaunchError, "backend='nccl' needs CUDA GPUs", "backend='gloo'")
    def _():
        return ed.launch(_work, nprocs=2, backend="nccl")


# ------------------------------------------------------------------ the test

def test_at_least_sixty_bad_inputs():
    assert len(CASES) >= 60, len(CASES)
    assert len({c.name for c in CASES}) == len(CASES), "case names repeat"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)]
                                               if c.xfail else []) for c in CASES])
def test_bad_input_raises_a_clear_egraph_did_error(case: Bad):
    with pytest.raises(ed.EgraphDidError) as info:
        case.call()
    err = info.value
    assert isinstance(err, case.error), f"{type(err).__name__} is not a {case.error.__name__}: {err}"
    msg = str(err)
    missing = [s for s in case.says if s not in msg]
    assert not missing, f"the message lacks {missing}:\n{msg}"
