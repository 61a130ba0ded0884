"""The order in which `pytest -n 2 --dist loadfile` hands the test files to its workers: the slow files first,
slowest first, then the rest in pytest-xdist's own order (most tests first). xdist's order alone puts the
files of one or two tests last, and those are the slowest here (the models on 4 gloo processes, the exact DP's
proofs): the two workers then ended a minute or more apart, one running a slow file alone. Handed out first,
the slow files run side by side and the many short files fill in at the end (longest processing time first).
Which tests run, and how, is unchanged: only the order of the files. tests/conftest.py imports the hook
(standard library and pytest-xdist only); tests/face/test_file_order.py checks the order.

SLOW: a file's seconds at the suite's full run (`--durations=60`, its tests' setup, call and teardown summed) at
2796493, on this 2-core machine under a load of 5-7 from other work (about 3x a quiet machine's times; only
their order matters here); a file not listed counts as fast. The files with tests marked serial are left out
on purpose: in xdist's order they come after the slow files, beside files of short tests, so that a serial
test waits for a short test to end, not for a minute-long model setup on the other worker. A stale number only
costs balance, never a test.
"""
from __future__ import annotations

import pytest

SLOW = {
    "tests/optimizer/test_chain.py": 412,  # 465 less the stitched test's own 6-layer plan (53)
    "tests/face/test_torchtitan.py": 237,
    "tests/execution/test_training_gloo.py": 230,
    "tests/execution/test_strategies_gloo.py": 213,
    "tests/execution/test_bench_runtime.py": 166,
    "tests/face/test_readme.py": 145,
    "tests/face/test_parallelize_models.py": 142,
    "tests/optimizer/test_recompute.py": 127,
    "tests/face/test_parallelize_mixtral_grouped.py": 110,
    "tests/face/test_parallelize_meta.py": 100,
    "tests/face/test_compare_tp.py": 98,
    "tests/face/test_parallelize_mixtral.py": 95,
    "tests/face/test_parallelize.py": 83,
    "tests/face/test_parallelize_chain.py": 76,
    "tests/optimizer/test_extract_dp_4050.py": 75,
    "tests/optimizer/test_exact_proof.py": 66,
    "tests/program/test_frontend.py": 64,
    "tests/face/test_cli.py": 58,
    "tests/face/test_parallelize_checkpoint.py": 57,
    "tests/optimizer/test_training_golden.py": 46,
    "tests/execution/test_runtime_lean.py": 41,
}


def slowest_first(scopes: list[str], slow: dict[str, float] = SLOW) -> list[str]:
    """The files in the order to hand out: those in `slow` by their seconds, longest first, then the others in
    their given order.

    >>> slowest_first(["a.py", "b.py", "c.py", "d.py"], {"c.py": 5, "d.py": 50})
    ['d.py', 'c.py', 'a.py', 'b.py']
    """
    return sorted(scopes, key=lambda s: -slow.get(s, 0))  # stable: the unlisted keep xdist's order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown to pytest without it
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile's scheduler, handing the files out slowest first; other modes keep xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SlowestFirst(LoadFileScheduling):
        _ordered = False

        def _assign_work_unit(self, node):
            if not self._ordered:  # the work queue is complete at the first assignment
                self._ordered = True
                queue = self.workqueue
                for scope in slowest_first(list(queue)):
                    queue.move_to_end(scope)
            super()._assign_work_unit(node)

    return SlowestFirst(config, log)
