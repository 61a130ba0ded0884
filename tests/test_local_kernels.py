"""Local kernels of rank-aware strategies (egraph_did/local.py)."""
import torch

import egraph_did as ed
from egraph_did.layout import Layout, R, S
from egraph_did.shards import Operand, RankContext
from egraph_did.local import run_local

MESH = ed.DeviceMesh.arange(2)


def test_masked_gather_on_class_sharded_logits_keeps_infinite_logits_out_of_other_ranks_summands():
    x = torch.tensor([[0.0, 1.0, -float("inf"), 3.0]])  # -inf: a masked class, as language models pad
    index = torch.tensor([[1]])
    layout = Layout((S(1),))
    operands = {"x": Operand((1, 4), layout), "index": Operand((1, 1), Layout((R,)))}
    outs = [run_local("take_along_axis", {"x": x[:, 2 * r:2 * r + 2], "index": index, "dim": 1}, operands,
                      [Operand((1, 1), Layout((ed.Placement("P"),)))], {"masked_gather": [0]},
                      RankContext(MESH, r))[0] for r in MESH.ranks]
    assert torch.equal(outs[0] + outs[1], torch.tensor([[1.0]]))  # rank 1's lookup lands on -inf: 0, not nan


def test_vocab_parallel_rows_are_summed_once():
    table = torch.arange(12.0).reshape(6, 2)
    ids = torch.tensor([0, 5, 3])
    operands = {"indices": Operand((3,), Layout((R,))), "weight": Operand((6, 2), Layout((S(0),)))}
    outs = [run_local("embedding", {"indices": ids, "weight": table[3 * r:3 * r + 3]}, operands,
                      [Operand((3, 2), Layout((ed.Placement("P"),)))], {"vocab_parallel": [0]},
                      RankContext(MESH, r))[0] for r in MESH.ranks]
    assert torch.equal(outs[0] + outs[1], table[ids])
