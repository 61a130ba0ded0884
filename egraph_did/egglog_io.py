"""The adapter to egglog's bindings: the two private calls of the project, in one place (docs/egraph.md).

egglog-python's public API builds one command at a time (about 0.5 ms each, growing with the e-graph)
and its public `freeze()` turns every row of every function into declaration objects (0.9 s for a GPT
layer on a 2x4 mesh). Programs of facts as text and the rows of a few functions, read from the bindings,
cost a small fraction of that; everything else (sorts, functions, rulesets, running them) goes through
the public API.
"""
from __future__ import annotations

from collections.abc import Callable

from egglog import EGraph


def run_text(eg: EGraph, rows: list[str], chunk: int = 20) -> None:
    """Run facts given as egglog text, in programs of `chunk` facts (one program's cost grows faster than
    its length: 400 facts a program cost 3.5 times as much as 20 programs of 20, on 96 GPT layers). The
    functions the text names must be declared through the public API first. A union given as a fact costs
    a rebuild that grows with the e-graph: state a relation that a rule turns into a union instead.

    >>> from egglog import i64, relation
    >>> Edge = relation("Edge", i64, i64, egg_fn="Edge")
    >>> eg = EGraph()
    >>> eg.register(Edge(0, 0))
    >>> run_text(eg, ["(Edge 1 2)", "(Edge 2 3)"])
    >>> len(frozen_rows(eg, ["Edge"])[0]["Edge"])
    3
    """
    for k in range(0, len(rows), chunk):
        eg._egraph.run_program(*eg._egraph.parse_program("\n".join(rows[k:k + chunk])))


def frozen_rows(eg: EGraph, names, inputs_only=()) -> tuple[dict[str, list], object]:
    """The rows of the functions `names` as (input values, output value), from the bindings' freeze(), and
    the bindings' EGraph to read primitive values with (`value_to_string`, `value_to_i64`). Values of an
    e-class sort are canonical class ids: two rows with equal ids hold equal terms. The functions in
    `inputs_only` are read as (input values, None): reading a row's output makes a value object, and a 2-D
    mesh's graph holds ~20k run rows (RunOf) whose output no reader needs.

    >>> from egglog import String, i64, relation
    >>> Name = relation("Name", String, i64, egg_fn="Name")
    >>> eg = EGraph()
    >>> eg.register(Name("x", 7))
    >>> rows, raw = frozen_rows(eg, ["Name"])
    >>> [(raw.value_to_string(ins[0]), raw.value_to_i64(ins[1])) for ins, _ in rows["Name"]]
    [('x', 7)]
    >>> frozen_rows(eg, ["Name"], inputs_only={"Name"})[0]["Name"][0][1] is None
    True
    """
    frozen = eg._egraph.freeze().functions
    return {name: [(row.inputs, None) for row in frozen[name].rows] if name in inputs_only else
            [(row.inputs, row.output) for row in frozen[name].rows] for name in names if name in frozen}, eg._egraph


def value_id(raw) -> Callable[[object], int]:
    """The id of a value of the bindings' EGraph `raw` (frozen_rows' second result), as an int: an e-class's
    id for a term's value (two rows with equal ids hold equal terms), an interned string's index, an i64's
    value. Values hash and compare through the bindings (a Rust call each, twice a dict lookup); their ids
    are plain ints. Read by value_to_i64, which returns any value's id (what `str` prints).

    >>> from egglog import String, i64, relation
    >>> Name = relation("Name", String, i64, egg_fn="Name")
    >>> eg = EGraph()
    >>> eg.register(Name("x", 7), Name("y", 7))
    >>> rows, raw = frozen_rows(eg, ["Name"])
    >>> vid = value_id(raw)
    >>> [(vid(ins[1]), f"Value({vid(ins[0])})" == str(ins[0])) for ins, _ in rows["Name"]]
    [(7, True), (7, True)]
    >>> len({vid(ins[0]) for ins, _ in rows["Name"]})  # two strings, two ids
    2
    """
    return raw.value_to_i64


def held_string(text: str) -> str:
    """The string egglog holds for `text`: double quotes become single ones (egglog strings have no escaped
    double quote), so a JSON literal stays one string.

    >>> held_string('{"dims": [0]}')
    "{'dims': [0]}"
    """
    return text.replace('"', "'")


def string_term(text: str) -> str:
    r"""`text` as an egglog string literal in program text (a backslash escaped): what egglog reads back is
    held_string(text).

    >>> print(string_term('say "hi" \\ ok'))
    "say 'hi' \\ ok"
    """
    return '"' + held_string(text).replace("\\", "\\\\") + '"'


__all__ = ["run_text", "frozen_rows", "value_id", "held_string", "string_term"]
