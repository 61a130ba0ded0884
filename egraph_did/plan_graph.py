"""A plan as a graph, and its picture: values (a tensor in one layout) and compute steps are nodes,
collectives are edges between two values of one tensor, labelled with kind, mesh axis, bytes and
predicted time. `draw` renders it with matplotlib (PNG, SVG or PDF by the file's suffix).

>>> import egraph_did as ed
>>> from egraph_did.models import mlp
>>> fd = mlp(32, 8192); _ = fd["x"].set_device_mesh(ed.DeviceMesh.arange(4)); _ = fd["y"].set_device_mesh(ed.DeviceMesh.arange(4))
>>> g = plan_graph(ed.optimize(fd, ed.DeviceMesh.arange(4)))
>>> [d["label"] for _, _, d in g.edges(data=True) if d["kind"] == "collective"]
['allgather[x]\\n1 MiB, 12.1 µs']
"""
from __future__ import annotations

import os

import networkx as nx

from .collectives import is_local
from .cost import size_text
from .plan import Collective, ComputeStep, Plan


def plan_graph(plan: Plan) -> nx.DiGraph:
    """The plan as a DiGraph. Nodes: 'v:<value>' (kind 'value': tensor, layout, shape, role input /
    output / intermediate) and 'c<i>:<op>' (kind 'compute': op, rules, time); edges: value -> compute
    -> value (kind 'data') and value -> value for a collective (kind 'collective': coll, axis, bytes,
    time, label).

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> from egraph_did.layout import Layout
    >>> from egraph_did.pins import apply_layout
    >>> fd, mesh = row_sum(8, 64), ed.DeviceMesh.arange(4)
    >>> _ = apply_layout(fd["x"], Layout.from_code("S1"), mesh)
    >>> g = plan_graph(ed.optimize(fd, mesh))
    >>> sorted(n for n, d in g.nodes(data=True) if d["kind"] == "value")
    ['v:x:S1', 'v:y:P', 'v:y:S0']
    """
    g = nx.DiGraph()
    outputs = set(plan.outputs.values())
    inputs = {v for vs in plan.inputs.values() for v in vs}
    for name, v in plan.values.items():
        role = "output" if name in outputs else "input" if name in inputs else "intermediate"
        g.add_node(f"v:{name}", kind="value", tensor=v.tensor, layout=v.layout, shape=tuple(v.shape), role=role,
                   label=f"{v.tensor}\n{v.layout}")
    for i, s in enumerate(plan.steps):
        if isinstance(s, ComputeStep):
            node = f"c{i}:{s.op}"
            g.add_node(node, kind="compute", op=s.op, rules="/".join(s.rules), time=s.time, label=s.op)
            for v in s.reads:
                g.add_edge(f"v:{v}", node, kind="data")
            for v in s.outputs:
                g.add_edge(node, f"v:{v}", kind="data")
        elif isinstance(s, Collective):
            label = (s.kind if is_local(s.kind)  # a slice: no link, no bytes
                     else f"{s.kind}[{s.mesh_axis_name}]\n{size_text(s.bytes)}, {s.time * 1e6:.3g} µs")
            g.add_edge(f"v:{s.src}", f"v:{s.dst}", kind="collective", coll=s.kind, axis=s.mesh_axis_name,
                       bytes=s.bytes, time=s.time, label=label)
    return g


def _positions(g: nx.DiGraph) -> dict:
    """Left to right by topological generation; within one, spread vertically."""
    pos = {}
    for x, layer in enumerate(nx.topological_generations(g)):
        layer = sorted(layer)
        for y, n in enumerate(layer):
            pos[n] = (x, (len(layer) - 1) / 2 - y)
    return pos


def draw(plan: Plan, path: str, title: str | None = None) -> str:
    """Draw the plan to `path` (format from its suffix: .png, .svg, .pdf): tensors as circles coloured
    by layout (inputs with a thick edge, outputs with a double ring), compute steps as grey squares,
    collectives as red arrows labelled kind[axis], bytes and predicted µs. Needs matplotlib.

    >>> import os, tempfile, egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> path = draw(ed.optimize(mlp(8, 16), ed.DeviceMesh.arange(2)), os.path.join(tempfile.mkdtemp(), "p.svg"))
    >>> "<svg" in open(path).read(1000)
    True
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = plan_graph(plan)
    pos = _positions(g)
    layouts = sorted({d["layout"] for _, d in g.nodes(data=True) if d["kind"] == "value"})
    cmap = plt.get_cmap("tab10" if len(layouts) <= 10 else "tab20")
    colour = {lay: cmap(i % cmap.N) for i, lay in enumerate(layouts)}
    ncols = 1 + max((x for x, _ in pos.values()), default=0)
    nrows = 1 + max((abs(y) * 2 for _, y in pos.values()), default=0)
    fig, ax = plt.subplots(figsize=(min(22.0, max(6.0, 0.9 * ncols)), min(12.0, max(3.5, 0.6 * nrows + 1.5))))
    values = [n for n, d in g.nodes(data=True) if d["kind"] == "value"]
    computes = [n for n, d in g.nodes(data=True) if d["kind"] == "compute"]
    data_edges = [(a, b) for a, b, d in g.edges(data=True) if d["kind"] == "data"]
    coll_edges = [(a, b) for a, b, d in g.edges(data=True) if d["kind"] == "collective"]
    nx.draw_networkx_edges(g, pos, edgelist=data_edges, ax=ax, edge_color="0.55", arrows=True, arrowsize=10,
                           node_size=700)
    nx.draw_networkx_edges(g, pos, edgelist=coll_edges, ax=ax, edge_color="tab:red", width=2.2, arrows=True,
                           arrowsize=16, node_size=700, style="solid")
    widths = [3.0 if g.nodes[n]["role"] == "input" else 1.0 for n in values]
    nx.draw_networkx_nodes(g, pos, nodelist=values, ax=ax, node_color=[colour[g.nodes[n]["layout"]] for n in values],
                           node_size=700, edgecolors="black", linewidths=widths)
    outs = [n for n in values if g.nodes[n]["role"] == "output"]
    nx.draw_networkx_nodes(g, pos, nodelist=outs, ax=ax, node_color="none", node_size=1100, edgecolors="black",
                           linewidths=1.0)
    nx.draw_networkx_nodes(g, pos, nodelist=computes, ax=ax, node_color="0.85", node_shape="s", node_size=500,
                           edgecolors="0.4")
    nx.draw_networkx_labels(g, pos, labels={n: g.nodes[n]["label"] for n in values}, ax=ax, font_size=6)
    nx.draw_networkx_labels(g, pos, labels={n: g.nodes[n]["label"] for n in computes}, ax=ax, font_size=6,
                            font_color="0.1")
    nx.draw_networkx_edge_labels(g, pos, edge_labels={(a, b): g.edges[a, b]["label"] for a, b in coll_edges},
                                 ax=ax, font_size=6, font_color="tab:red", rotate=False)
    handles = [plt.Line2D([], [], marker="o", ls="", markersize=9, markerfacecolor=colour[lay],
                          markeredgecolor="black", label=lay) for lay in layouts]
    handles.append(plt.Line2D([], [], color="tab:red", lw=2, label="collective"))
    handles.append(plt.Line2D([], [], marker="s", ls="", markersize=8, markerfacecolor="0.85",
                              markeredgecolor="0.4", label="compute step"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="layout")
    ax.set_title(title or (f"{plan.mesh} · {plan.cost_model.name} · predicted {plan.predicted_time * 1e6:.1f} µs, "
                           f"{len(plan.collectives)} collective(s)"), fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["plan_graph", "draw"]
