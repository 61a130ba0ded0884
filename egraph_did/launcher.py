"""launch(): run fn(rank, *args) in one process per rank, each with the default process group
initialized, and bring the return values home in rank order.

A run ends as a whole: when a rank raises, the others are stopped and LaunchError names the rank and
carries its traceback; when the run outlives `timeout` (a rank skipped a collective the others wait in),
every rank is stopped and LaunchError names the ranks that had not returned and the plan step each had
reached (from egraph_did.runtime's progress records). No child outlives launch().
"""
from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import context as mp_context, reduction
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

from . import runtime
from .errors import EgraphDidError

BACKENDS = ("gloo", "nccl")


class LaunchError(EgraphDidError, RuntimeError):
    """A launched run failed: a rank raised, died, or the run outlived its timeout.

    rank: the first rank that failed (None on a timeout); ranks: every rank named; tracebacks:
    {rank: traceback text}; progress: {rank: where that rank was, in words}."""

    def __init__(self, message: str, rank: int | None = None, ranks: Sequence[int] = (),
                 tracebacks: dict[int, str] | None = None, progress: dict[int, str] | None = None):
        super().__init__(message)
        self.rank = rank
        self.ranks = tuple(ranks)
        self.tracebacks = dict(tracebacks or {})
        self.progress = dict(progress or {})


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # the parent never reads half a record


class _ProgressFile:
    """A rank's latest progress record (runtime.Progress, or a setup note as a dict), written to its file by
    a daemon thread every PERIOD seconds when it changed, and by flush(). Written in line, one record per
    collective cost 2.3 ms each on the CI-like machine (json and a rename), more than the steps it names;
    a rank that stalls keeps its last record, which reaches the file within PERIOD, long before the
    parent's deadline makes it read the file.

    >>> import tempfile, json
    >>> f = _ProgressFile(os.path.join(tempfile.mkdtemp(), "progress0.json"))
    >>> f.record({"state": "setup", "since": 0.0, "text": "initializing"}); f.flush()
    >>> json.load(open(f.path))["text"]
    'initializing'
    """

    PERIOD = 0.2

    def __init__(self, path: str):
        self.path, self.latest, self.written = path, None, None
        self.lock = threading.Lock()
        threading.Thread(target=self._loop, daemon=True).start()

    def record(self, p) -> None:
        self.latest = p  # one reference stored: the hot path (every collective) does nothing else

    def flush(self) -> None:
        with self.lock:
            p = self.latest
            if p is None or p is self.written:
                return
            _write_json(self.path, p if isinstance(p, dict) else {
                "run": p.run, "index": p.index, "total": p.total, "what": p.what, "state": p.state,
                "since": p.since, "text": str(p)})
            self.written = p

    def _loop(self) -> None:
        while True:
            time.sleep(self.PERIOD)
            self.flush()


# Ranks fork from a server process that has imported torch once (multiprocessing's forkserver): a spawned rank
# imports it itself, ~1.2 s of CPU of its ~2.4 s start, four ranks a launch. And torch.distributed.tensor, which
# every rank's first run imports (Plan.check_inputs asks whether an input is a DTensor): 0.44 s of CPU a rank,
# measured; it starts no thread (the server imports no module that would leave a forked rank a held lock; a
# module the server cannot import, it skips). Not egraph_did: egglog's runtime, imported in the server, leaves a
# forked rank's first optimize() waiting forever on a lock (measured: a rank that optimizes never returns).
# Where the platform has no forkserver, ranks are spawned.
_PRELOAD = ["torch", "torch.distributed.tensor"]


