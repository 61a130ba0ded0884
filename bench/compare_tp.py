"""Collective bytes per forward: egraph-did's plan against torchtitan's tensor-parallel plan for Llama
(issue 11, item 4), 4 ranks, in two sections:
  - hf: transformers' LlamaForCausalLM under a transcription of torchtitan's apply_tp (below);
  - torchtitan: torchtitan 0.3.0's own Llama3Model under its own model.parallelize (the section headed
    "torchtitan's own Llama3 and its own TP" further down; tests/face/test_torchtitan.py checks it).

    .venv/bin/python -m bench.compare_tp            # prints both tables (bench/results_compare_tp.txt)
    .venv/bin/python -m bench.compare_tp --section torchtitan

The hf section's torchtitan side. Its `apply_tp` (torchtitan/models/llama3/infra/parallelize.py of the
torchtitan this was written against) is transcribed onto transformers' module names with torch's own DTensor API (`parallelize_module`,
ColwiseParallel / RowwiseParallel / SequenceParallel / PrepareModuleInput), see `titan_plan`. Its
collectives are counted with torch.distributed.tensor.debug.CommDebugMode (`CountingCommMode` adds,
per functional collective CommDebugMode counts, the tensors' sizes and the group size; its own
get_comm_counts() must agree with the records). Counted twice:
  - tiny:  4 gloo processes (ed.launch), the real module, logits checked against the unsharded module;
  - 8b-width: one process posing as rank 0 of 4 (torch's "fake" process group: every collective is a
    no-op of the right shape), the module on the meta device, at the size egraph-did chose its layouts.

egraph-did's side. ed.from_torch at the same example inputs, input_ids pinned replicated (torchtitan's
embedding takes Replicate()) and logits pinned as torchtitan delivers them (replicated; vocab-sharded,
Shard(-1), under loss parallel), optimized on ed.DeviceMesh.arange(4) with CostModel.h200(). At the tiny
size every op is latency-bound and the cost model replicates the whole model (no collective: printed
as a footnote); so, as the README does for the GPT block, the layouts are chosen at the 8b-width size
(hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 32000, seq 4096, batch 2, 2 layers, float32) and
replayed on the tiny model with `like=`. Two plans per logits pin:
  - free:         only input_ids and logits pinned: egraph-did decides every weight's layout;
  - same weights: every weight pinned to torchtitan's placement (q/k/v/gate/up/embedding/lm_head split
                  on dim 0, o/down on dim 1, norms replicated): the same parameter memory per rank.
The tiny plans run on the same 4 gloo processes and must equal the module's logits (float32, rtol 1e-5).

Bytes, one quantity on both sides. Per collective, `bytes` is egraph-did's Collective.bytes convention
(collectives.Kind.nbytes): the whole buffer of the collective: the gathered output of an allgather, the
full input of a reduce_scatter or allreduce, the local input of an alltoall. For torchtitan's functional
collectives the same: all_gather_into_tensor -> output bytes, reduce_scatter_tensor / all_reduce /
all_to_all_single -> input bytes. `wire` is what each rank sends (= receives) under ring algorithms:
phases * (p-1)/p * bytes (allreduce: 2 phases, reduce-scatter then allgather; the others one), egraph-did's
KINDS[kind].phases and .factor(p) on both sides; the ratio is ours/theirs in wire bytes (an allreduce
moves what a reduce_scatter plus an allgather move, so `bytes` alone would favour TP's allreduces).
egraph-did's `slice` steps (R -> S, no communication) are not collectives and are not counted.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import egraph_did as ed  # noqa: E402
from egraph_did.collectives import KINDS  # noqa: E402
from egraph_did.grad import GRAD_PREFIX  # noqa: E402
from egraph_did.parallelize import COTANGENT, _replicated, optimize_joint  # noqa: E402
from egraph_did.plan_split import HANDOVER_PREFIX  # noqa: E402
from egraph_did.runtime import torch_device_mesh  # noqa: E402

P = 4  # ranks
MESH = ed.DeviceMesh.arange(P)
BATCH = 2
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=64)
TINY_SEQ = 16
BIG = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
           num_key_value_heads=8, max_position_embeddings=8192)
BIG_SEQ = 4096
RTOL = 1e-5

# variant -> (what torchtitan's apply_tp is given, how logits come out)
VARIANTS = {
    "TP": "no sequence parallel (torchtitan has none: apply_tp with every Shard(1) boundary Replicate())",
    "TP+SP": "apply_tp, loss_parallel=False: logits Replicate()",
    "TP+SP+LP": "apply_tp, loss_parallel=True (torchtitan's default): logits Shard(-1), vocab-sharded",
}
LOGITS_SHARDED = {"TP": False, "TP+SP": False, "TP+SP+LP": True}

# torchtitan's weight placements on HF names: the parameter's split dim (None: replicated)
WEIGHT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "embed_tokens": 0, "lm_head": 0,
              "o_proj": 1, "down_proj": 1}


def llama_config(size: str):
    import transformers
    return transformers.LlamaConfig(**(TINY if size == "tiny" else BIG))


def tiny_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    """The tiny LlamaForCausalLM (random weights, seed 0, eval) and its token ids [2, 16]."""
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config("tiny")).eval()
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, TINY_SEQ), generator=torch.Generator().manual_seed(1))
    return model, ids


# ---------------------------------------------------------------------- torchtitan's plan on HF names

def titan_plan(model: torch.nn.Module, mesh, variant: str) -> torch.nn.Module:
    """torchtitan's apply_tp (llama3) applied to a transformers LlamaForCausalLM, in place. Names: its
    tok_embeddings / norm / output are HF's model.embed_tokens / model.norm / lm_head; attention.wq/wk/wv/wo
    are self_attn.q/k/v/o_proj; feed_forward.w1/w3/w2 are mlp.gate/up/down_proj; attention_norm / ffn_norm
    are input_layernorm / post_attention_layernorm. Differences, all forced by HF's code and none moving a
    byte: HF's decoder layer calls self_attn with hidden_states as a keyword, so its PrepareModuleInput uses
    input_kwarg_layouts where torchtitan gives input_layouts=(Shard(1), None, None, None); q_norm/k_norm do
    not exist in Llama (torchtitan names them for its Qwen-style variant). "TP" has no torchtitan
    counterpart (its apply_tp always sequence-parallelizes): the same styles with every Shard(1) boundary
    Replicate(), no SequenceParallel and no PrepareModuleInput (PyTorch's TP tutorial without SP)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    sp = variant != "TP"
    loss_parallel = variant == "TP+SP+LP"
    if sp:
        root = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1),
                                       output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel),
        }
        layer = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.up_proj": ColwiseParallel(),
        }
    else:
        root = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        }
        layer = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
        }
    parallelize_module(model, mesh, root)
    for block in model.model.layers:
        parallelize_module(block, mesh, layer)
    return model


