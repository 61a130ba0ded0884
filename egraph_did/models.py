"""Fusions of common transformer blocks, written once as for one device (for tests, benchmarks, demo).

>>> fd = mlp(tokens=8, hidden=16)
>>> [t.name for t in fd.fusion.inputs], list(fd.fusion.outputs)
(['x', 'w1', 'w2'], ['y'])
"""
from __future__ import annotations

import math

import torch

from .fusion import FusionDefinition
from .grad import AdamW, training_step


def _mlp_body(fd, x, hidden: int, dtype, prefix: str = ""):
    w1 = fd.define_tensor((4 * hidden, hidden), dtype, name=f"{prefix}w1", axis_names=("4h", "h"))
    w2 = fd.define_tensor((hidden, 4 * hidden), dtype, name=f"{prefix}w2", axis_names=("h", "4h"))
    return fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1)), w2)


def mlp(tokens: int, hidden: int, dtype=torch.float32) -> FusionDefinition:
    """y = linear(gelu(linear(x, w1)), w2), x [tokens, hidden].

    >>> fd = mlp(tokens=8, hidden=16)
    >>> fd["w1"].shape, [e.op.name for e in fd.fusion.exprs]
    ((64, 16), ['linear', 'gelu', 'linear'])
    """
    with FusionDefinition() as fd:
        x = fd.define_tensor((tokens, hidden), dtype, name="x", axis_names=("s", "h"))
        fd.add_output(_mlp_body(fd, x, hidden, dtype), name="y")
    return fd


def _attention_body(fd, x, batch: int, seq: int, hidden: int, heads: int, dtype, prefix: str = "",
                    causal: bool = True):
    hd = hidden // heads

    def heads_first(t):
        return fd.ops.permute(fd.ops.reshape(t, (batch, seq, heads, hd)), (0, 2, 1, 3))

    proj = {}
    for n in ("wq", "wk", "wv", "wo"):
        proj[n] = fd.define_tensor((hidden, hidden), dtype, name=f"{prefix}{n}", axis_names=("h", "h"))
    q, k, v = (heads_first(fd.ops.linear(x, proj[n])) for n in ("wq", "wk", "wv"))
    o = fd.ops.sdpa(q, k, v, is_causal=causal)
    o = fd.ops.reshape(fd.ops.permute(o, (0, 2, 1, 3)), (batch, seq, hidden))
    return fd.ops.linear(o, proj["wo"])


def attention(batch: int, seq: int, hidden: int, heads: int, dtype=torch.float32, causal: bool = True
              ) -> FusionDefinition:
    """Self-attention: q, k, v projections, sdpa over heads, output projection; x [batch, seq, hidden].

    >>> fd = attention(batch=2, seq=8, hidden=16, heads=4)
    >>> [t.name for t in fd.fusion.inputs], fd["y"].shape
    (['x', 'wq', 'wk', 'wv', 'wo'], (2, 8, 16))
    """
    assert hidden % heads == 0
    with FusionDefinition() as fd:
        x = fd.define_tensor((batch, seq, hidden), dtype, name="x", axis_names=("b", "s", "h"))
        fd.add_output(_attention_body(fd, x, batch, seq, hidden, heads, dtype, causal=causal), name="y")
    return fd


def gpt_layer(batch: int, seq: int, hidden: int, heads: int, dtype=torch.float32, layers: int = 1
              ) -> FusionDefinition:
    """`layers` pre-norm GPT layers: x + attn(ln(x)), then + mlp(ln(.)); x [batch, seq, hidden].

    >>> fd = gpt_layer(batch=2, seq=8, hidden=16, heads=4, layers=2)
    >>> len(fd.fusion.inputs), fd["l1.w2"].shape  # x, then 10 weights per layer, named by layer
    (21, (16, 64))
    """
    with FusionDefinition() as fd:
        x = fd.define_tensor((batch, seq, hidden), dtype, name="x", axis_names=("b", "s", "h"))
        h = x
        for i in range(layers):
            p = f"l{i}." if layers > 1 else ""
            g1, b1, g2, b2 = (fd.define_tensor((hidden,), dtype, name=f"{p}{n}", axis_names=("h",))
                              for n in ("ln1_w", "ln1_b", "ln2_w", "ln2_b"))
            a = _attention_body(fd, fd.ops.layer_norm(h, weight=g1, bias=b1), batch, seq, hidden, heads, dtype, p)
            h = fd.ops.add(h, a)
            h = fd.ops.add(h, _mlp_body(fd, fd.ops.layer_norm(h, weight=g2, bias=b2), hidden, dtype, p))
        fd.add_output(h, name="y")
    return fd


