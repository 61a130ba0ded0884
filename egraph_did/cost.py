"""The cost model: alpha-beta communication per mesh axis, roofline compute, optional memory bound.

Replaceable: `optimize(..., cost_model=MyModel())` takes any object with the methods of CostModel.

Communication on a mesh axis of p ranks: a collective is `phases` latency-bound passes, each sending
factor(p) of n bytes (its registry entry in collectives.py says which n, how many phases and what
factor), over the axis's link:
  t = phases * alpha + phases * factor(p) * n / bw                          (Link.time)
  allgather, reduce_scatter, alltoall:  alpha + (p-1)/p * n / bw
  allreduce:                            2 alpha + 2(p-1)/p * n / bw
An allreduce pays two latencies: NCCL's ring allreduce is a reduce-scatter phase then an allgather
phase, so it costs exactly what the two cost apart. With one alpha it would look cheaper than the
reduce-scatter + allgather pair of sequence parallelism for no physical reason.
Compute: launch + max(flops / peak(dtype), bytes / hbm).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .collectives import KINDS
from .errors import CostModelError


@dataclass(frozen=True)
class Link:
    """The network of one mesh axis: latency per collective and bus bandwidth per rank.

    >>> link = Link("infiniband", alpha=20e-6, bandwidth=45e9)  # 400 Gb/s per GPU
    >>> CostModel.h200_multinode().links[0] == link
    True
    """

    name: str
    alpha: float  # seconds per collective
    bandwidth: float  # bytes/s each rank moves (NCCL's bus bandwidth)

    def __post_init__(self):
        if not _number(self.alpha) or self.alpha < 0:
            raise CostModelError(f"Link {self.name}: alpha must be a non-negative number of seconds per "
                                 f"collective, got {self.alpha!r} (e.g. alpha=10e-6)")
        if not _number(self.bandwidth, inf_ok=True) or self.bandwidth <= 0:
            raise CostModelError(f"Link {self.name}: bandwidth must be a positive number of bytes/s per rank, "
                                 f"got {self.bandwidth!r} (e.g. bandwidth=370e9 for NVLink)")

    def time(self, phases: int, factor: float, nbytes: float) -> float:
        """Seconds for `phases` passes over this link, each sending factor * nbytes: the alpha-beta model.
        It is linear in alpha and 1/bandwidth, which calibrate's fit relies on.

        >>> Link("nvlink", alpha=10e-6, bandwidth=370e9).time(2, 0.75, 370e9) * 1e6  # an allreduce of 4
        1500020.0
        """
        return phases * self.alpha + phases * factor * nbytes / self.bandwidth


def size_text(nbytes: float, digits: int = 3) -> str:
    """Bytes in the largest unit that keeps them >= 1 (`digits` significant), so tiny bounds do not print as
    0.00 GiB: the one spelling of a memory size in messages, explain() and pictures.

    >>> size_text(80 * 2**30), size_text(1536), size_text(96), size_text(295424, digits=4)
    ('80 GiB', '1.5 KiB', '96 B', '288.5 KiB')
    """
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= f:
            return f"{nbytes / f:.{digits}g} {unit}"
    return f"{nbytes:.0f} B"


def _number(v, inf_ok: bool = False) -> bool:
    """A real number, not nan, finite unless inf_ok (bools excluded)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
            and (inf_ok or math.isfinite(v)))


# how far over memory_limit a plan may be and still fit (relative): far below a byte of any real bound, far above
# the error of summing a plan's per-tensor bytes as floats
MEMORY_BOUND_TOLERANCE = 1e-9