def titan_forward(model, ids):
    """The forward torchtitan's plan runs. position_ids are given: HF numbers positions by the length of
    the embedding's output, which sequence parallel leaves a quarter long on each rank (torchtitan's model
    takes its rotary table from the tokens); they are what the module computes by itself unsharded."""
    return model(ids, use_cache=False, position_ids=torch.arange(ids.shape[1], device=ids.device)[None]).logits


# ---------------------------------------------------------------------- counting with CommDebugMode

_KIND = {"all_gather_into_tensor": "allgather", "reduce_scatter_tensor": "reduce_scatter",
         "all_reduce": "allreduce", "all_to_all_single": "alltoall"}


@dataclass
class Record:
    kind: str  # egraph-did's name of the collective
    bytes: float  # Collective.bytes convention (module docstring)
    group: int
    module: str  # CommDebugMode's module tracker: where it happened

    @property
    def wire(self) -> float:
        return wire_bytes(self.kind, self.bytes, self.group)


def wire_bytes(kind: str, nbytes: float, p: int) -> float:
    """What each rank sends (= receives) for a collective of `nbytes` (Collective.bytes convention)."""
    k = KINDS[kind]
    return k.phases * k.factor(p) * nbytes


class CountingCommMode:
    """torch's CommDebugMode, which counts the functional collectives DTensor issues, plus a record of
    each one's tensors: kind, bytes, group size and the module it ran in."""

    def __new__(cls):
        from torch.distributed.tensor.debug import CommDebugMode

        class _Mode(CommDebugMode):
            def __init__(self):
                super().__init__()
                self.records: list[Record] = []
                self.advanced_module_tracker = _OnceHookedTracker()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
                    return out
                name = func._overloadpacket._qualified_op_name.split("::")[-1]
                if func._overloadpacket in self.comm_registry and name in _KIND:
                    self.records.append(_record(_KIND[name], args, out, self.advanced_module_tracker.name))
                elif func._overloadpacket in self.comm_registry:
                    raise NotImplementedError(f"CountingCommMode: no byte rule for {func}")
                return out

        return _Mode()


def _OnceHookedTracker():
    """CommDebugMode's module tracker, made safe for modules that share a name. Its pre-hook registers a
    post-hook on the module at each call and keeps the handles in a dict keyed by the module's name, so
    of two modules named alike only the last one's hook is removed on exit: the other's stays on the
    module and pops the parent stack of the next CommDebugMode, which fails (IndexError) or misnames
    modules. transformers 5.25 wraps apply_rotary_pos_emb as a module ("Func", new instances per call,
    some kept). This one keeps one post-hook per module object and removes all of them on exit."""
    import weakref

    from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker

    class Tracker(_CommModeModuleTracker):
        def __enter__(self):
            self.post_hook_of = weakref.WeakKeyDictionary()  # module -> the one post-hook it has from us
            return super().__enter__()

        def _fw_pre_hook(self, mod, input):
            if mod in self.post_hook_of:
                self.post_hook_of.pop(mod).remove()
            before = set(mod._forward_hooks)
            super()._fw_pre_hook(mod, input)
            handle = self.register_forward_hook_handles.get(self.name)
            if handle is not None and handle.id in set(mod._forward_hooks) - before:
                self.post_hook_of[mod] = handle

        def __exit__(self, *args):
            super().__exit__(*args)
            for handle in list(self.post_hook_of.values()):
                handle.remove()

    return Tracker()


def _record(kind: str, args, out, module: str) -> Record:
    inp = args[0]
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    if kind == "allgather":  # (input, group_size, group_name)
        group, b = int(args[1]), nbytes(out)
    elif kind == "reduce_scatter":  # (input, reduce_op, group_size, group_name)
        group, b = int(args[2]), nbytes(inp)
    elif kind == "allreduce":  # (input, reduce_op, group_name)
        group, b = dist.get_world_size(), nbytes(inp)  # one 1-D mesh of every rank here
    else:  # alltoall (input, output_split_sizes, input_split_sizes, group_name)
        group, b = dist.get_world_size(), nbytes(inp)
    return Record(kind, float(b), group, module)