def parallel_residual_layer(batch: int, seq: int, hidden: int, heads: int, dtype=torch.float32
                            ) -> FusionDefinition:
    """A GPT-J / PaLM layer: attention and MLP read one layer norm in parallel, y = x + attn(ln(x)) +
    mlp(ln(x)), added left to right as written; x [batch, seq, hidden].

    >>> fd = parallel_residual_layer(batch=2, seq=8, hidden=16, heads=4)
    >>> str(fd.fusion.exprs[-1]), fd["y"].shape  # (x + attn) + mlp
    ('y = add(add_14, linear_17)', (2, 8, 16))
    """
    with FusionDefinition() as fd:
        x = fd.define_tensor((batch, seq, hidden), dtype, name="x", axis_names=("b", "s", "h"))
        g = fd.define_tensor((hidden,), dtype, name="ln_w", axis_names=("h",))
        b = fd.define_tensor((hidden,), dtype, name="ln_b", axis_names=("h",))
        h = fd.ops.layer_norm(x, weight=g, bias=b)
        a = _attention_body(fd, h, batch, seq, hidden, heads, dtype)
        fd.add_output(fd.ops.add(fd.ops.add(x, a), _mlp_body(fd, h, hidden, dtype)), name="y")
    return fd


def gpt_training_step(batch: int, seq: int, hidden: int, heads: int, dtype=torch.float32, layers: int = 1,
                      optimizer=None, recompute: bool | None = None) -> FusionDefinition:
    """One training step of gpt_layer as one fusion: forward, loss = mean((y - target)^2), backward, and
    the optimizer's update (AdamW by default) of every weight (x and target are data). recompute: as
    ed.training_step's (None: the backward reads the forward through saved markers; False: directly).

    >>> fd = gpt_training_step(batch=2, seq=8, hidden=16, heads=4)
    >>> [t.name for t in fd.fusion.inputs][-3:], list(fd.fusion.outputs)[:3]
    (['exp_avg_sq.w1', 'exp_avg.w2', 'exp_avg_sq.w2'], ['loss', 'next.ln1_w', 'next.exp_avg.ln1_w'])
    """
    fd = gpt_layer(batch, seq, hidden, heads, dtype, layers)
    weights = [t.name for t in fd.fusion.inputs if t.name != "x"]
    target = fd.define_tensor((batch, seq, hidden), dtype, name="target", axis_names=("b", "s", "h"))
    err = fd.ops.sub(fd["y"], target)
    fd.add_output(fd.ops.mean(fd.ops.mul(err, err)), name="loss")
    return training_step(fd, "loss", weights, optimizer or AdamW(), recompute=recompute)


def mlp_training_step(tokens: int, hidden: int, dtype=torch.float32, optimizer=None,
                      recompute: bool | None = None) -> FusionDefinition:
    """One training step of mlp as one fusion: loss = mean((y - target)^2), backward, and the optimizer's
    update (AdamW by default) of w1 and w2 (x and target are data). recompute: as gpt_training_step's.

    >>> fd = mlp_training_step(tokens=8, hidden=4)
    >>> [t.name for t in fd.fusion.inputs][:4], list(fd.fusion.outputs)[:2], fd["grad_w1"].shape
    (['x', 'w1', 'w2', 'target'], ['loss', 'next.w1'], (16, 4))
    """
    fd = mlp(tokens, hidden, dtype)
    target = fd.define_tensor((tokens, hidden), dtype, name="target", axis_names=("s", "h"))
    err = fd.ops.sub(fd["y"], target)
    fd.add_output(fd.ops.mean(fd.ops.mul(err, err)), name="loss")
    return training_step(fd, "loss", ["w1", "w2"], optimizer or AdamW(), recompute=recompute)


