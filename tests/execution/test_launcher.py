"""ed.launch's ranks fork from a server started by the first launch (egraph_did/launcher.py), yet each sees what a
spawned rank would: the parent's environment and stdout/stderr as at this launch (the server's are those of its
start), and any number of tensors among fn's arguments (a forkserver passes at most ~250 file descriptors)."""
import os
import sys

import torch

import egraph_did as ed


def _report(rank: int, name: str, tensors: list) -> tuple:
    print(f"stdout of rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    return os.environ.get(name), float(sum(t.sum() for t in tensors))


def test_a_rank_sees_the_environment_and_output_of_its_launch_not_the_servers(capfd, monkeypatch):
    ed.launch(_report, nprocs=2, args=("EGRAPH_DID_LAUNCH_PROBE", []))  # the server starts here, at the latest
    capfd.readouterr()
    monkeypatch.setenv("EGRAPH_DID_LAUNCH_PROBE", "set after the server started")
    got = ed.launch(_report, nprocs=2, args=("EGRAPH_DID_LAUNCH_PROBE", []))
    assert [env for env, _ in got] == ["set after the server started"] * 2
    out, err = capfd.readouterr()
    assert "stdout of rank 0" in out and "stdout of rank 1" in out
    assert "stderr of rank 0" in err and "stderr of rank 1" in err


def test_hundreds_of_tensors_reach_every_rank():
    tensors = [torch.full((3,), float(i)) for i in range(400)]
    got = ed.launch(_report, nprocs=2, args=("HOME", tensors))
    assert [s for _, s in got] == [3.0 * sum(range(400))] * 2