def count_titan(model, ids, variant: str, mesh) -> tuple[list[Record], torch.Tensor, dict]:
    """(records, logits as given, CommDebugMode's own counts) of one forward under torchtitan's plan."""
    model = titan_plan(model, mesh, variant)
    mode = CountingCommMode()
    with torch.no_grad(), mode:
        logits = titan_forward(model, ids)
    counts = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    assert mode.get_total_counts() == len(mode.records), (mode.get_comm_counts(), mode.records)
    return mode.records, logits, counts


@contextlib.contextmanager
def _no_packed_sequence_check():
    """On the meta device, HF's mask code asks whether given position_ids pack several sequences by
    reading a value (Tensor.item): impossible on meta. They do not (they are arange): say so."""
    import transformers.masking_utils as mu
    saved = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = saved


def count_titan_big(variant: str) -> list[Record]:
    """torchtitan's collectives at the 8b-width size: rank 0 of a fake 4-rank process group (collectives
    are shape-only no-ops; TP ranks all issue the same ones), the module on the meta device."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=P)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(llama_config("big")).eval()
        ids = torch.zeros(BATCH, BIG_SEQ, dtype=torch.int64, device="meta")
        with _no_packed_sequence_check():
            records, _, _ = count_titan(model, ids, variant, init_device_mesh("cpu", (P,)))
        return records
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- egraph-did's plans

def pin(fd, model, logits_sharded: bool, same_weights: bool):
    """input_ids replicated; logits replicated or split on the vocabulary; with same_weights, every weight
    where torchtitan's plan puts it."""
    fd["input_ids"].set_device_mesh(MESH)
    if logits_sharded:
        fd["logits"].set_device_mesh(MESH).outer_split(2, P).axis(2).parallelize(ed.ParallelType.DIDx)
    else:
        fd["logits"].set_device_mesh(MESH)
    if same_weights:
        for name in fd.params:
            dim = WEIGHT_DIM.get(name.split(".")[-2])
            if dim is None:
                fd[name].set_device_mesh(MESH)
            else:
                fd[name].set_device_mesh(MESH).outer_split(dim, P).axis(dim).parallelize(ed.ParallelType.DIDx)
    return fd


_BIG_MODEL = None


def big_llama():
    """The 8b-width model: built on meta, given (uninitialized) CPU storage: from_torch folds the rotary
    tables, which it cannot compare on meta (frontend._tensor calls torch.equal)."""
    global _BIG_MODEL
    if _BIG_MODEL is None:
        import transformers
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(llama_config("big")).eval()
        model = model.to_empty(device="cpu")
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # its inv_freq, computed
        _BIG_MODEL = model
    return _BIG_MODEL


def ed_plans(model, ids, logits_sharded: bool, same_weights: bool, extractor: str = "greedy"):
    """(big plan, tiny plan, tiny fusion): layouts chosen at the 8b-width size, replayed on the tiny model."""
    big = big_llama()
    bfd = pin(ed.from_torch(big, (torch.zeros(BATCH, BIG_SEQ, dtype=torch.int64),), {"use_cache": False}),
              big, logits_sharded, same_weights)
    big_plan = ed.optimize(bfd, MESH, ed.CostModel.h200(), extractor=extractor)
    fd = pin(ed.from_torch(model, (ids,), {"use_cache": False}), model, logits_sharded, same_weights)
    return big_plan, ed.optimize(fd, MESH, ed.CostModel.h200(), like=big_plan), fd


def plan_records(plan) -> list[Record]:
    return [Record(c.kind, float(c.bytes), MESH.shape[c.mesh_axis], c.tensor)
            for c in plan.collectives if KINDS[c.kind].phases > 0]


# ---------------------------------------------------------------------- one gloo run for everything

def gloo_worker(rank: int, state: dict, ids: torch.Tensor, plans: dict, bound: dict):
    """On each of 4 gloo ranks: the unsharded logits, each torchtitan variant's records and logits, and each
    egraph-did plan's logits; rank 0's return carries the comparisons."""
    from torch.distributed.device_mesh import init_device_mesh
    import transformers
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama_config("tiny")).eval()
    base.load_state_dict(state)
    with torch.no_grad():
        want = base(ids, use_cache=False).logits
    mesh = init_device_mesh("cpu", (P,))
    out = {"titan": {}, "ed": {}, "scale": float(want.abs().max())}
    for variant in VARIANTS:
        records, logits, counts = count_titan(copy.deepcopy(base), ids, variant, mesh)
        if isinstance(logits, torch.distributed.tensor.DTensor):
            logits = logits.full_tensor()  # outside the counted forward
        out["titan"][variant] = (records, counts, _rel_err(logits, want))
    for key, plan_json in plans.items():
        got = ed.Plan.from_json(plan_json).run(bound, inputs="global", outputs="global")["logits"]
        out["ed"][key] = _rel_err(got, want)
    return out


def _rel_err(got, want) -> float:
    """The largest absolute difference, after assert_close at rtol = atol = 1e-5 (tests/program's TOL)."""
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL)
    return float((got - want).abs().max())


