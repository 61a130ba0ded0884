"""The order in which `pytest -n 2 --dist loadfile` hands the test files to its workers: the slow files first,
slowest first, then the rest in pytest-xdist's own order (most tests first). xdist's order alone puts the
files of one or two tests last, and those are the slowest here (the models on 4 gloo processes, the exact DP's
proofs): the two workers then ended a minute or more apart, one running a slow file alone. Handed out first,
the slow files run side by side and the many short files fill in at the end (longest processing time first).
Which tests run, and how, is unchanged: only the order of the files. tests/conftest.py imports the hook
(standard library and pytest-xdist only); tests/face/test_file_order.py checks the order.

SLOW: seconds a file took at the suite's full run on this 2-core machine (a test's setup, call and teardown
summed), rounded; a file not listed counts as fast. A stale number only costs balance, never a test.
"""
from __future__ import annotations

import pytest

SLOW = {
    "tests/execution/test_strategies_gloo.py": 60,
    "tests/face/test_torchtitan.py": 60,
    "tests/face/test_readme.py": 50,
    "tests/execution/test_training_gloo.py": 50,
    "tests/optimizer/test_extract_dp_4050.py": 47,
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
