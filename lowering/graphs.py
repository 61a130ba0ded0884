"""CUDA graphs: a prepared program (lowering/program.py) captured once per input signature and replayed.

A replay enqueues the whole program (kernels, cuBLAS calls, NCCL collectives) with one host call, so
the host's time per iteration no longer grows with the number of segments.

* The first run of a program through here is an ordinary run (the program's very first one is its
  checked run): it compiles kernels, creates cuBLAS handles and NCCL communicators, none of which may
  happen during a capture.
* The second run captures. An input that is the very tensor object of the previous run is read by the
  graph where it lies (weights: no copy, and in-place updates are seen, as torch's CUDA graphs treat
  parameters); any other input gets a static buffer the graph reads, and each replay copies it in.
  The program holds a reference to every tensor the graph reads, so their memory is never reused.
* A replay whose "read in place" input is a different object captures again, with that input copied
  from then on (a second re-capture gives up: the program runs without a graph).
* Outputs are the graph's static tensors, overwritten by the next replay: copy_outputs=True (the
  runtime's default) hands back clones.

Where capture is impossible (a CPU tensor: gloo and CPU runs never capture; indices checked on the host
each run; a collective timeout; an error during capture) the program runs without a graph, and a warning
says why, once.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .program import Program

_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """warnings.warn(message) the first time this process sees it.

    >>> warn_once("example: shown once")  # doctest: +SKIP
    """
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclass
class Captured:
    """A program's graph: the tensors it reads (static buffers or the inputs themselves), which inputs
    are read in place, and the outputs it writes."""

    graph: "torch.cuda.CUDAGraph"
    reads: list[torch.Tensor]
    in_place: tuple[bool, ...]
    outputs: list[torch.Tensor]
    captures: int


@dataclass
class NotCaptured:
    """Why a program runs without a graph."""

    reason: str


def _buffer(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)


def capture(program: Program, inputs: Sequence[torch.Tensor], in_place: Sequence[bool], captures: int = 1
            ) -> Captured:
    """The program captured into a CUDA graph: inputs marked in_place are read where they lie, the rest
    from static buffers filled with their values. The program runs once on a side stream first (what
    torch.cuda.graph asks: allocations and library workspaces settle outside the capture).

    Example (needs a GPU)::

        prog = program_for(plan, 0, ins, stand_in)
        prog.run(ins)                                 # the first, checked run
        cap = capture(prog, ins, [True] * len(ins))   # every input read in place
        cap.graph.replay()                            # cap.outputs now hold this run's outputs
    """
    reads = [t if keep else _buffer(t).copy_(t) for t, keep in zip(inputs, in_place)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        program.run(reads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = program.run(reads)
    return Captured(graph, reads, tuple(in_place), outputs, captures)


def _why_not(program: Program, inputs: Sequence[torch.Tensor], reason: str | None) -> str | None:
    if reason is not None:
        return reason
    if program.has_index_checks:
        return ("it checks embedding/gather indices on the host every run (a device-to-host read); pass "
                "check_indices=False to capture it, once the ids are known to be in range")
    return None


def run_graphed(program: Program, inputs: Sequence[torch.Tensor], *, copy_outputs: bool = True,
                not_capturable: str | None = None, before_comm: Callable[[int], None] | None = None
                ) -> list[torch.Tensor]:
    """program.run(inputs) through a CUDA graph where it can be one (see the module doc), else the
    program's own run (CPU tensors, always). not_capturable: the caller's reason this run cannot be
    captured (warned once, then the lean run). before_comm goes to runs without a graph only.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> from egraph_did.lowering.program import program_for
    >>> plan = ed.optimize(row_sum(4, 3), ed.DeviceMesh.arange(2))
    >>> x = torch.ones(2, 3)
    >>> run_graphed(program_for(plan, 1, [x], None), [x])  # a CPU tensor: no graph, the same numbers
    [tensor([3., 3.])]
    """
    state = program.graph
    if not inputs or inputs[0].device.type != "cuda" or isinstance(state, NotCaptured):
        return program.run(inputs, before_comm)
    why = _why_not(program, inputs, not_capturable)
    if why is not None:
        warn_once(f"egraph-did: rank {program.rank}'s program runs without a CUDA graph: {why}")
        return program.run(inputs, before_comm)
    if state is None:  # compile kernels, make handles and communicators outside any capture
        outs = program.run(inputs, before_comm)
        program.graph = list(inputs)  # the previous run's inputs, to tell weights from fresh tensors
        return outs
    if isinstance(state, list):
        state = _try_capture(program, inputs, [a is b for a, b in zip(inputs, state)], 1)
        if state is None:
            return program.run(inputs, before_comm)
    elif any(keep and a is not b for a, b, keep in zip(inputs, state.reads, state.in_place)):
        if state.captures >= 2:
            program.graph = NotCaptured("inputs read in place keep changing")
            warn_once(f"egraph-did: rank {program.rank}'s program runs without a CUDA graph: its inputs are new "
                      f"tensors on every run though they were the same tensors twice before; pass the same "
                      f"tensors, or cuda_graph=False")
            return program.run(inputs, before_comm)
        kept = [keep and a is b for a, b, keep in zip(inputs, state.reads, state.in_place)]
        state = _try_capture(program, inputs, kept, state.captures + 1)
        if state is None:
            return program.run(inputs, before_comm)
    for buf, t, keep in zip(state.reads, inputs, state.in_place):
        if not keep:
            buf.copy_(t)
    state.graph.replay()
    return [t.clone() for t in state.outputs] if copy_outputs else list(state.outputs)


def _try_capture(program: Program, inputs, in_place, captures: int) -> Captured | None:
    program.graph = None  # a failed capture must not leave a half-made graph behind
    try:
        state = capture(program, inputs, in_place, captures)
    except Exception as e:  # noqa: BLE001 - any failure to capture means: run without a graph, and say why
        torch.cuda.synchronize()
        program.graph = NotCaptured(f"{type(e).__name__}: {e}")
        warn_once(f"egraph-did: rank {program.rank}'s program runs without a CUDA graph: capturing it failed "
                  f"({type(e).__name__}: {str(e)[:300]})")
        return None
    program.graph = state
    return state


__all__ = ["run_graphed", "capture", "Captured", "NotCaptured", "warn_once"]