# ---------------------------------------------------------------------- the comparison

@dataclass
class Row:
    variant: str
    size: str
    titan: list[Record]
    ours: dict[str, list[Record]] = field(default_factory=dict)  # plan name -> records


def summary(records: list[Record]) -> str:
    c = Counter(r.kind for r in records)
    return " ".join(f"{k}x{n}" for k, n in sorted(c.items())) or "none"


def total(records: list[Record], what: str = "wire") -> float:
    return sum(getattr(r, what) for r in records)


def compare(extractor: str = "greedy", big: bool = True, log=print) -> dict:
    """Everything the table shows: {'rows': [Row], 'checks': gloo results, 'plans': {key: (big, tiny)},
    'tiny_free': records of the plan chosen at the tiny size itself}."""
    model, ids = tiny_llama()
    t0 = time.perf_counter()
    plans = {}
    for sharded in (False, True):
        for same in (False, True):
            key = ("vocab-sharded" if sharded else "replicated", "same weights" if same else "free")
            plans[key] = ed_plans(model, ids, sharded, same, extractor)
    log(f"# egraph-did plans chosen in {time.perf_counter() - t0:.1f} s")
    fd = plans[("replicated", "free")][2]
    tiny_free = pin(ed.from_torch(model, (ids,), {"use_cache": False}), model, False, False)
    tiny_free_plan = ed.optimize(tiny_free, MESH, ed.CostModel.h200())
    bound = fd.bind(ids, use_cache=False)
    t0 = time.perf_counter()
    checks = ed.launch(gloo_worker, nprocs=P, backend="gloo", timeout=600,
                       args=(model.state_dict(), ids, {"/".join(k): p[1].to_json() for k, p in plans.items()},
                             bound))[0]
    log(f"# gloo run (torchtitan variants + egraph-did plans, 4 ranks) in {time.perf_counter() - t0:.1f} s")
    rows = []
    for variant in VARIANTS:
        out = "vocab-sharded" if LOGITS_SHARDED[variant] else "replicated"
        for size in ("tiny", "8b-width") if big else ("tiny",):
            titan = checks["titan"][variant][0] if size == "tiny" else count_titan_big(variant)
            row = Row(variant, size, titan)
            for how in ("free", "same weights"):
                big_plan, tiny_plan, _ = plans[(out, how)]
                row.ours[how] = plan_records(tiny_plan if size == "tiny" else big_plan)
            rows.append(row)
    return {"rows": rows, "checks": checks, "extractor": extractor, "plans": plans,
            "tiny_free": plan_records(tiny_free_plan), "tiny_free_plan": tiny_free_plan}


def _fmt(n: float) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            return f"{n / f:.4g} {unit}"
    return f"{n:.0f} B"


def table(result: dict) -> str:
    lines = []
    head = (f"{'model':<6} {'variant':<9} {'size':<8} | {'torchtitan collectives':<36} {'bytes':>10} {'wire':>10} | "
            f"{'egraph-did plan':<13} {'collectives':<46} {'bytes':>10} {'wire':>10} | {'ratio':>5}")
    lines += [head, "-" * len(head)]
    for row in result["rows"]:
        for i, (how, ours) in enumerate(row.ours.items()):
            left = (f"{'llama':<6} {row.variant:<9} {row.size:<8} | {summary(row.titan):<36} "
                    f"{_fmt(total(row.titan, 'bytes')):>10} {_fmt(total(row.titan)):>10}") if i == 0 else \
                " " * (6 + 1 + 9 + 1 + 8) + " | " + " " * (36 + 1 + 10 + 1 + 10)
            ratio = total(ours) / total(row.titan)
            lines.append(f"{left} | {how:<13} {summary(ours):<46} {_fmt(total(ours, 'bytes')):>10} "
                         f"{_fmt(total(ours)):>10} | {ratio:5.2f}")
    return "\n".join(lines)


