"""Calibrate the cost model's links from measured collectives.

Inside a process group, `measure_collectives` times allgather, reduce_scatter, allreduce and alltoall
over a range of sizes; `fit_link` fits the alpha-beta model the cost model uses,
    t = phases * alpha + factor(kind, p) * n / bandwidth      (phases 2 for allreduce, else 1)
by non-negative least squares; `calibrated` returns a CostModel with the fitted link, which
`save_preset` / `load_preset` keep as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from .cost import CostModel, Link

KINDS = ("allgather", "reduce_scatter", "allreduce", "alltoall")


@dataclass(frozen=True)
class Measurement:
    """The median time of one collective at one size on a group of ranks.

    >>> m = Measurement("allreduce", nbytes=1 << 20, group_size=4, seconds=31e-6)
    >>> round(predicted(CostModel.h200(), m) * 1e6, 1)  # what the h200 preset expects instead
    24.3
    """

    kind: str
    nbytes: float  # the full (gathered / pre-scatter) bytes per rank, as the cost model counts them
    group_size: int
    seconds: float  # median


def _factor(kind: str, p: int) -> tuple[int, float]:
    """(latency phases, bandwidth factor) of the cost model's formula."""
    return (2, 2 * (p - 1) / p) if kind == "allreduce" else (1, (p - 1) / p)


def measure_collectives(sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 23), kinds=KINDS, iters: int = 10,
                        group=None, device=None, dtype=torch.float32) -> list[Measurement]:
    """Median seconds of each collective at each size (bytes per rank of the full tensor). Call on every
    rank of an initialized process group; every rank returns the same list (rank 0's timings).

    Example::

        def work(rank):  # module level: launch pickles it
            return measure_collectives(sizes=(1 << 16, 1 << 20), iters=5)

        ms = ed.launch(work, nprocs=2)[0]  # a Measurement per kind and size
        model = calibrated(ed.CostModel.h200(), [fit_link(ms, "gloo-loopback")])
    """
    import torch.distributed as dist

    # torch 2.13 names these *_single (the old names warn); torch 2.11 has only the old ones
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    p = dist.get_world_size(group)
    device = device or (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                        else torch.device("cpu"))
    item = torch.tensor([], dtype=dtype).element_size()
    out = []
    for nbytes in sizes:
        n = max(p, int(nbytes // item) // p * p)
        full = torch.randn(n, device=device, dtype=dtype)
        part = torch.randn(n // p, device=device, dtype=dtype)
        ops = {
            "allgather": lambda: all_gather(torch.empty_like(full), part, group=group),
            "reduce_scatter": lambda: reduce_scatter(torch.empty_like(part), full, group=group),
            "allreduce": lambda: dist.all_reduce(full, group=group),
            "alltoall": lambda: dist.all_to_all_single(torch.empty_like(full), full, group=group),
        }
        for kind in kinds:
            times = []
            for i in range(iters + 2):
                _sync(device)
                dist.barrier(group=group)
                t0 = time.perf_counter()
                ops[kind]()
                _sync(device)
                if i >= 2:  # warm-up
                    times.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            out.append(Measurement(kind, float(n * item), p, float(t.item())))
    return out


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def fit_link(measurements: list[Measurement], name: str = "calibrated") -> Link:
    """Non-negative least squares of the alpha-beta model over all measurements.

    >>> ms = [Measurement(k, n, 4, _factor(k, 4)[0] * 5e-6 + _factor(k, 4)[1] * n / 1e11)
    ...       for k in KINDS for n in (1e4, 1e6, 1e8)]
    >>> link = fit_link(ms)
    >>> round(link.alpha * 1e6, 3), round(link.bandwidth / 1e9, 1)
    (5.0, 100.0)
    """
    from scipy.optimize import nnls

    rows, ys, w = [], [], []
    for m in measurements:
        phases, factor = _factor(m.kind, m.group_size)
        rows.append([phases, factor * m.nbytes])
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