@dataclass(frozen=True)
class CostModel:
    """Predicts seconds for collectives and local kernels.

    >>> cm = CostModel.h200()
    >>> round(cm.collective_time("allreduce", 1 << 20, group_size=4, mesh_axis=0, mesh_ndim=1) * 1e6, 1)
    24.3
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]  # dtype name -> FLOP/s
    hbm_bandwidth: float  # bytes/s
    launch_overhead: float  # seconds per kernel
    links: tuple[Link, ...]  # per mesh axis, outermost first; one link serves every axis
    memory_limit: float | None = None  # bytes per device, or no bound

    def __post_init__(self):
        if self.memory_limit is not None and (not _number(self.memory_limit) or self.memory_limit <= 0):
            raise CostModelError(f"CostModel {self.name}: memory_limit must be a positive number of bytes per "
                                 f"device, or None for no bound; got {self.memory_limit!r} "
                                 f"(e.g. memory_limit=80 * 2**30 for 80 GiB)")
        if not isinstance(self.peak_flops, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and _number(p[1]) and p[1] > 0 for p in self.peak_flops):
            raise CostModelError(f"CostModel {self.name}: peak_flops must be a tuple of (dtype name, FLOP/s) "
                                 f"pairs with positive rates, got {self.peak_flops!r} "
                                 f"(e.g. (('bfloat16', 679e12), ('float32', 60e12)))")
        for field, v in (("hbm_bandwidth", self.hbm_bandwidth), ("launch_overhead", self.launch_overhead)):
            if not _number(v) or v < 0 or (field == "hbm_bandwidth" and v == 0):
                raise CostModelError(f"CostModel {self.name}: {field} must be a "
                                     f"{'positive number of bytes/s' if field == 'hbm_bandwidth' else 'non-negative number of seconds'}"
                                     f", got {v!r}")
        if (not isinstance(self.links, tuple) or not self.links
                or not all(isinstance(link, Link) for link in self.links)):
            raise CostModelError(f"CostModel {self.name}: links must be a non-empty tuple of Link, one per "
                                 f"mesh axis (outermost first) or one for every axis; got {self.links!r}")

    @property
    def memory_bound(self) -> float | None:
        """memory_limit as the planner tests a plan against it: within a relative MEMORY_BOUND_TOLERANCE, so that a
        plan meeting the bound exactly is not refused for the last bit of a float sum (a bound of 0.7 * 180 B is
        125.99999999999999 B; the exact extractor's solver took the 126 B plan, greedy refused it).

        >>> CostModel.h200(memory_limit=0.7 * 180).memory_bound >= 126, CostModel.h200().memory_bound
        (True, None)
        """
        return None if self.memory_limit is None else self.memory_limit * (1 + MEMORY_BOUND_TOLERANCE)

    # -------------------------------------------------------------- presets
    @classmethod
    def h200(cls, memory_limit: float | None = None) -> "CostModel":
        """One node of H200s over NVLink (measured: bf16 matmul 679 TFLOP/s, copy 4.18 TB/s)."""
        return cls("h200-nvlink",
                   (("bfloat16", 679e12), ("float16", 679e12), ("float32", 60e12), ("float64", 60e12)),
                   hbm_bandwidth=4.18e12, launch_overhead=4e-6,
                   links=(Link("nvlink", alpha=10e-6, bandwidth=370e9),), memory_limit=memory_limit)

    @classmethod
    def h200_multinode(cls, memory_limit: float | None = None) -> "CostModel":
        """A 2-D mesh of H200 nodes: the outer axis crosses nodes over InfiniBand (400 Gb/s per GPU), the
        inner axis stays on NVLink."""
        base = cls.h200(memory_limit)
        return dataclasses.replace(base, name="h200-multinode", links=(
            Link("infiniband", alpha=20e-6, bandwidth=45e9), Link("nvlink", alpha=10e-6, bandwidth=370e9)))

    # -------------------------------------------------------------- queries
    def link(self, mesh_axis: int, mesh_ndim: int) -> Link:
        """The link of mesh axis `mesh_axis` of a `mesh_ndim`-D mesh."""
        if len(self.links) == 1:
            return self.links[0]
        if len(self.links) != mesh_ndim:
            raise CostModelError(f"cost model {self.name} has {len(self.links)} links "
                                 f"({', '.join(link.name for link in self.links)}) for a {mesh_ndim}-D mesh; give "
                                 f"one link per mesh axis, or one for every axis")
        return self.links[mesh_axis]

    def check_mesh(self, mesh) -> None:
        """CostModelError unless this model prices every axis of `mesh` (one link, or one per axis).

        >>> import egraph_did as ed
        >>> CostModel.h200_multinode().check_mesh(ed.DeviceMesh.arange(8))
        Traceback (most recent call last):
        ...
        egraph_did.errors.CostModelError: cost model h200-multinode has 2 links (infiniband, nvlink), one per axis of a 2-D mesh, but the mesh DeviceMesh(x=8) is 1-D; use a 2-D mesh such as DeviceMesh(grid.reshape(nodes, gpus_per_node)), or CostModel.h200() for one node
        """
        if len(self.links) not in (1, mesh.ndim):
            raise CostModelError(
                f"cost model {self.name} has {len(self.links)} links "
                f"({', '.join(link.name for link in self.links)}), one per axis of a {len(self.links)}-D mesh, but "
                f"the mesh {mesh} is {mesh.ndim}-D; use a {len(self.links)}-D mesh such as "
                f"DeviceMesh(grid.reshape(nodes, gpus_per_node)), or CostModel.h200() for one node")

    def collective_time(self, kind: str, nbytes: float, group_size: int, mesh_axis: int, mesh_ndim: int) -> float:
        """Seconds for one collective of `kind` over `group_size` ranks of a mesh axis, moving `nbytes`
        as its registry entry counts them (collectives.KINDS: phases and factor).

        >>> CostModel.h200().collective_time("broadcast", 1024, 4, 0, 1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        egraph_did.errors.CostModelError: unknown collective 'broadcast'; known: allgather, reduce_scatter, ...
        """
        entry = KINDS.get(kind)
        if entry is None:
            raise CostModelError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")
        if group_size <= 1:
            return 0.0
        return self.link(mesh_axis, mesh_ndim).time(entry.phases, entry.factor(group_size), nbytes)

    def peak(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for `dtype` (float32's for a dtype the table lacks)."""
        name = str(dtype).replace("torch.", "")
        table = dict(self.peak_flops)
        return table.get(name, table.get("float32"))

    def compute_time(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        """Roofline time of one local kernel, with a launch floor."""
        return self.launch_overhead + max(flops / self.peak(dtype), nbytes / self.hbm_bandwidth)

    def exchange_time(self, nbytes: float, group_size: int, mesh_axis: int, mesh_ndim: int) -> float:
        """Seconds for an expert exchange on a mesh axis (collectives.EXCHANGES: token dispatch or combine, one
        all-to-all of uneven pieces), priced as an alltoall of `nbytes`, a rank's share of the rows under
        balanced routing (collectives.exchange_bytes); a skewed routing sends more from the busiest rank.

        >>> round(CostModel.h200().exchange_time(16 * 2 ** 20, 4, 0, 1) * 1e6, 1)
        44.0
        """
        return self.collective_time("alltoall", nbytes, group_size, mesh_axis, mesh_ndim)

    def ring_time(self, n: int, compute_chunk: float, chunk_bytes: float, mesh_axis: int, mesh_ndim: int,
                  first: float | None = None) -> float:
        """Seconds for a collective matmul run as a ring of n steps on a mesh axis (collectives.RINGS):
        n - 1 steps each take the longer of one block's GEMM (compute_chunk, from compute_time) and one
        block's transfer to the neighbour (the axis's link, one phase of chunk_bytes: its latency paid per
        step), and one GEMM runs alone (the first block of a reduce-scatter ring waits on nothing; the last
        block of an allgather ring arrives with nothing left to hide it behind). first: the compute of the
        first step where it differs (ring attention under a causal mask: the diagonal block, half a block).

        >>> cm = CostModel.h200()
        >>> round(cm.ring_time(4, 100e-6, 3.7e6, 0, 1) * 1e6, 1)  # 3 x max(100, 10 + 10) + 100
        400.0
        >>> round(cm.ring_time(4, 5e-6, 3.7e3, 0, 1) * 1e6, 1)  # tiny: 3 x (10 us latency + 0.01) + 5
        35.0
        >>> round(cm.ring_time(4, 100e-6, 3.7e6, 0, 1, first=50e-6) * 1e6, 1)  # max(50, 20) + 2 x 100 + 100
        350.0
        """
        step = self.link(mesh_axis, mesh_ndim).time(1, 1.0, chunk_bytes)
        if first is None or n < 2:
            return (n - 1) * max(compute_chunk, step) + compute_chunk
        return max(first, step) + (n - 2) * max(compute_chunk, step) + compute_chunk

    # -------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        """Plain JSON-ready data; from_dict reads it back."""
        return {"name": self.name, "peak_flops": dict(self.peak_flops), "hbm_bandwidth": self.hbm_bandwidth,
                "launch_overhead": self.launch_overhead, "memory_limit": self.memory_limit,
                "links": [dataclasses.asdict(link) for link in self.links]}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Inverse of to_dict().

        >>> CostModel.from_dict({"name": "mine"})
        Traceback (most recent call last):
        ...
        egraph_did.errors.CostModelError: cost model dict 'mine' lacks the field 'peak_flops'; write it with CostModel.to_dict()
        """
        if not isinstance(d, dict):
            raise CostModelError(f"a cost model dict is a dict (CostModel.to_dict()), got {type(d).__name__}")
        label = d.get("name", "?")
        for key, kind in (("name", str), ("peak_flops", dict), ("hbm_bandwidth", (int, float)),
                          ("launch_overhead", (int, float)), ("links", list)):
            if key not in d:
                raise CostModelError(f"cost model dict {label!r} lacks the field {key!r}; write it with "
                                     f"CostModel.to_dict()")
            if not isinstance(d[key], kind):
                raise CostModelError(f"cost model dict {label!r}: field {key!r} must be a "
                                     f"{getattr(kind, '__name__', 'number')}, got {type(d[key]).__name__}")
        links = []
        for i, link in enumerate(d["links"]):
            if not isinstance(link, dict) or set(link) != {"name", "alpha", "bandwidth"}:
                raise CostModelError(f"cost model dict {label!r}: links[{i}] must have exactly the fields name, "
                                     f"alpha, bandwidth; got {link!r}")
            links.append(Link(**link))
        return cls(d["name"], tuple(d["peak_flops"].items()), d["hbm_bandwidth"], d["launch_overhead"],
                   tuple(links), d.get("memory_limit"))


METHODS = ("collective_time", "compute_time", "to_dict")


def check_cost_model(cost_model, mesh) -> None:
    """CostModelError unless `cost_model` can price plans on `mesh`: a CostModel (or an object with its
    methods and a memory_limit) whose links cover the mesh's axes.

    >>> import egraph_did as ed
    >>> check_cost_model("h200", ed.DeviceMesh.arange(4))
    Traceback (most recent call last):
    ...
    egraph_did.errors.CostModelError: optimize: cost_model must be a CostModel (e.g. ed.CostModel.h200() or ed.CostModel.h200_multinode()) or an object with its methods (collective_time, compute_time, to_dict) and a memory_limit; got the str 'h200'
    """
    missing = [m for m in METHODS if not callable(getattr(cost_model, m, None))]
    if missing or not hasattr(cost_model, "memory_limit"):
        raise CostModelError(f"optimize: cost_model must be a CostModel (e.g. ed.CostModel.h200() or "
                             f"ed.CostModel.h200_multinode()) or an object with its methods "
                             f"({', '.join(METHODS)}) and a memory_limit; got the "
                             f"{type(cost_model).__name__} {cost_model!r:.60}")
    if isinstance(cost_model, CostModel):
        cost_model.check_mesh(mesh)
