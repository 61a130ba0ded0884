"""Calibrate the cost model's links from measured collectives.

Inside a process group, `measure_collectives` times every communicating collective of the registry
(collectives.KINDS: allgather, reduce_scatter, allreduce, alltoall) through its own `run`, the call the
runtime makes, over a range of sizes; `fit_link` fits the link of the cost model's alpha-beta model
(cost.Link.time, with each kind's phases and factor from its entry) by non-negative least squares;
`calibrated` returns a CostModel with the fitted link, which `save_preset` / `load_preset` keep as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from . import collectives
from .collectives import AxisGroup, Move
from .cost import CostModel, Link
from .errors import PlanError
from .layout import Layout
from .mesh import DeviceMesh
from .shards import Operand, RankContext

KINDS = collectives.communicating()


@dataclass(frozen=True)
class Measurement:
    """The median time of one collective at one size on a group of ranks.

    >>> m = Measurement("allreduce", nbytes=1 << 20, group_size=4, seconds=31e-6)
    >>> round(predicted(CostModel.h200(), m) * 1e6, 1)  # what the h200 preset expects instead
    24.3
    """

    kind: str
    nbytes: float  # the bytes the cost model charges (the kind's registry entry says which)
    group_size: int
    seconds: float  # median


def sample_move(kind: str, mesh: DeviceMesh, nbytes: float, itemsize: int) -> Move:
    """A collective of `kind` over the 1-D `mesh` between its registry example's placements, on a
    [p, p * k] tensor with k chosen so that it moves about `nbytes` as the cost model counts them.

    >>> move = sample_move("allgather", DeviceMesh.arange(4), 1 << 20, 4)
    >>> move.shape, str(move.src), str(move.dst)
    ((4, 65536), '[S(0)]', '[R]')
    """
    entry, p = collectives.KINDS[kind], mesh.size
    src, dst = (Layout((x,)) for x in entry.example)
    unit = entry.moved(Move(mesh, (p, p), src, dst, 0), itemsize)  # what it moves is linear in k
    return Move(mesh, (p, p * max(1, round(nbytes / unit))), src, dst, 0)


def measure_collectives(sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 23), kinds=KINDS, iters: int = 10,
                        group=None, device=None, dtype=torch.float32) -> list[Measurement]:
    """Median seconds of each collective at each size (the bytes the cost model charges), run by its
    registry entry. Call on every rank of an initialized process group (of at least two ranks); every
    rank returns the same list (rank 0's timings).

    Example::

        def work(rank):  # module level: launch pickles it
            return measure_collectives(sizes=(1 << 16, 1 << 20), iters=5)

        ms = ed.launch(work, nprocs=2)[0]  # a Measurement per kind and size
        model = calibrated(ed.CostModel.h200(), [fit_link(ms, "gloo-loopback")])
    """
    silent = [k for k in kinds if not collectives.get(k, "measure_collectives").communicates]
    if silent:
        raise PlanError(f"measure_collectives: {', '.join(silent)} moves nothing between ranks; there is no link "
                        f"to time (measure any of {', '.join(KINDS)})")
    members = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    axis = AxisGroup(members, members.index(dist.get_rank()), group or dist.group.WORLD)
    mesh = DeviceMesh(list(members))
    device = device or (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                        else torch.device("cpu"))
    item = torch.tensor([], dtype=dtype).element_size()
    out = []
    for nbytes in sizes:
        for kind in kinds:
            entry = collectives.KINDS[kind]
            move = sample_move(kind, mesh, nbytes, item)
            local = torch.randn(_local_shape(move, axis.rank), device=device, dtype=dtype)
            times = []
            for i in range(iters + 2):
                _sync(device)
                dist.barrier(group=group)
                t0 = time.perf_counter()
                entry.run(move, local, axis)
                _sync(device)
                if i >= 2:  # warm-up
                    times.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.broadcast(t, src=members[0], group=group)  # every rank reports rank 0's timing
            out.append(Measurement(kind, float(entry.moved(move, item)), axis.size, float(t.item())))
    return out


def _local_shape(move: Move, rank: int) -> tuple[int, ...]:
    """The shape of `rank`'s piece of the tensor `move` starts from."""
    return RankContext(move.mesh, rank).local_shape(Operand(move.shape, move.src))


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def fit_link(measurements: list[Measurement], name: str = "calibrated") -> Link:
    """Non-negative least squares of the cost model's alpha-beta model over all measurements. The model
    is linear in alpha and 1/bandwidth, so its two columns are what the cost model predicts on a link of
    alpha 1 and infinite bandwidth, and on one of alpha 0 and bandwidth 1.

    >>> truth = calibrated(CostModel.h200(), [Link("truth", alpha=5e-6, bandwidth=1e11)])
    >>> ms = [Measurement(k, n, 4, 0.0) for k in KINDS for n in (1e4, 1e6, 1e8)]
    >>> link = fit_link([dataclasses.replace(m, seconds=predicted(truth, m)) for m in ms])
    >>> round(link.alpha * 1e6, 3), round(link.bandwidth / 1e9, 1)
    (5.0, 100.0)
    """
    from scipy.optimize import nnls

    units = [calibrated(CostModel.h200(), [Link("latency", alpha=1.0, bandwidth=float("inf"))]),
             calibrated(CostModel.h200(), [Link("volume", alpha=0.0, bandwidth=1.0)])]
    rows, ys, w = [], [], []
    for m in measurements:
        rows.append([predicted(unit, m) for unit in units])
        ys.append(m.seconds)
        w.append(1.0 / max(m.seconds, 1e-9))  # relative error: small and large messages weigh alike
    a = np.array(rows) * np.array(w)[:, None]
    coef, _ = nnls(a, np.array(ys) * np.array(w))
    alpha, inv_bw = coef
    return Link(name, alpha=float(alpha), bandwidth=float(1.0 / inv_bw) if inv_bw > 0 else float("inf"))


def predicted(model: CostModel, m: Measurement, mesh_axis: int = 0, mesh_ndim: int = 1) -> float:
    """The seconds `model` predicts for the collective `m` measured.

    >>> m = Measurement("allgather", nbytes=1 << 20, group_size=8, seconds=14e-6)
    >>> round(predicted(CostModel.h200(), m) * 1e6, 1)  # microseconds (14 were measured)
    12.5
    """
    return model.collective_time(m.kind, m.nbytes, m.group_size, mesh_axis, mesh_ndim)


def calibrated(base: CostModel, links: list[Link]) -> CostModel:
    """base with its links replaced (one per mesh axis, outermost first, or one for every axis).

    >>> model = calibrated(CostModel.h200(), [Link("gloo-loopback", alpha=50e-6, bandwidth=2e9)])
    >>> model.name, model.links[0].alpha, model.hbm_bandwidth == CostModel.h200().hbm_bandwidth
    ('h200-nvlink+calibrated', 5e-05, True)
    """
    return dataclasses.replace(base, name=f"{base.name}+calibrated", links=tuple(links))


def save_preset(model: CostModel, path: str) -> None:
    """Write `model` to `path` as JSON (load_preset reads it back).

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "h200.json")
    >>> save_preset(CostModel.h200(), path)
    >>> load_preset(path) == CostModel.h200()
    True
    """
    with open(path, "w") as f:
        json.dump(model.to_dict(), f, indent=1)


def load_preset(path: str) -> CostModel:
    """The CostModel save_preset wrote to `path`.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "multinode.json")
    >>> save_preset(CostModel.h200_multinode(memory_limit=80e9), path)
    >>> [link.name for link in load_preset(path).links], load_preset(path).memory_limit
    (['infiniband', 'nvlink'], 80000000000.0)
    """
    with open(path) as f:
        return CostModel.from_dict(json.load(f))
