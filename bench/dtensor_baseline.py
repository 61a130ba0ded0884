"""PyTorch DTensor baseline for bench/multigpu.py: the GPT layer of egraph_did.models.gpt_layer as an
nn.Module, tensor-parallel with parallelize_module (ColwiseParallel for q, k, v and the first MLP
linear, RowwiseParallel for the output projections) and, for sequence parallelism, SequenceParallel
on the layer norms with the attention and MLP inputs gathered by PrepareModuleInput (torchtitan's
layout). Weights are copied from the same global tensors the egraph-did plan gets.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype):
        super().__init__()
        self.hd = hidden // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape

        def heads_first(t):
            return t.view(b, s, -1, self.hd).transpose(1, 2)  # -1: the heads this rank holds
        o = F.scaled_dot_product_attention(heads_first(self.wq(x)), heads_first(self.wk(x)),
                                           heads_first(self.wv(x)), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, dtype):
        super().__init__()
        self.w1 = nn.Linear(hidden, 4 * hidden, bias=False, dtype=dtype)
        self.w2 = nn.Linear(4 * hidden, hidden, bias=False, dtype=dtype)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, dtype=dtype)
        self.attn = Attention(hidden, heads, dtype)
        self.ln2 = nn.LayerNorm(hidden, dtype=dtype)
        self.mlp = MLP(hidden, dtype)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def load_weights(layer: Layer, inputs: dict[str, torch.Tensor]) -> Layer:
    """Copy the fusion's inputs (names of egraph_did.models.gpt_layer) into the module."""
    with torch.no_grad():
        layer.ln1.weight.copy_(inputs["ln1_w"])
        layer.ln1.bias.copy_(inputs["ln1_b"])
        layer.ln2.weight.copy_(inputs["ln2_w"])
        layer.ln2.bias.copy_(inputs["ln2_b"])
        for n in ("wq", "wk", "wv", "wo"):
            getattr(layer.attn, n).weight.copy_(inputs[n])
        layer.mlp.w1.weight.copy_(inputs["w1"])
        layer.mlp.w2.weight.copy_(inputs["w2"])
    return layer


def parallelize(layer: Layer, mesh, sequence_parallel: bool) -> Layer:
    """DTensor's tensor parallelism (and sequence parallelism) on a 1-D torch DeviceMesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    if not sequence_parallel:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
    else:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan = {"ln1": SequenceParallel(), "attn": gather,
                "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ln2": SequenceParallel(), "mlp": gather,
                "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=Shard(1))}
    return parallelize_module(layer, mesh, plan)
