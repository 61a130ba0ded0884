"""The cost model: alpha-beta communication per mesh axis, roofline compute, optional memory bound.

Replaceable: `optimize(..., cost_model=MyModel())` takes any object with the methods of CostModel.

Communication on a mesh axis of p ranks moving n bytes (n = the bytes of the tensor unsplit on that
axis that one rank ends with (allgather) or starts with (reduce_scatter, allreduce); for alltoall, the
shard a rank holds, of which it sends (p-1)/p):
  allgather, reduce_scatter, alltoall:  alpha + (p-1)/p * n / bw
  allreduce:                            2 alpha + 2(p-1)/p * n / bw
  broadcast, send/recv:                 alpha + n / bw
An allreduce pays two latencies: NCCL's ring allreduce is a reduce-scatter phase then an allgather
phase, so it costs exactly what the two cost apart. With one alpha it would look cheaper than the
reduce-scatter + allgather pair of sequence parallelism for no physical reason.
Compute: launch + max(flops / peak(dtype), bytes / hbm).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

COLLECTIVES = ("allgather", "reduce_scatter", "allreduce", "alltoall", "broadcast", "send_recv")


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
            raise ValueError(f"cost model {self.name} has {len(self.links)} links for a {mesh_ndim}-D mesh")
        return self.links[mesh_axis]

    def collective_time(self, kind: str, nbytes: float, group_size: int, mesh_axis: int, mesh_ndim: int) -> float:
        """Seconds for one collective of `kind` over `group_size` ranks of a mesh axis."""
        if group_size <= 1:
            return 0.0
        link = self.link(mesh_axis, mesh_ndim)
        p = group_size
        factor = {"allgather": (p - 1) / p, "reduce_scatter": (p - 1) / p, "alltoall": (p - 1) / p,
                  "allreduce": 2 * (p - 1) / p, "broadcast": 1.0, "send_recv": 1.0}.get(kind)
        if factor is None:
            raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")
        phases = 2 if kind == "allreduce" else 1
        return phases * link.alpha + factor * nbytes / link.bandwidth

    def peak(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for `dtype` (float32's for a dtype the table lacks)."""
        name = str(dtype).replace("torch.", "")
        table = dict(self.peak_flops)
        return table.get(name, table.get("float32"))

    def compute_time(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        """Roofline time of one local kernel, with a launch floor."""
        return self.launch_overhead + max(flops / self.peak(dtype), nbytes / self.hbm_bandwidth)

    # -------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        """Plain JSON-ready data; from_dict reads it back."""
        return {"name": self.name, "peak_flops": dict(self.peak_flops), "hbm_bandwidth": self.hbm_bandwidth,
                "launch_overhead": self.launch_overhead, "memory_limit": self.memory_limit,
                "links": [dataclasses.asdict(link) for link in self.links]}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Inverse of to_dict()."""
        return cls(d["name"], tuple(d["peak_flops"].items()), d["hbm_bandwidth"], d["launch_overhead"],
                   tuple(Link(**link) for link in d["links"]), d.get("memory_limit"))