def mlp_with_backward(tokens: int, hidden: int, dtype=torch.float32) -> FusionDefinition:
    """The MLP forward and a hand-written backward (exact gelu): outputs y, dx, dw1, dw2 given dy.

    >>> fd = mlp_with_backward(tokens=8, hidden=16)
    >>> {name: tv.shape for name, tv in fd.fusion.outputs.items()}
    {'y': (8, 16), 'dw2': (16, 64), 'dx': (8, 16), 'dw1': (64, 16)}
    """
    with FusionDefinition() as fd:
        x = fd.define_tensor((tokens, hidden), dtype, name="x", axis_names=("s", "h"))
        dy = fd.define_tensor((tokens, hidden), dtype, name="dy", axis_names=("s", "h"))
        w1 = fd.define_tensor((4 * hidden, hidden), dtype, name="w1", axis_names=("4h", "h"))
        w2 = fd.define_tensor((hidden, 4 * hidden), dtype, name="w2", axis_names=("h", "4h"))
        h = fd.ops.linear(x, w1)
        g = fd.ops.gelu(h)
        fd.add_output(fd.ops.linear(g, w2), name="y")
        dg = fd.ops.matmul(dy, w2)
        fd.add_output(fd.ops.matmul(fd.ops.transpose(dy, 0, 1), g), name="dw2")
        # gelu'(h) = Phi(h) + h * phi(h)
        cdf = fd.ops.mul(fd.ops.add(fd.ops.erf(fd.ops.mul(h, 1 / math.sqrt(2))), 1.0), 0.5)
        pdf = fd.ops.mul(fd.ops.exp(fd.ops.mul(fd.ops.mul(h, h), -0.5)), 1 / math.sqrt(2 * math.pi))
        dh = fd.ops.mul(dg, fd.ops.add(cdf, fd.ops.mul(h, pdf)))
        fd.add_output(fd.ops.matmul(dh, w1), name="dx")
        fd.add_output(fd.ops.matmul(fd.ops.transpose(dh, 0, 1), x), name="dw1")
    return fd


def row_sum(rows: int, cols: int, dtype=torch.float32) -> FusionDefinition:
    """y = sum(x, 1).

    >>> fd = row_sum(rows=8, cols=64)
    >>> [str(e) for e in fd.fusion.exprs], fd["y"].shape
    (['y = sum(x, dims=1)'], (8,))
    """
    with FusionDefinition() as fd:
        x = fd.define_tensor((rows, cols), dtype, name="x", axis_names=("m", "n"))
        fd.add_output(fd.ops.sum(x, 1), name="y")
    return fd


def layer_norm(rows: int, hidden: int, dtype=torch.float32) -> FusionDefinition:
    """y = layer_norm(x, w, b) over the last axis.

    >>> import torch, egraph_did as ed
    >>> fd = layer_norm(rows=2, hidden=4)
    >>> y = ed.evaluate(fd, {"x": torch.arange(8.).reshape(2, 4), "w": torch.ones(4), "b": torch.zeros(4)})["y"]
    >>> y.mean(1).abs().max().item() < 1e-6  # each row centred
    True
    """
    with FusionDefinition() as fd:
        x = fd.define_tensor((rows, hidden), dtype, name="x", axis_names=("s", "h"))
        w = fd.define_tensor((hidden,), dtype, name="w", axis_names=("h",))
        b = fd.define_tensor((hidden,), dtype, name="b", axis_names=("h",))
        fd.add_output(fd.ops.layer_norm(x, weight=w, bias=b), name="y")
    return fd