def report(result: dict) -> str:
    checks = result["checks"]
    out = [table(result), "",
           "bytes: the collectives' buffers (allgather: gathered output; reduce_scatter, allreduce: full input;",
           "alltoall: local input), summed over one forward. wire: what each rank sends (= receives), ring",
           "algorithms: phases * (p-1)/p * bytes, allreduce 2 phases. ratio: egraph-did wire / torchtitan wire.",
           "torchtitan: CommDebugMode on 4 gloo ranks (tiny) or rank 0 of a fake 4-rank group on meta (8b-width);",
           f"egraph-did: plan.collectives of the plan chosen at 8b-width ({result['extractor']} extractor), "
           "replayed at tiny with like=.", "",
           f"tiny: hidden {TINY['hidden_size']}, {TINY['num_attention_heads']} heads, "
           f"{TINY['num_key_value_heads']} KV heads, MLP {TINY['intermediate_size']}, vocab {TINY['vocab_size']}, "
           f"{TINY['num_hidden_layers']} layers, batch {BATCH}, seq {TINY_SEQ}, float32",
           f"8b-width: hidden {BIG['hidden_size']}, {BIG['num_attention_heads']} heads, "
           f"{BIG['num_key_value_heads']} KV heads, MLP {BIG['intermediate_size']}, vocab {BIG['vocab_size']}, "
           f"{BIG['num_hidden_layers']} layers, batch {BATCH}, seq {BIG_SEQ}, float32", ""]
    out.append("logits on 4 gloo ranks against the unsharded module: torch.testing.assert_close(rtol=1e-5, "
               f"atol=1e-5) passed; largest |difference| (largest |logit| {checks['scale']:.3g}):")
    for variant, (_, counts, err) in checks["titan"].items():
        out.append(f"  torchtitan {variant:<9} {err:.2e}   CommDebugMode.get_comm_counts(): {counts}")
    for key, err in checks["ed"].items():
        out.append(f"  egraph-did {key:<28} {err:.2e}")
    out += ["", "parameters each egraph-did plan splits (8b-width plan; the rest replicated on every rank):"]
    for (logits, how), (big_plan, _, fd) in result["plans"].items():
        split = [n for n in fd.params if "DID" in big_plan.loop_domain(n)]
        out.append(f"  logits {logits}, {how}: {len(split)} of {len(fd.params)} parameters split; "
                   f"predicted memory {big_plan.memory / 2**30:.3g} GiB per rank")
    tf = result["tiny_free_plan"]
    out += ["", f"footnote: chosen at the tiny size itself (logits replicated, free), the plan has "
                f"{len(result['tiny_free'])} collectives: every weight replicated, predicted "
                f"{tf.predicted_time * 1e6:.1f} us (latency-bound)", ""]
    out.append("where each torchtitan collective runs (tiny, module: kind bytes):")
    for row in result["rows"]:
        if row.size == "tiny":
            out.append(f"  {row.variant}: " + ", ".join(f"{r.module or '-'}: {r.kind} {r.bytes:.0f}"
                                                       for r in row.titan))
    out.append("")
    out.append("egraph-did's collectives (tiny, tensor: kind bytes):")
    for (logits, how), (_, tiny, _) in result["plans"].items():
        out.append(f"  logits {logits}, {how}: " + ", ".join(f"{r.module}: {r.kind} {r.bytes:.0f}"
                                                            for r in plan_records(tiny)))
    return "\n".join(out)


# ---------------------------------------------------------------------- torchtitan's own Llama3 and its own TP
#
# torchtitan 0.3.0 (scripts/setup.sh installs it, --no-deps): its Llama3Model (torchtitan.models.llama3.model,
# built from Llama3Model.Config as its config_registry builds the 8B: fused wqkv, complex rotary table, SwiGLU)
# and its tensor parallelism: parallelize_llama calls model.parallelize(parallel_dims), which applies the
# sharding configs set_llama3_sharding_config(config, enable_sp=...) declares (the same function
# Llama3Model.Config.update_from_config calls with parallelism.enable_sequence_parallel). parallelize_llama
# itself also needs the trainer's compile/activation-checkpoint/FSDP configs; with tp only its FSDP step is
# a degree-1 MixedPrecisionPolicy, so calling model.parallelize is its tensor-parallel part exactly.
# Three settings differ from torchtitan's defaults, each forced by this CPU machine or by the counting:
#   - spmd_backend="partial_dtensor" (torchtitan's DTensor-for-model-parallel-axes backend): the default,
#     "spmd_types", issues its collectives outside DTensor, where CommDebugMode counts none (0 counted);
#   - torchtitan.distributed.parallel_dims.device_type = "cpu": torchtitan picks "cuda" without an accelerator;
#   - the inner attention is torchtitan's ScaledDotProductAttention (causal) instead of FlexAttention, which
#     needs torch.compile with inductor; on one causal document (positions None, no mask) both are causal
#     attention, and attention moves no data under either TP plan (heads split, local).
# lm_head's output is vocab-sharded (Shard(-1)) in this version whatever the flags (loss parallel always), so
# egraph-did's logits are pinned vocab-sharded too.

TITAN = dict(dim=64, n_heads=8, n_kv_heads=4, vocab_size=256, hidden_dim=128, n_layers=2)  # TINY's model
TITAN_VARIANTS = {"TP": False, "TP+SP": True}  # variant -> enable_sequence_parallel
# bytes per rank the egraph-did plan may hold (plan.memory); at this bound greedy splits 10 of the 12 weight matrices
# (the embedding table and one wo stay whole: splitting the table costs an all-to-all) and the 5 norms stay whole.
# (With the greedy extraction of session 7 it split all 12 here; the present one finds plans that send less.)
TITAN_LIMIT = 330_000
# bytes per rank the training step's joint plan may hold (the same sum over its forward and backward values,
# weights, gradients and saved activations): the smallest the greedy extraction finds needs 1.55 MiB; at this
# bound the plan splits the same 12 weight matrices torchtitan does and keeps the 5 norms whole
STEP_LIMIT = 1_700_000


def titan_llama3_config(enable_sp: bool, dim=64, n_heads=8, n_kv_heads=4, vocab_size=256, hidden_dim=128,
                        n_layers=2, max_seq_len=64):
    """torchtitan's Llama3Model.Config at a small size, built as its config_registry builds the 8B (fused qkv,
    ComplexRoPE with llama scaling off: the tables fit max_seq_len), sharding configs declared for TP with or
    without sequence parallel, SDPA attention (see above)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    layers = _build_llama3_layers(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                  hidden_dim=hidden_dim, attn_backend="flex",
                                  rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=max_seq_len, theta=500000))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab_size, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_output_linear_init(dim)))
    set_llama3_sharding_config(config, enable_sp=enable_sp)
    return config


def titan_llama3(enable_sp: bool = True, seed: int = 0, **size) -> torch.nn.Module:
    """torchtitan's Llama3Model, its weights from its own init_states under torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    model = titan_llama3_config(enable_sp, **size).build()
    model.init_states()
    return model


