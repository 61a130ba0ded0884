"""bench/runtime.py --cpu-smoke runs: the 8-way GPT-3 plans' rank-0 programs at tiny shapes through the
three egraph-did executors (which must agree bit for bit, or the script exits non-zero) and torch eager."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_runtime_bench_smoke_runs_every_executor_and_they_agree():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "runtime.py"), "--cpu-smoke"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for plan in ("TP 8-way, the optimizer's plan", "TP+SP 8-way, the optimizer's plan", "TP+SP 8-way, Megatron's plan"):
        assert plan in out.stdout
    for row in ("egraph-did run_rank", "egraph-did lean", "egraph-did lean + CUDA graph", "torch eager"):
        assert out.stdout.count(row) >= 3, out.stdout
    assert "agree bit for bit" in out.stdout


def test_training_bench_smoke_runs_the_step_through_lean_its_graph_row_and_torch():
    """bench/training.py --cpu-smoke: the 8-way GPT-3 training plan's layouts at tiny shapes, rank 0's
    program through the prepared program (and the graph row's path), beside torch eager's Megatron step."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "training.py"), "--cpu-smoke", "--only", "tp"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TP 8-way training step" in out.stdout
    for row in ("egraph-did lean", "egraph-did lean + CUDA graph", "torch eager"):
        assert row in out.stdout, out.stdout