def _context():
    """The multiprocessing context ranks start in: forkserver (torch preloaded) or spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _AsAtLaunch:
    """What a spawned rank inherits from the parent at launch: its environment, and where stdout and stderr
    go (under pytest, the running test's capture). A forkserver's child inherits the server's instead, as
    they were when the server started. Pickled as the first of a rank's arguments, it restores the parent's
    in the rank before fn and its module are unpickled (a test module sets TRITON_INTERPRET on import).

    >>> import pickle
    >>> pickle.loads(pickle.dumps(_AsAtLaunch())) is None  # outside a launch: the environment only
    True
    """

    def __reduce__(self):
        return _as_at_launch, (dict(os.environ), _dup_for_child(1), _dup_for_child(2))


def _dup_for_child(fd: int):
    """fd, handed to the process being started (None outside a start, or where fd is closed)."""
    if mp_context.get_spawning_popen() is None:  # set only while Process.start pickles the process
        return None
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


def _as_at_launch(env: dict, out, err) -> None:
    """In the rank: the parent's environment, and its stdout and stderr on fds 1 and 2."""
    os.environ.clear()
    os.environ.update(env)
    for target, dup in ((1, out), (2, err)):
        if dup is not None:
            fd = dup.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _child(as_at_launch: None, rank: int, nprocs: int, port: int, backend: str, job: str, workdir: str,
           events, release, timeout: float) -> None:
    """One rank: load fn and its arguments (job: torch.save'd by launch), set up the process group, run fn,
    save its value, report, wait to be released. as_at_launch: _AsAtLaunch, whose unpickling restored the
    parent's environment and stdout and stderr."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nprocs),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs))
    progress = _ProgressFile(os.path.join(workdir, f"progress{rank}.json"))

    def note(text: str) -> None:
        progress.record({"state": "setup", "since": time.time(), "text": text})
        progress.flush()

    runtime.add_progress_hook(progress.record)
    note("initializing the process group")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            # the ranks share the host's cores; one thread pool each would oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
        fn, args = torch.load(job, weights_only=False)
        dist.init_process_group(backend, rank=rank, world_size=nprocs,
                                timeout=datetime.timedelta(seconds=max(timeout, 1.0)))
        note("running fn, before any plan step")
        result = fn(rank, *args)
        path = os.path.join(workdir, f"result{rank}.pt")
        torch.save(result, path + ".tmp")
        os.replace(path + ".tmp", path)
        progress.flush()  # the last record on disk before the parent hears
        events.put(("done", rank, ""))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent, which ends the run
        progress.flush()
        events.put(("error", rank, traceback.format_exc()))
    # stay up until every rank is done: a rank that leaves early breaks its peers' connections
    release.wait(timeout + 60.0)

    def shut_down():
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - shutting down; the parent has what it needs
            pass

    # a collective left pending (a peer that never came) can hold destroy_process_group: bound it
    closer = threading.Thread(target=shut_down, daemon=True)
    closer.start()
    closer.join(2.0)
    # the parent holds every report already; skip the interpreter's teardown (about a second of torch)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(0)


def _progress(workdir: str, nprocs: int, done: set[int], now: float) -> dict[int, str]:
    out = {}
    for r in range(nprocs):
        try:
            with open(os.path.join(workdir, f"progress{r}.json")) as f:
                p = json.load(f)
        except (OSError, ValueError):
            p = None
        if r in done:
            out[r] = "returned" + (f" (last {p['text']})" if p and p["state"] == "finished" else "")
            continue
        if p is None:
            out[r] = "starting up (imports)"
            continue
        if p["state"] == "finished":
            out[r] = f"{p['text']}, then ran on outside the plan"
        else:
            out[r] = f"{p['text']} (for {now - p['since']:.1f} s)"
    return out


def _stop(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # a process that never started has nothing to stop
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


class _Probe(pickle.Pickler):
    """Pickles to nowhere, tensors as stubs: whether something can reach a spawned process, without
    copying tensor data (launch pickles the real thing once, into the job file the ranks load)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return tuple, ()
        return NotImplemented


def _probe(obj) -> None:
    _Probe(io.BytesIO()).dump(obj)


def _check_args(fn, nprocs, backend, args, timeout) -> None:
    """LaunchError naming the argument and the fix, before any process starts.

    >>> _check_args(lambda rank: rank, 2, "gloo", (), 60.0)
    Traceback (most recent call last):
    ...
    egraph_did.launcher.LaunchError: launch: fn <lambda> cannot be sent to the spawned processes (a lambda or a function defined inside another cannot be pickled); define fn at module level, in a file the ranks can import (def work(rank, ...): ...)
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"launch: nprocs must be a positive int (one process per rank), got {nprocs!r}")
    if backend not in BACKENDS:
        raise LaunchError(f"launch: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise LaunchError("launch: backend='nccl' needs CUDA GPUs; use backend='gloo' on CPU")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise LaunchError(f"launch: timeout must be a positive number of seconds for the whole run, got {timeout!r}")
    if not callable(fn):
        raise LaunchError(f"launch: fn must be a function fn(rank, *args), got the {type(fn).__name__} {fn!r:.40}")
    if not isinstance(args, (tuple, list)):
        raise LaunchError(f"launch: args must be a tuple of fn's arguments after rank, got the "
                          f"{type(args).__name__} {args!r:.40}; write args=({args!r:.40},) for one argument")
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        _probe(fn)
    except Exception as e:  # noqa: BLE001 - pickling raises many types
        raise LaunchError(f"launch: fn {name} cannot be sent to the spawned processes (a lambda or a function "
                          f"defined inside another cannot be pickled); define fn at module level, in a file the "
                          f"ranks can import (def work(rank, ...): ...)") from e
    for i, a in enumerate(args):
        try:
            _probe(a)
        except Exception as e:  # noqa: BLE001
            raise LaunchError(f"launch: args[{i}] (a {type(a).__name__}) cannot be pickled to the spawned processes "
                              f"({type(e).__name__}: {e}); pass plain data, tensors, or a Plan (or plan.to_json())"
                              ) from e


def launch(fn: Callable, nprocs: int, backend: str = "gloo", args: tuple = (), timeout: float = 120.0) -> list[Any]:
    """Run fn(rank, *args) in `nprocs` processes with torch.distributed's default process group
    initialized (MASTER_ADDR 127.0.0.1, a free port, world size nprocs); returns the per-rank return
    values in rank order. The processes fork from a server that has imported torch (started by the first
    launch; spawned where the platform has no forkserver), each with this process's environment and stdout
    and stderr as at the call. fn and args must be picklable (a module-level function); return values
    travel through torch.save, so tensors come back intact.

    backend: "gloo" (CPU; each rank gets cpu_count // nprocs torch threads) or "nccl" (one GPU per
    rank: rank % device_count). timeout: seconds for the whole run, start-up included (each process imports
    fn's module; the first launch starts the server, which imports torch); past it every rank is stopped and
    LaunchError says where each was. A rank that raises stops the run at once: LaunchError names it and
    holds its traceback.

    >>> import operator
    >>> launch(operator.add, nprocs=2, args=(10,))
    [10, 11]
    """
    _check_args(fn, nprocs, backend, args, timeout)
    ctx = _context()
    workdir = tempfile.mkdtemp(prefix="egraph-did-launch-")
    events, release = ctx.Queue(), ctx.Event()
    port = _free_port()
    # fn and args go through a file, not the processes' arguments: a forkserver passes each tensor's shared
    # memory as a file descriptor, at most ~250 a process (a training step's state holds more tensors)
    job = os.path.join(workdir, "job.pt")
    procs = [ctx.Process(target=_child, name=f"egraph-did-rank{r}",
                         args=(_AsAtLaunch(), r, nprocs, port, backend, job, workdir, events, release, timeout))
             for r in range(nprocs)]
    start = time.monotonic()
    deadline = start + timeout
    done: set[int] = set()
    try:
        torch.save((fn, tuple(args)), job)
        for p in procs:
            p.start()
        while len(done) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [r for r in range(nprocs) if r not in done]
                prog = _progress(workdir, nprocs, done, time.time())
                lines = "\n".join(f"  rank {r}: {prog[r]}" for r in range(nprocs))
                raise LaunchError(f"launch: the run did not finish within {timeout:g} s; rank(s) {waiting} had not "
                                  f"returned (a collective that some rank never reached stalls the others):\n{lines}",
                                  None, waiting, {}, prog)
            try:
                kind, rank, text = events.get(timeout=min(0.1, left))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and not p.is_alive()]
                if dead:
                    _raise_dead(dead, procs, events, workdir, nprocs, done)
                continue
            if kind == "done":
                done.add(rank)
                continue
            _raise_failed(rank, text, events, workdir, nprocs, done)
        release.set()
        results = []
        location = None if torch.cuda.is_available() else "cpu"
        for r in range(nprocs):
            results.append(torch.load(os.path.join(workdir, f"result{r}.pt"), map_location=location,
                                      weights_only=False))
        for p in procs:
            p.join(10.0)
        return results
    finally:
        release.set()
        _stop(procs)
        events.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _drain(events) -> list[tuple]:
    out = []
    while True:
        try:
            out.append(events.get(timeout=0.05))
        except (queue.Empty, OSError, ValueError):
            return out


def _raise_failed(rank: int, text: str, events, workdir: str, nprocs: int, done: set[int]):
    # ranks that fail after the first (their peer went quiet) are named, but the first is the cause
    time.sleep(0.2)
    tracebacks = {rank: text}
    for kind, r, t in _drain(events):
        if kind == "error":
            tracebacks.setdefault(r, t)
        else:
            done.add(r)
    prog = _progress(workdir, nprocs, done, time.time())
    last = text.strip().splitlines()[-1] if text.strip() else "?"
    others = [r for r in tracebacks if r != rank]
    also = f"; rank(s) {others} failed after it" if others else ""
    lines = "\n".join(f"  rank {r}: {prog[r]}" for r in range(nprocs))
    raise LaunchError(f"launch: rank {rank} raised {last}{also}\nwhere each rank was:\n{lines}\n"
                      f"traceback of rank {rank}:\n{text}", rank, [rank] + others, tracebacks, prog)


def _raise_dead(dead: list[int], procs, events, workdir: str, nprocs: int, done: set[int]):
    for kind, r, t in _drain(events):  # a report may have been in flight
        if kind == "error":
            _raise_failed(r, t, events, workdir, nprocs, done)
        done.add(r)
    dead = [r for r in dead if r not in done]
    if not dead:
        return
    prog = _progress(workdir, nprocs, done, time.time())
    codes = ", ".join(f"rank {r} (exit code {procs[r].exitcode})" for r in dead)
    lines = "\n".join(f"  rank {r}: {prog[r]}" for r in range(nprocs))
    raise LaunchError(f"launch: {codes} exited without returning (killed, crashed, os._exit, or fn could not "
                      f"be unpickled: its stderr says which)\n"
                      f"where each rank was:\n{lines}", dead[0], dead, {}, prog)


__all__ = ["launch", "LaunchError"]
