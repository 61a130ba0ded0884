"""Every Python block of the README runs as written: the blocks, in order, make one script, run in a fresh
interpreter (kernels under TRITON_INTERPRET=1, the launch block on 4 gloo processes)."""
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(text: str) -> list[str]:
    """The ```python fenced blocks of a markdown text, in order.

    >>> python_blocks("a\\n```python\\nx = 1\\n```\\n```bash\\nls\\n```\\n```python\\ny = x\\n```\\n")
    ['x = 1\\n', 'y = x\\n']
    """
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_the_use_and_launch_blocks():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 2
    assert any("ed.optimize(" in b for b in blocks) and any("ed.launch(" in b for b in blocks)
    placeholder = re.compile(r"^\s*\w+\s*=\s*\.\.\.", re.M)  # `small = ...`: a line a new user cannot run
    assert not any(placeholder.search(b) for b in blocks)


def test_every_readme_python_block_runs_as_written(tmp_path):
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n".join(python_blocks(README.read_text())))
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"README blocks failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert "allreduce" in run.stdout  # explain() and the collectives were printed