def titan_tokens() -> torch.Tensor:
    return torch.randint(0, TITAN["vocab_size"], (BATCH, TINY_SEQ), generator=torch.Generator().manual_seed(1))


def titan_parallelize(model: torch.nn.Module) -> torch.nn.Module:
    """torchtitan's tensor parallelism on every rank of the default group (tp = world size), in place: the
    sharding the model's config declares (enable_sp was given to titan_llama3)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    parallel_dims.device_type = "cpu"  # torchtitan's default without an accelerator is "cuda"
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=dist.get_world_size(), pp=1, ep=1,
                                      world_size=dist.get_world_size(), spmd_backend="partial_dtensor")
    dims.build_mesh()
    model.parallelize(dims)
    return model


def count_titan3(model, ids) -> tuple[list[Record], torch.Tensor, dict]:
    """(records, logits as given, CommDebugMode's counts) of one forward of the parallelized model."""
    mode = CountingCommMode()
    with torch.no_grad(), mode:
        logits = model(ids)
    counts = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    assert mode.get_total_counts() == len(mode.records), (mode.get_comm_counts(), mode.records)
    return mode.records, logits, counts


def titan3_plan(model, ids, memory_limit: float = TITAN_LIMIT):
    """(plan, fusion): egraph-did's plan for torchtitan's model, tokens replicated and logits vocab-sharded as
    torchtitan takes and gives them, at the memory bound."""
    fd = ed.from_torch(model, (ids,))
    fd["tokens"].set_device_mesh(MESH)
    fd["out"].set_device_mesh(MESH).outer_split(2, P).axis(2).parallelize(ed.ParallelType.DIDx)
    return ed.optimize(fd, MESH, ed.CostModel.h200(memory_limit)), fd


def titan_cotangent() -> torch.Tensor:
    """d(loss)/d(logits) for the forward+backward count: fixed, the same on every rank."""
    return torch.randn(BATCH, TINY_SEQ, TITAN["vocab_size"], generator=torch.Generator().manual_seed(2))


def count_titan3_step(model, ids, cotangent) -> tuple[list[Record], dict[str, torch.Tensor]]:
    """(records, full gradients) of one forward and backward of the parallelized model, the cotangent given
    in the logits' placements (vocab-sharded, as torchtitan's loss-parallel cross-entropy hands it back).
    A gradient left Partial (torchtitan leaves the reduction of some to FSDP's gradient reduce-scatter)
    must still be summed over the ranks before the optimizer reads it: it is recorded as the allreduce
    that does so (module '<name> (pending)'), outside the counted mode."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    mode = CountingCommMode()
    with mode:
        logits = model(ids)
        ct = distribute_tensor(cotangent, logits.device_mesh, logits.placements) if isinstance(logits, DTensor) \
            else cotangent
        logits.backward(ct)
    records = list(mode.records)
    grads = {}
    for name, p in model.named_parameters():
        if any(q.is_partial() for q in p.grad.placements):
            local = p.grad.to_local()
            records.append(Record("allreduce", float(local.numel() * local.element_size()), P, f"{name} (pending)"))
        grads[name] = p.grad.full_tensor()
    return records, grads


def titan3_worker(rank: int, ids: torch.Tensor, plans: dict, bound: dict) -> dict:
    """On each of 4 gloo ranks: torchtitan's TP (without and with SP) counted over a forward and over a
    forward and backward, its logits and gradients checked against the unsharded model, and egraph-did's
    plans (plans: {"forward": json, "step": {"first": json, "second": json}}, the step optional) run to the
    same logits and gradients: the forward plan, and the training step's two parts as ed.parallelize runs
    them (the first's saved values handed to the second as each rank's local shards)."""
    reference = titan_llama3()
    want = reference(ids)
    cotangent = titan_cotangent()
    want.backward(cotangent)
    want_grads = {n: p.grad for n, p in reference.named_parameters()}
    want = want.detach()
    out = {"titan": {}, "step": {}, "scale": float(want.abs().max())}
    for variant, sp in TITAN_VARIANTS.items():
        records, logits, counts = count_titan3(titan_parallelize(titan_llama3(sp)), ids)
        placements = str(logits.placements) if isinstance(logits, torch.distributed.tensor.DTensor) else "local"
        logits = logits.full_tensor() if placements != "local" else logits  # outside the counted forward
        out["titan"][variant] = (records, counts, _rel_err(logits, want), placements)
        if "step" in plans:
            step, grads = count_titan3_step(titan_parallelize(titan_llama3(sp)), ids, cotangent)
            out["step"][variant] = (step, max(_rel_err(grads[n], want_grads[n]) for n in want_grads))
    got = ed.Plan.from_json(plans["forward"]).run(bound, inputs="global", outputs="global")["out"]
    out["ours"] = _rel_err(got, want)
    if "step" in plans:
        first, second = (ed.Plan.from_json(plans["step"][k]) for k in ("first", "second"))
        kept = first.run(bound, inputs="global", outputs="local")  # as ed.parallelize runs the two parts
        from torch.distributed.tensor import DTensor, Shard
        logits = DTensor.from_local(kept["out"], torch_device_mesh(MESH, "cpu"), [Shard(2)])  # vocab-sharded, pinned
        out["ours_step_logits"] = _rel_err(logits.full_tensor(), want)
        whole = bound | {COTANGENT + "out": cotangent}
        given = {k: _replicated(MESH, v) for k, v in whole.items() if k in second.inputs}
        given |= {k: v for k, v in kept.items() if k.startswith(HANDOVER_PREFIX)}
        grads = second.run(given, inputs="local", outputs="global")
        out["ours_step"] = max(_rel_err(grads[GRAD_PREFIX + n], want_grads[n]) for n in want_grads)
    return out


def titan3_step_plans(fd):
    """egraph-did's training step for torchtitan's model, as ed.parallelize makes it: one joint plan of the
    forward and the vector-Jacobian product (tokens replicated, logits and their cotangent vocab-sharded, the
    pins of fd), optimized once under STEP_LIMIT, every parameter and its gradient pinned where the plan
    keeps the parameter, split into the forward part and the backward part (what the forward saves for the
    backward: split.saved)."""
    return optimize_joint(fd, ["out"], list(fd.params), MESH, ed.CostModel.h200(STEP_LIMIT))


def compare_titan3(log=print, step: bool = True) -> dict:
    """The torchtitan comparison: {'titan': {variant: (records, counts, err, placements)}, 'ours': records,
    'ours_err', 'plan', 'fd', 'scale'}; with step, the forward+backward too: 'step': {variant: (records,
    gradient err)}, 'ours_step': records of the joint plan's two parts, 'ours_step_err', 'split'."""
    model, ids = titan_llama3(), titan_tokens()
    t0 = time.perf_counter()
    plan, fd = titan3_plan(model, ids)
    plans = {"forward": plan.to_json()}
    if step:
        split = titan3_step_plans(fd)
        plans["step"] = {"first": split.first.to_json(), "second": split.second.to_json()}
    log(f"# egraph-did plans for torchtitan's Llama3 in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    checks = ed.launch(titan3_worker, nprocs=P, backend="gloo", timeout=600, args=(ids, plans, fd.bind(ids)))[0]
    log(f"# gloo run (torchtitan TP, TP+SP and egraph-did's plans, 4 ranks) in {time.perf_counter() - t0:.1f} s")
    out = {"titan": checks["titan"], "ours": plan_records(plan), "ours_err": checks["ours"], "plan": plan,
           "fd": fd, "scale": checks["scale"]}
    if step:
        out |= {"step": checks["step"], "ours_step": plan_records(split.first) + plan_records(split.second),
                "ours_step_err": checks["ours_step"], "ours_step_logits_err": checks["ours_step_logits"],
                "split": split}
    return out


def titan3_report(result: dict) -> str:
    """The torchtitan section of bench/results_compare_tp.txt."""
    ours, plan, fd = result["ours"], result["plan"], result["fd"]
    head = (f"{'variant':<7} | {'torchtitan collectives':<34} {'bytes':>9} {'wire':>9} | "
            f"{'egraph-did collectives':<34} {'bytes':>9} {'wire':>9} | {'ratio':>5}")
    lines = [f"# torchtitan {_titan_version()}'s own Llama3Model and its own tensor parallelism "
             "(.venv/bin/python -m bench.compare_tp --section torchtitan)",
             head, "-" * len(head)]
    for variant, (records, _, _, _) in result["titan"].items():
        lines.append(f"{variant:<7} | {summary(records):<34} {_fmt(total(records, 'bytes')):>9} "
                     f"{_fmt(total(records)):>9} | {summary(ours):<34} {_fmt(total(ours, 'bytes')):>9} "
                     f"{_fmt(total(ours)):>9} | {total(ours) / total(records):5.2f}")
    split = [n for n in fd.params if "DID" in plan.loop_domain(n)]
    matrices = [n for n in fd.params if fd[n].ndim == 2]
    whole = [n for n in matrices if n not in split]
    lines += ["",
              f"model: torchtitan.models.llama3 Llama3Model, dim {TITAN['dim']}, {TITAN['n_heads']} heads, "
              f"{TITAN['n_kv_heads']} KV heads, FFN {TITAN['hidden_dim']}, vocab {TITAN['vocab_size']}, "
              f"{TITAN['n_layers']} layers, fused wqkv, complex rotary; tokens [{BATCH}, {TINY_SEQ}], float32",
              "torchtitan: model.parallelize(ParallelDims(tp=4, spmd_backend='partial_dtensor')) with the sharding",
              "  set_llama3_sharding_config(enable_sp=False | True) declares; CommDebugMode over one forward on 4 gloo",
              "  ranks; logits come out vocab-sharded (Shard(-1)) under both.",
              f"egraph-did: ed.from_torch + ed.optimize (greedy), tokens replicated, logits vocab-sharded, memory bound "
              f"{TITAN_LIMIT} B per rank: {len(split)} of {len(fd.params)} parameters split (torchtitan splits the "
              f"{len(matrices)} weight matrices; kept whole here: {', '.join(whole) or 'none'}), predicted memory "
              f"{plan.memory / 2**10:.0f} KiB per rank.",
              "bytes and wire as above (wire: what each rank sends, ring algorithms).", "",
              "logits on 4 gloo ranks against the unsharded model: assert_close(rtol=1e-5, atol=1e-5) passed; largest "
              f"|difference| (largest |logit| {result['scale']:.3g}):"]
    for variant, (_, counts, err, placements) in result["titan"].items():
        lines.append(f"  torchtitan {variant:<6} {err:.2e}   logits {placements}   "
                     f"CommDebugMode.get_comm_counts(): {counts}")
    lines.append(f"  egraph-did        {result['ours_err']:.2e}")
    lines += ["", "where each collective runs (module or tensor: kind bytes):"]
    for variant, (records, _, _, _) in result["titan"].items():
        lines.append(f"  torchtitan {variant}: " + ", ".join(f"{r.module or '-'}: {r.kind} {r.bytes:.0f}"
                                                          for r in records))
    lines.append("  egraph-did: " + ", ".join(f"{r.module}: {r.kind} {r.bytes:.0f}" for r in ours))
    if "step" in result:
        lines += ["", titan3_step_report(result)]
    return "\n".join(lines)


def titan3_step_report(result: dict) -> str:
    """Forward and backward: torchtitan's counted collectives (plus the allreduces its Partial gradients still
    need) against egraph-did's joint plan of the step (its forward part and its backward part)."""
    ours = result["ours_step"]
    head = (f"{'variant':<7} | {'torchtitan collectives':<44} {'bytes':>9} {'wire':>9} | "
            f"{'egraph-did collectives':<34} {'bytes':>9} {'wire':>9} | {'ratio':>5}")
    lines = ["forward + backward (one training step's collectives; the same model and cotangent, ours one joint plan):",
             head, "-" * len(head)]
    for variant, (records, _) in result["step"].items():
        lines.append(f"{variant:<7} | {summary(records):<44} {_fmt(total(records, 'bytes')):>9} "
                     f"{_fmt(total(records)):>9} | {summary(ours):<34} {_fmt(total(ours, 'bytes')):>9} "
                     f"{_fmt(total(ours)):>9} | {total(ours) / total(records):5.2f}")
    split = result["split"]
    split_params = [n for n in result["fd"].params if "DID" in split.joint.loop_domain(n)]
    titan_sp = total(result["step"]["TP+SP"][0])
    verdict = ("no more than" if total(ours) <= titan_sp else "more than")
    lines += ["",
              "torchtitan: CommDebugMode over model(tokens) and logits.backward(cotangent), the cotangent vocab-sharded",
              "  as its loss-parallel cross-entropy gives it; a gradient it leaves Partial(sum) (TP: wo, w2 and the",
              "  norms; TP+SP: the norms, whose reduction torchtitan leaves to FSDP) counted as the allreduce it",
              "  still needs (modules '... (pending)' below).",
              "egraph-did: one joint plan of the forward and the vector-Jacobian product (ed.parallelize's, from",
              "  egraph_did.parallelize.optimize_joint), optimized once under a bound on the whole step's memory of "
              f"{STEP_LIMIT} B per rank",
              f"  (predicted {split.joint.memory / 2**10:.0f} KiB: weights, gradients, saved activations and every other "
              f"value, no reuse): {len(split_params)} of {len(result['fd'].params)} parameters split, each gradient in "
              "its parameter's placements;",
              f"  run split in two: the forward part ({len(split.first.steps)} steps, "
              f"{len(split.first.collectives)} collectives) saves {len(split.saved)} values "
              f"({split.saved_bytes() / 2**10:.1f} KiB per rank, in their own layouts) for the backward part "
              f"({len(split.second.steps)} steps, {len(split.second.collectives)} collectives); no step runs twice.",
              f"  Ours sends {verdict} torchtitan's TP+SP ({_fmt(total(ours))} against {_fmt(titan_sp)} per rank).",
              "logits and gradients on 4 gloo ranks against the unsharded model's: assert_close(rtol=1e-5, atol=1e-5) "
              "passed; largest |difference|:"]
    for variant, (_, err) in result["step"].items():
        lines.append(f"  torchtitan {variant:<6} {err:.2e}")
    lines += [f"  egraph-did        {result['ours_step_err']:.2e} (logits of its forward part "
              f"{result['ours_step_logits_err']:.2e})", "",
              "where each collective runs (module or tensor: kind bytes):"]
    for variant, (records, _) in result["step"].items():
        lines.append(f"  torchtitan {variant}: " + ", ".join(f"{r.module or '-'}: {r.kind} {r.bytes:.0f}"
                                                          for r in records))
    lines.append("  egraph-did: " + ", ".join(f"{r.module}: {r.kind} {r.bytes:.0f}" for r in ours))
    return "\n".join(lines)


def _titan_version() -> str:
    from importlib.metadata import version
    return version("torchtitan")


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--extractor", default="greedy", choices=("greedy", "exact"))
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--section", default="all", choices=("all", "hf", "torchtitan"),
                    help="hf: torchtitan's plan transcribed onto transformers' Llama; torchtitan: torchtitan's own "
                         "Llama3 and parallelize (needs torchtitan, scripts/setup.sh)")
    args = ap.parse_args(argv)
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    parts = []
    if args.section in ("all", "hf"):
        parts.append(report(compare(args.extractor, log=log)))
    if args.section in ("all", "torchtitan"):
        parts.append(titan3_report(compare_titan3(log=log)))
    text = "\n\n\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
