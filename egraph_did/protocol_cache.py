"""Python 3.11's runtime protocol checks, made as cheap as 3.12's while egraph_did plans.

egglog-python merges declarations through `isinstance(x, HasDeclarations)`, a runtime-checkable Protocol; on
Python 3.11 each such check walks the protocol's MRO twice (`typing._get_protocol_attrs`), which 3.12 computes
once per class. Planning a 2x2 mesh's tiny Llama training step made ~50,000 of those checks (the template
e-graph's rules, each saturation's schedule, the program rewrites): 0.5-0.6 s of its ~5.8 s CPU, 0.1-0.2 s of the
flat mesh's ~1.8 s. Within `protocol_attrs_cached()` the attributes are computed once per protocol class, as
3.12 does; outside it typing is as it was (a protocol changed between two plans is seen by the next).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import typing

_lock = threading.Lock()
_depth = 0
_plain = None  # typing's own _get_protocol_attrs while a cached one is in place


@contextlib.contextmanager
def protocol_attrs_cached():
    """Inside, `typing._get_protocol_attrs` remembers its answer per protocol class (Python < 3.12 only;
    nested and concurrent uses share one cache, and the outermost exit restores typing's function).

    >>> import typing
    >>> plain = typing._get_protocol_attrs
    >>> with protocol_attrs_cached():
    ...     isinstance(3, typing.SupportsInt)
    True
    >>> typing._get_protocol_attrs is plain
    True
    """
    global _depth, _plain
    if sys.version_info >= (3, 12) or not hasattr(typing, "_get_protocol_attrs"):
        yield
        return
    with _lock:
        if _depth == 0:
            _plain = typing._get_protocol_attrs
            typing._get_protocol_attrs = functools.lru_cache(maxsize=None)(_plain)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                typing._get_protocol_attrs = _plain
                _plain = None

