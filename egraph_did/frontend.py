"""The PyTorch frontend: a torch module or function, exported by torch.export, as a fusion.

`from_torch(module_or_fn, example_inputs)` exports the program (non-strict), walks its ATen graph in
order and emits each node through a table (ATEN: ATen op -> a function emitting fd.ops calls):

- parameters become fusion inputs named by their module paths ("layers.0.mlp.w1.weight"), user inputs
  by their argument names, outputs by their place in the returned structure ("out" for one tensor,
  "logits" for a model output's field, "0", "1" for a tuple);
- a node whose tensor operands are all known when exporting (buffers, lifted constants, results of
  arange/full/masks, rotary tables: anything that depends on shapes and constants only) is folded: torch
  computes it once, here. A folded tensor that feeds the program becomes a constant input named
  "const.<module path>.<node>" (equal ones shared), passed like a weight: the optimizer lays it out as
  any input (replicated, or split where that is cheaper). Its value is fixed at export: re-export after
  changing a buffer. A random op is never folded: one with a mapping (dropout) reads its folded operand as
  a constant input and draws at run time, any other (rand) raises;
- dropout in training mode (aten.dropout, native_dropout) maps onto fd.ops.dropout, whose mask is a hash of
  a seed and each element's global index, so every rank of every plan draws the mask one device draws.
  The seed is one 0-d int64 input, "rng.seed" (SEED_INPUT; `TorchFusion.seed_inputs` names it): every
  dropout of the module reads it, each at its own offset (the elements of the dropouts before it), so
  their masks differ. bind() draws a new seed from torch's default generator on every call, as torch's
  dropout draws new numbers on every forward; several processes must feed the same seed (seed torch alike
  on every rank, or pass {"rng.seed": tensor} yourself), and a backward must reuse the forward's;
- an op with no mapping becomes an opaque step (torch runs it on whole operands, replicated on every
  rank; the plan names it with its source line; ed.grad differentiates it with torch's autograd of the
  same call, an opaque_grad step), or, under strict=True, raises ExportError naming the op, the source
  line it came from and what to do;
- an in-place op (x.div_(...)) maps as its out-of-place form where that gives what torch gives (nothing
  reads x afterwards, x is no view and has none), else it raises naming the line;
- the routing of mixture-of-experts layers: topk and sort are gathers at an argsort (fd.ops.argsort), and an
  expert's weights picked by index (w[ids]) an embedding of w's rows, so both keep their gradients;
  transformers' grouped experts (argsort of expert ids, histc counts, cumsum offsets, F.grouped_mm or its
  grouped_mm_fallback op, the inverse permutation written as inverse[perm] = arange, perm // k) map onto
  argsort, histc, cumsum, grouped_mm and float ops: no opaque step;
- complex numbers (torchtitan's rotary embedding: view_as_complex, a product with a complex table,
  view_as_real) as pairs of reals: a complex value is held as its view_as_real form [..., 2] and a
  product is computed from real and imaginary parts, so it shards and differentiates as real ops do.

The fusion is specialized to the example inputs' shapes and dtypes (as torch.export with static shapes).
"""
from __future__ import annotations

import json
import math
import operator
import os
import re
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .errors import DtypeError, EgraphDidError
from .fusion import FusionDefinition, replay
from .ir import TensorView
from .ops import SUPPORTED_DTYPES, canonical_dtype, complex_message

aten = torch.ops.aten


class ExportError(EgraphDidError, ValueError):
    """from_torch met something it cannot turn into fusion ops: an ATen op without a mapping, an argument a
    mapping does not support, or a random op; the message names the op and the source line.

    >>> import torch, egraph_did as ed
    >>> try:
    ...     ed.from_torch(lambda x: torch.flip(x, (0,)), (torch.ones(3, 4),), strict=True)
    ... except ed.ExportError as e:
    ...     print(str(e).split(" at ")[0])
    from_torch: aten.flip.default
    """


class TorchFusion(FusionDefinition):
    """A FusionDefinition made by from_torch, with what running it needs: `bind(*args, **kwargs)` gives the
    full input dict (the user's tensors by argument name, the module's current parameters by path, the
    folded constants and, for a module that drops out, a fresh random seed); `user_inputs`, `params`,
    `constants` and `seed_inputs` name them.

    >>> import torch, egraph_did as ed
    >>> fd = ed.from_torch(torch.nn.Linear(4, 2), (torch.ones(3, 4),))
    >>> fd.user_inputs, fd.params, sorted(fd.bind(torch.ones(3, 4)))
    (('input',), ('weight', 'bias'), ['bias', 'input', 'weight'])
    """

    def __init__(self):
        super().__init__()
        self.user_inputs: tuple[str, ...] = ()
        self.params: tuple[str, ...] = ()
        self.constants: dict[str, torch.Tensor] = {}
        self.seed_inputs: tuple[str, ...] = ()  # ("rng.seed",) where the program drops out in training mode
        self.dropouts = 0  # dropouts of p > 0 the export met, in either mode: the program's meaning depends on it
        self.training = False  # the module's mode at export
        self._module: torch.nn.Module | None = None
        self.leaves: list[str | None] = []  # per flattened (args, kwargs) leaf: the input it binds, or None
        self.output_skeleton: Any = None  # the module's output structure, its leaves the output indices

    def bind(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Every input of the fusion: args and kwargs as given to the module (same structure as the example
        inputs), the module's parameters as they are now, the folded constants, and a seed for each of
        seed_inputs drawn from torch's default generator (draw_seed: a new mask per call, as torch's
        dropout; replace it to replay a step).

        >>> import torch, egraph_did as ed
        >>> fd = ed.from_torch(lambda a, b: a * b + 1, (torch.ones(2), torch.ones(2)))
        >>> ed.evaluate(fd, fd.bind(torch.tensor([1., 2.]), torch.tensor([3., 4.])))["out"]
        tensor([4., 9.])
        """
        leaves, _ = pytree.tree_flatten((args, kwargs))
        if len(leaves) != len(self.leaves):
            raise ExportError(f"bind: got {len(leaves)} input leaves, the example inputs had {len(self.leaves)}; "
                              f"pass the module's arguments in the structure of the example")
        out = {name: v for name, v in zip(self.leaves, leaves) if name is not None}
        if self._module is not None:
            state = dict(self._module.named_parameters(remove_duplicate=False))
            state |= dict(self._module.named_buffers(remove_duplicate=False))
            out |= {p: state[p].detach() for p in self.params}
        return out | self.constants | {name: draw_seed() for name in self.seed_inputs}

    def without_dropout(self) -> "TorchFusion":
        """This program as the module exports in eval mode: each dropout is its operand (native_dropout's mask
        all True), and the seed input is gone; the outputs, parameters and inputs keep their names.

        >>> import torch, egraph_did as ed
        >>> fd = ed.from_torch(torch.nn.Dropout(0.5).train(), (torch.ones(2, 4),))
        >>> ev = fd.without_dropout()
        >>> fd.seed_inputs, ev.seed_inputs, [e.op.name for e in ev.fusion.exprs], (fd.dropouts, fd.training)
        (('rng.seed',), (), ['cast'], (1, True))
        """
        return _live_copy(self, keep_dropout=False)

    def structure(self, outputs: dict[str, Any]) -> Any:
        """The outputs (by name, as ed.evaluate / plan.run give them) in the module's own output structure:
        a tensor, a tuple, a dict or a ModelOutput, as the export recorded it.

        >>> import torch, egraph_did as ed
        >>> fd = ed.from_torch(lambda a: (a + 1, {"double": a * 2}), (torch.ones(2),))
        >>> fd.structure(ed.evaluate(fd, fd.bind(torch.ones(2))))
        (tensor([2., 2.]), {'double': tensor([2., 2.])})
        """
        names = list(self.fusion.outputs)
        if self.output_skeleton is None:
            return dict(outputs)
        return pytree.tree_map(lambda i: outputs[names[i]], self.output_skeleton)


def from_torch(module_or_fn, example_inputs: tuple, kwargs: dict | None = None, strict: bool = False
               ) -> TorchFusion:
    """The fusion of a torch module or function on inputs like `example_inputs` (a tuple of positional
    arguments; `kwargs` keyword ones), through torch.export (non-strict) and the ATEN table. An ATen op
    the table does not map becomes an opaque step (fd.ops.opaque: torch runs it on whole, replicated
    operands; the plan names it with its source line); strict=True refuses it with an ExportError instead.

    >>> import torch, egraph_did as ed
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> fd = ed.from_torch(mlp, (torch.randn(4, 8),))
    >>> print(fd)
    inputs: 0.weight[32, 8], 0.bias[32], 2.weight[8, 32], 2.bias[8], input[4, 8]
      linear_0 = linear(input, 0.weight, 0.bias)
      gelu_1 = gelu(linear_0)
      out = linear(gelu_1, 2.weight, 2.bias)
    outputs: out
    >>> x = torch.randn(4, 8)
    >>> torch.testing.assert_close(ed.evaluate(fd, fd.bind(x))["out"], mlp(x))
    """
    module = module_or_fn if isinstance(module_or_fn, torch.nn.Module) else _as_module(module_or_fn)
    if not isinstance(example_inputs, tuple):
        raise ExportError(f"from_torch: example_inputs must be a tuple of positional arguments, got the "
                          f"{type(example_inputs).__name__}; write (x,) for one argument")
    if not torch.cuda.is_available():  # export imports Triton, whose jit reads this once: as the lowering sets it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    with torch.no_grad():
        ep = torch.export.export(module, example_inputs, kwargs or {}, strict=False)
    return _Converter(ep, module if isinstance(module_or_fn, torch.nn.Module) else None, strict).run()


def _as_module(fn: Callable) -> torch.nn.Module:
    """A plain function as a module (torch.export takes modules). Export records the source lines of frames
    named `forward` only: the forward is a copy of the function under that name, so that an error can
    name the function's own line."""
    forward = fn
    if isinstance(fn, types.FunctionType):
        forward = types.FunctionType(fn.__code__.replace(co_name="forward"), fn.__globals__, "forward",
                                     fn.__defaults__, fn.__closure__)
        forward.__kwdefaults__ = fn.__kwdefaults__
    return type("Function", (torch.nn.Module,), {"forward": staticmethod(forward)})()


# ---------------------------------------------------------------------- where a node came from

def source_line(node) -> str:
    """'file:line (code)' of the innermost frame of the node's stack trace outside torch itself (the
    model's own line, in the user's file or in transformers), or 'an unknown line'.

    >>> class N: meta = {"stack_trace": 'File "m.py", line 3, in f\\n    y = x.cumsum(0)'}
    >>> source_line(N())
    'm.py:3 (y = x.cumsum(0))'
    """
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    own = [f for f in frames if f"{torch.__path__[0]}/" not in f[0]] or frames
    if not own:
        return "an unknown line"
    path, line, code = own[-1]
    return f"{path}:{line} ({code.strip()})"


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [p for p, _ in stack.values() if p]
    return paths[-1] if paths else ""


# ---------------------------------------------------------------------- the walk

@dataclass
class _Unavailable:
    """An output of a mapped op that the fusion does not compute (native_layer_norm's mean and rstd)."""

    what: str


class _Converter:
    """Walks an ExportedProgram's graph and builds the TorchFusion."""

    def __init__(self, ep, module, strict: bool = False):
        self.ep, self.fd, self.strict = ep, TorchFusion(), strict
        self.fd._module = module
        self.fd.training = bool(getattr(module, "training", False))
        self.env: dict[str, Any] = {}
        self.node = None
        self._consts: list[tuple[torch.Tensor, TensorView]] = []
        self._seed: TensorView | None = None  # the program's one seed input, made by the first dropout
        self._rng_offset = 0  # counters the dropouts mapped so far have used
        self._causal: dict[int, tuple["_Folded", bool]] = {}  # id(mask) -> (mask, whether causal)
        self._lazy: list[_Lazy] = []  # the folded values kept as how they are computed, not computed yet
        # id(log_softmax output) -> (its operand, dim): an nll_loss of one maps onto cross_entropy
        self.log_softmax_of: dict[int, tuple[TensorView, int]] = {}

    def run(self) -> TorchFusion:
        self._placeholders()
        for node in self.ep.graph.nodes:
            self.node = node
            if node.op == "call_function":
                self.env[node.name] = self._call(node)
            elif node.op == "output":
                self._outputs(node)
        return _live_copy(self.fd)

    # ------------------------------------------------------------ inputs and outputs
    def _placeholders(self) -> None:
        sig, fd = self.ep.graph_signature, self.fd
        state = self.ep.state_dict | dict(self.ep.constants)
        users, params = [], []
        complex_ = [(spec.target if spec.kind.name == "PARAMETER" else spec.arg.name, ex.dtype)
                    for spec in sig.input_specs if spec.kind.name in ("PARAMETER", "USER_INPUT")
                    for ex in [self._example(spec)] if isinstance(ex, torch.Tensor) and ex.is_complex()]
        if complex_:  # every one named at once (a complex buffer is folded: rotary tables are mapped)
            by_dtype: dict = {}
            for name, dt in complex_:
                by_dtype.setdefault(dt, []).append(name)
            raise DtypeError("from_torch: " + "; ".join(complex_message(dt, names) for dt, names in by_dtype.items()))
        for spec in sig.input_specs:
            name = spec.arg.name
            example = self._example(spec)
            if spec.kind.name == "PARAMETER":
                self.env[name] = fd.define_tensor(example.shape, example.dtype, spec.target)
                params.append(spec.target)
            elif spec.kind.name in ("BUFFER", "CONSTANT_TENSOR"):
                value = state[spec.target].detach()
                if value.is_meta and self._placeholder(name).users:
                    value = self._meta_buffer(spec.target, value)
                self.env[name] = _Folded(value, spec.target)
            elif spec.kind.name == "USER_INPUT":
                self.env[name] = (fd.define_tensor(example.shape, example.dtype, name)
                                  if isinstance(example, torch.Tensor) else getattr(spec.arg, "value", None))
                if isinstance(example, torch.Tensor):
                    users.append(name)
            else:
                raise ExportError(f"from_torch: input {name} is a {spec.kind.name}, which from_torch does not take "
                                  f"(it maps parameters, buffers, constants and user inputs)")
        fd.user_inputs, fd.params = tuple(users), tuple(params)
        leaves = [s for s in sig.input_specs if s.kind.name == "USER_INPUT"]
        fd.leaves = [s.arg.name if s.arg.name in users else None for s in leaves]

    def _example(self, spec):
        return self._placeholder(spec.arg.name).meta.get("val")

    def _placeholder(self, name: str):
        return next(n for n in self.ep.graph.nodes if n.op == "placeholder" and n.name == name)

    def _meta_buffer(self, target: str, value: torch.Tensor) -> torch.Tensor:
        """The values of a buffer on the meta device that the program reads (folding needs them), computed on
        the CPU: a transformers rotary embedding's inverse frequencies from its config, as transformers'
        own _init_weights recomputes them after loading a checkpoint. Any other raises naming the buffer."""
        owner_path, _, leaf = target.rpartition(".")
        owner = self.fd._module.get_submodule(owner_path) if self.fd._module is not None else None
        if leaf in ("inv_freq", "original_inv_freq") and hasattr(owner, "rope_type") and hasattr(owner, "config"):
            rope = getattr(owner, "compute_default_rope_parameters", None) if owner.rope_type == "default" else None
            if rope is None:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
                rope = ROPE_INIT_FUNCTIONS[owner.rope_type]
            with torch.device("cpu"):
                out = rope(owner.config)[0]
            if tuple(out.shape) == tuple(value.shape):
                return out.to(value.dtype)
        raise ExportError(f"from_torch: the buffer {target!r} is on the meta device and the program reads it: "
                          f"from_torch folds what buffers compute, so it needs the values (parameters may stay "
                          f"on meta). Give it its values on the CPU before exporting "
                          f"(module.get_submodule({owner_path!r}).register_buffer({leaf!r}, value, ...))")

    def _outputs(self, node) -> None:
        values = node.args[0]
        spec = self.ep.call_spec.out_spec
        names = _output_names(spec, len(values))
        self.fd.output_skeleton = pytree.tree_unflatten(list(range(len(values))), spec) if spec is not None else None
        seen: set[int] = set()
        for name, v in zip(names, values):
            val = self.env[v.name] if hasattr(v, "name") else v
            if isinstance(val, _Unavailable):  # name the op that made it (getitem's source) and its line
                self.node = v.args[0] if v.target is operator.getitem else v
                raise self.error(f"gives {val.what} as an output, which the fusion does not compute",
                                 "return only the op's first output")
            tv = self._tensor(val)
            if tv in self.fd.fusion.inputs or id(tv) in seen:
                tv = self.fd.ops.cast(tv, tv.dtype)  # an output is its own tensor: a copy of an input or twin
            seen.add(id(tv))
            self.fd.add_output(tv, name)

    # ------------------------------------------------------------ one node
    def _call(self, node):
        if node.target is operator.getitem:
            seq, i = self._value(node.args[0]), node.args[1]
            return seq[i]
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            raise self.error("is not an ATen op", _FIX_UNMAPPED)
        kwargs = {k: self._value(v) for k, v in _by_schema(schema, node.args, node.kwargs).items()}
        if not _has_tensor(kwargs):
            return self._fold(node, kwargs)
        fn = mapping(node.target) or self._in_place(node)
        if fn is None:
            return self.unmapped(node, kwargs)
        try:
            return fn(self, **kwargs)
        except DtypeError as e:  # a cast to a complex dtype, say: name the node and its source line
            if str(e).startswith("from_torch"):
                raise
            raise DtypeError(f"from_torch: {node.target} at {source_line(node)}: {e}") from None

    def unmapped(self, node, kwargs=None, target=None):
        """A node no mapping computes: an opaque step running `target` (default: the node's op), or (strict)
        an ExportError. A mapping that takes only some forms of its op hands the others here (kwargs None:
        the node's own arguments)."""
        if kwargs is None:
            kwargs = {k: self._value(v) for k, v in _by_schema(node.target._schema, node.args, node.kwargs).items()}
        if self.strict:
            raise self.error("has no fusion mapping", _FIX_UNMAPPED)
        return self._opaque(node, kwargs, target)

    def _in_place(self, node):
        """The mapping of x.op_(...) (export keeps some in-place ops: router_top_value /= ... in
        transformers' MoE routers, inverse[perm] = arange as index_put_): the out-of-place op's, or an
        opaque step of the out-of-place overload where no mapping has it (never the in-place one: it would
        write into its operand's buffer), where computing a new tensor gives what torch gives, that is
        where x is no view, nothing reads x after the node and no view of x was taken (a reader of those
        would see the old value here, the new one in torch); None for an op that is not in-place."""
        packet = getattr(node.target, "overloadpacket", None)
        name = getattr(packet, "__name__", "")
        namespace = getattr(torch.ops, getattr(node.target, "namespace", "aten"))
        pure = getattr(namespace, name[:-1], None) if name.endswith("_") and not name.endswith("__") else None
        overload = getattr(pure, node.target._overloadname, None) if pure is not None else None
        if overload is None:
            return None
        self._check_overwrite(node)
        fn = mapping(overload)  # its own, or its packet (pure)
        return fn or (lambda c, **kwargs: c.unmapped(node, kwargs, overload))

    def _check_overwrite(self, node) -> None:
        """ExportError unless the in-place node's operand can be replaced by a new tensor (see _in_place)."""
        target = node.args[0]
        fix = "compute a new tensor instead (x = x.op(...))"
        if target.op == "placeholder":
            raise self.error(f"writes into the input {target.name}", f"{fix}: a fusion does not change its inputs")
        if _is_view(target):
            raise self.error(f"writes into {target.name}, a view of another tensor", fix)
        order = {n: i for i, n in enumerate(self.ep.graph.nodes)}
        others = [u for u in target.users if u is not node and (order[u] > order[node] or _is_view(u))]
        if others:
            raise self.error(f"overwrites {target.name} while {', '.join(u.name for u in others)} read(s) it "
                             f"later or hold(s) a view of it", fix)

    def _opaque(self, node, kwargs, target=None):
        """An op the table does not map, as an opaque step: torch runs it on whole operands (replicated), with
        the call's arguments as JSON (opaque_call) and the output's shape and dtype as export recorded."""
        target = node.target if target is None else target
        if torch.Tag.nondeterministic_seeded in target.tags:
            raise self.error("is random and has no fusion mapping", "export the module in eval mode "
                             "(module.eval()), or map it (an opaque step would draw other numbers on every rank)")
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            n = len(val) if isinstance(val, (list, tuple)) else 0
            raise self.error(f"has no fusion mapping and gives {n or 'no'} tensors (an opaque step gives one)",
                             _FIX_UNMAPPED)
        if val.dtype not in SUPPORTED_DTYPES:
            raise self.error(f"has no fusion mapping and gives a {val.dtype} tensor", _FIX_UNMAPPED)
        tensors: list[TensorView] = []

        def enc(v):
            if isinstance(v, (TensorView, _Folded)):
                tensors.append(self._tensor(v))
                return {"tensor": len(tensors) - 1}
            if isinstance(v, torch.dtype):
                return {"dtype": str(v).replace("torch.", "")}
            if isinstance(v, (list, tuple)):
                return [enc(x) for x in v]
            if v is None or isinstance(v, (bool, int, float, str)):
                return v
            raise self.error(f"has no fusion mapping and an argument an opaque step cannot hold ({v!r:.40})",
                             _FIX_UNMAPPED)
        call = json.dumps({"args": [], "kwargs": {k: enc(v) for k, v in kwargs.items()}})
        if len(tensors) > 4:
            raise self.error(f"has no fusion mapping and reads {len(tensors)} tensors (an opaque step reads up "
                             f"to 4)", _FIX_UNMAPPED)
        return self.ops.opaque(*tensors, target=str(target), call=call, shape=tuple(int(e) for e in val.shape),
                               dtype=val.dtype, source=source_line(node))

    def _value(self, v):
        """An argument of a node: the env's value of a node, recursively through lists and tuples."""
        if isinstance(v, torch.fx.Node):
            val = self.env[v.name]
            if isinstance(val, _Unavailable):
                raise self.error(f"reads {val.what}, which the fusion does not compute", "use only the op's "
                                 "first output")
            return val
        if isinstance(v, (list, tuple)):
            return type(v)(self._value(x) for x in v)
        return v

    def _fold(self, node, kwargs):
        """The node computed now by torch: every tensor it reads is known at export."""
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            mapped = mapping(node.target)
            if mapped is not None:  # dropout of a buffer: drawn at run time from the seed, never at export
                return mapped(self, **kwargs)
            raise self.error("is random", "export the module in eval mode (module.eval()); a random op has no "
                             "value to fold and no fusion op")
        if node.target is aten._assert_tensor_metadata.default and isinstance(kwargs.get("a"), _Lazy):
            return _assert_metadata(self, **kwargs)  # on its dtype: computing a mask [s, s] to check it costs s * s
        name = f"{_module_path(node)}.{node.name}".lstrip(".")
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and _broadcasts(node.target, kwargs, val):
            self._lazy.append(_Lazy(node.target, kwargs, name, tuple(val.shape), val.dtype))
            return self._lazy[-1]
        written = [kwargs.get(a.name) for a in node.target._schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write]
        if written:  # a value kept as how it is computed that reads what the op writes is computed first
            lazies, storages = _written(written)
            reading = [lazy for lazy in self._lazy if _reads_written(lazy, lazies, storages)]
            for lazy in reading:
                lazy.value
            self._lazy = [lazy for lazy in self._lazy if not lazy.done]
        with torch.no_grad():  # on the CPU, where the module lives on the meta device: a constant needs values
            out = node.target(**{k: _on_cpu(v) for k, v in _unfold(kwargs).items()})
        return _wrap(out, name)

    # ------------------------------------------------------------ helpers the mappings use
    def is_causal_mask(self, mask: "_Folded", sq: int, sk: int) -> bool:
        """_is_causal_mask, once per mask: every layer of a model reads the one folded mask (Llama-3-8B's
        [8, 1, 8192, 8192] took 1.2 s to check, 32 times)."""
        if id(mask) not in self._causal:
            self._causal[id(mask)] = (mask, _is_causal_mask(mask, sq, sk))
        return self._causal[id(mask)][1]

    @property
    def ops(self):
        return self.fd.ops

    def error(self, what: str, fix: str) -> ExportError:
        """ExportError naming the current node's op and source line."""
        name = str(self.node.target) if self.node is not None else "?"
        return ExportError(f"from_torch: {name} at {source_line(self.node)} {what}; {fix}")

    def _tensor(self, v) -> TensorView:
        """v as a fusion tensor: a folded constant becomes a constant input (equal ones shared)."""
        if isinstance(v, TensorView):
            return v
        if isinstance(v, _Folded):
            for value, tv in self._consts:
                if _same_values(value, v.value):
                    return tv
            name = f"const.{v.name}"
            tv = self.fd.define_tensor(tuple(v.value.shape), v.value.dtype, name)
            self.fd.constants[name] = v.value
            self._consts.append((v.value, tv))
            return tv
        if isinstance(v, _Complex) or (isinstance(v, _Folded) and v.value.is_complex()):
            raise self.error("reads a complex tensor", "from_torch maps complex values through view_as_complex, "
                             "mul and view_as_real only (rotary embeddings); compute with real and imaginary "
                             "parts, or map the op in egraph_did/frontend.py")
        raise self.error(f"needs a tensor and got {v!r}", "report this model to egraph-did")

    def operand(self, v):
        """v as an operand of a pointwise op: a fusion tensor, or a Python number (a 0-d constant is one)."""
        if isinstance(v, _Folded) and v.value.ndim == 0:
            return v.value.item()
        return v if isinstance(v, (int, float, bool)) else self._tensor(v)


_FIX_UNMAPPED = ("map it in egraph_did/frontend.py's ATEN table (onto fd.ops, adding an op to egraph_did/ops.py "
                 "if none fits), or rewrite that line of the model with ops the table maps")


def _live_copy(src: TorchFusion, keep_dropout: bool = True) -> TorchFusion:
    """src without the ops no output needs (a transpose that mm folded into a linear, a mask's source), nor
    the parameters and constants no op reads (a tied weight export reads under its other name); with
    keep_dropout=False each dropout replaced by its operand (the program in eval mode)."""
    if not keep_dropout:
        src = _live_copy(_undropped(src))
    fusion = src.fusion
    live = {id(t) for t in fusion.outputs.values()}
    for e in reversed(fusion.exprs):
        if any(id(o) in live for o in e.outputs):
            live |= {id(t) for t in e.inputs}
    live |= {id(fusion[name]) for name in src.user_inputs}
    out = TorchFusion()
    out.user_inputs, out._module, out.leaves = src.user_inputs, src._module, src.leaves
    out.seed_inputs = tuple(s for s in src.seed_inputs if id(fusion[s]) in live)
    out.output_skeleton, out.dropouts, out.training = src.output_skeleton, src.dropouts, src.training
    out.params = tuple(p for p in src.params if id(fusion[p]) in live)
    out.constants = {k: v for k, v in src.constants.items() if id(fusion[k]) in live}
    new = {id(t): out.define_tensor(t.shape, t.dtype, t.name) for t in fusion.inputs if id(t) in live}
    for e in fusion.exprs:
        if any(id(o) in live for o in e.outputs):
            res = out.fusion.emit(e.op.name, **{k: new[id(v)] if isinstance(v, TensorView) else v for k, v in e.args})
            new |= {id(o): t for o, t in zip(e.outputs, res if isinstance(res, tuple) else (res,))}
    for name, tv in fusion.outputs.items():
        out.add_output(new[id(tv)], name)
    return out


def _undropped(src: TorchFusion) -> TorchFusion:
    """src with every dropout's output replaced by its operand, nothing removed (_live_copy prunes)."""
    out = TorchFusion()
    out.user_inputs, out._module, out.leaves, out.params = src.user_inputs, src._module, src.leaves, src.params
    out.output_skeleton, out.constants, out.training = src.output_skeleton, src.constants, False
    out.dropouts = src.dropouts
    out.fusion, out.ops, new = replay(src.fusion, lambda ops, e, args: args["x"] if e.op.name == "dropout"
                                      else ops._fusion.emit(e.op.name, **args))
    seen: set[int] = set()
    for name, tv in src.fusion.outputs.items():
        tv = new[id(tv)]
        if tv in out.fusion.inputs or id(tv) in seen:
            tv = out.ops.cast(tv, tv.dtype)  # a dropped-out input or a twin output: its own copy, as _outputs makes
        seen.add(id(tv))
        out.add_output(tv, name)
    return out


@dataclass
class _Folded:
    """A tensor known at export (a buffer, a lifted constant, or a folded node's value), and a name for it."""

    value: torch.Tensor
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)


class _Lazy(_Folded):
    """A folded value kept as the op that computes it and its arguments (see _broadcasts), computed when read:
    a causal mask [s, s] is recognized from how it is built (_on_diagonals), 1 G values at 32k tokens.

    >>> m = _Lazy(aten.le.Tensor, {"self": _Folded(torch.arange(3)[None, :], "j"),
    ...                            "other": _Folded(torch.arange(3)[:, None], "i")}, "mask", (3, 3), torch.bool)
    >>> m.done, m.value.int().tolist(), m.done
    (False, [[1, 0, 0], [1, 1, 0], [1, 1, 1]], True)
    """

    def __init__(self, target, kwargs: dict, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        self.target, self.kwargs, self.name, self._shape, self._value = target, kwargs, name, shape, None
        self.dtype = dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def done(self) -> bool:
        return self._value is not None

    @property
    def value(self) -> torch.Tensor:
        if self._value is None:
            with torch.no_grad():
                self._value = self.target(**{k: _on_cpu(v) for k, v in _unfold(self.kwargs).items()})
        return self._value

    def __repr__(self) -> str:
        return f"_Lazy({self.target}, {self.name!r}, {self.shape})"


@dataclass
class _Complex:
    """A complex tensor computed by the program, held as its real pairs: `pairs` is view_as_real of it, a real
    fusion tensor whose last axis (extent 2) holds the real and the imaginary part."""

    pairs: TensorView


def _by_schema(schema, args, kwargs) -> dict:
    """A node's arguments by their names in the op's schema."""
    return {a.name: v for a, v in zip(schema.arguments, args)} | dict(kwargs)


def _is_view(node) -> bool:
    """Whether a graph node's value is a view of another tensor (its op's schema returns an alias: view,
    select, slice, a piece of split or chunk)."""
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _has_tensor(v) -> bool:
    if isinstance(v, (TensorView, _Complex)):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def _storage(t: torch.Tensor) -> int:
    """The address of t's storage: two views of one storage share it."""
    return t.untyped_storage().data_ptr()


def _written(written: list) -> tuple[set[int], set[int]]:
    """What an in-place op writes: the ids of the _Lazy values among its written arguments, and the storages
    of those that hold values (a view writes into its base's storage)."""
    lazies, storages = set(), set()
    for w in written:
        if isinstance(w, _Lazy):
            lazies.add(id(w))
        if isinstance(w, _Folded) and (not isinstance(w, _Lazy) or w.done):
            storages.add(_storage(w.value))
    return lazies, storages


def _reads_written(v, lazies: set[int], storages: set[int]) -> bool:
    """Whether computing v reads what an in-place op writes (_written): a written _Lazy, or a value in a written
    storage, directly or through the arguments of a _Lazy not computed yet.

    >>> pos = _Folded(torch.arange(3), "pos")
    >>> mask = _Lazy(aten.le.Tensor, {"self": pos, "other": _Folded(torch.arange(3)[:, None], "i")}, "m", (3, 3),
    ...              torch.bool)
    >>> _reads_written(mask, *_written([pos])), _reads_written(mask, *_written([_Folded(torch.ones(2), "x")]))
    (True, False)
    >>> both = _Lazy(aten.__and__.Tensor, {"self": mask, "other": mask}, "both", (3, 3), torch.bool)
    >>> other = _Lazy(aten.logical_not.default, {"self": _Folded(torch.ones(3, 3, dtype=torch.bool), "o")}, "other",
    ...               (3, 3), torch.bool)
    >>> _reads_written(both, *_written([mask])), _reads_written(both, *_written([other]))  # through mask, pending
    (True, False)
    """
    if isinstance(v, _Lazy):
        if id(v) in lazies or (v.done and _storage(v.value) in storages):
            return True
        return not v.done and _reads_written(v.kwargs, lazies, storages)
    if isinstance(v, _Folded):
        return _storage(v.value) in storages
    if isinstance(v, torch.Tensor):
        return _storage(v) in storages
    if isinstance(v, dict):
        return any(_reads_written(x, lazies, storages) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_reads_written(x, lazies, storages) for x in v)
    return False


def _unfold(v):
    if isinstance(v, _Folded):
        return v.value
    if isinstance(v, dict):
        return {k: _unfold(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_unfold(x) for x in v)
    return v


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two folded constants hold the same values: one view of one storage without comparing (each
    of Llama-3-8B's 32 layers unsqueezes the model's rotary tables: torch.equal took 1.8 s of the export),
    else torch.equal (after the first row's first 64). A meta tensor has no values to compare: never the same."""
    if a.shape != b.shape or a.dtype != b.dtype or a.is_meta or b.is_meta:
        return False
    if (a.device == b.device and _storage(a) == _storage(b)
            and a.storage_offset() == b.storage_offset() and a.stride() == b.stride()):
        return True
    corner = (0,) * max(a.ndim - 1, 0)  # the first row first: the rotary cos and sin tables differ there
    return (a.ndim == 0 or torch.equal(a[corner][:64], b[corner][:64])) and torch.equal(a, b)


def _on_cpu(v):
    """A folded node's argument with the meta device read as the CPU (arange(..., device='meta') of a module
    built on meta gives its values); a tensor on meta has none to give, and _meta_buffer gave buffers theirs."""
    if isinstance(v, torch.device) and v.type == "meta":
        return torch.device("cpu")
    if isinstance(v, (list, tuple)):
        return type(v)(_on_cpu(x) for x in v)
    return v


def _wrap(out, name: str):
    if isinstance(out, torch.Tensor):
        return _Folded(out, name)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(x, f"{name}.{i}") for i, x in enumerate(out))
    return out


def _output_names(spec, n: int) -> list[str]:
    """Names of the flattened outputs: 'out' for one tensor, else each leaf's key path ('logits', '0')."""
    if n == 1 and spec.is_leaf():
        return ["out"]
    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(n)), spec))
    names = [".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
             for path, _ in paths]
    return [nm or "out" for nm in names]


# ---------------------------------------------------------------------- the table: ATen op -> fusion ops

ATEN: dict[Any, Callable[..., Any]] = {}


def mapping(target) -> Callable[..., Any] | None:
    """The registered mapping of an ATen overload: its own, or its packet's (see maps), or a custom op's by
    schema name (BY_NAME); None if none."""
    found = ATEN.get(target) or ATEN.get(getattr(target, "overloadpacket", None))
    if found is None:
        schema = getattr(target, "_schema", None)
        found = BY_NAME.get(schema.name) if schema is not None else None
    return found


def maps(*targets):
    """Register the decorated function as the mapping of these ATen ops (an OpOverloadPacket maps every
    overload); it gets the converter and the node's arguments by schema name, and returns the value."""
    def register(fn):
        for t in targets:
            ATEN[t] = fn
        return fn
    return register


def _alpha(c, v, alpha):
    return v if alpha == 1 else c.ops.mul(c.operand(v), alpha)


@maps(aten.add)
def _add(c, self, other, alpha=1):
    return c.ops.add(c.operand(self), _alpha(c, c.operand(other), alpha))


@maps(aten.sub)
def _sub(c, self, other, alpha=1):
    return c.ops.sub(c.operand(self), _alpha(c, c.operand(other), alpha))


@maps(aten.rsub)
def _rsub(c, self, other, alpha=1):
    return c.ops.sub(c.operand(other), _alpha(c, c.operand(self), alpha))


@maps(aten.mul)
def _mul(c, self, other):
    if any(isinstance(v, _Complex) or (isinstance(v, _Folded) and v.value.is_complex()) for v in (self, other)):
        return _complex_mul(c, self, other)
    return c.ops.mul(c.operand(self), c.operand(other))


@maps(aten.div)
def _div(c, self, other, rounding_mode=None):
    if rounding_mode is not None:
        raise c.error(f"rounds (rounding_mode={rounding_mode!r})", "fd.ops has no rounding division; compute it "
                      "from constants, or map it")
    return c.ops.div(c.operand(self), c.operand(other))


@maps(aten.pow)
def _pow(c, self, exponent):
    return c.ops.pow(c.operand(self), c.operand(exponent))


@maps(aten.maximum)
def _maximum(c, self, other):
    return c.ops.maximum(c.operand(self), c.operand(other))


def _binary(op_name):
    return lambda c, self, other: getattr(c.ops, op_name)(c.operand(self), c.operand(other))


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    maps(getattr(aten, _name))(_binary(_name))


def _unary(op_name):
    return lambda c, self: getattr(c.ops, op_name)(c._tensor(self))


for _aten, _op in (("neg", "neg"), ("exp", "exp"), ("log", "log"), ("tanh", "tanh"), ("sigmoid", "sigmoid"),
                   ("relu", "relu"), ("rsqrt", "rsqrt"), ("sqrt", "sqrt"), ("erf", "erf"), ("abs", "abs"),
                   ("silu", "silu")):
    maps(getattr(aten, _aten))(_unary(_op))


@maps(aten.silu_backward)
def _silu_backward(c, grad_output, self):
    return c.ops.silu_backward(c._tensor(grad_output), c._tensor(self))


@maps(aten.gelu)
def _gelu(c, self, approximate="none"):
    return c.ops.gelu(c._tensor(self), approximate=approximate)


@maps(aten.where)
def _where(c, condition, self, other):
    return c.ops.where(c._tensor(condition), c.operand(self), c.operand(other))


@maps(aten.masked_fill)
def _masked_fill(c, self, mask, value):
    x = c._tensor(self)
    return c.ops.where(c._tensor(mask), c.operand(value), x)


# ------------------------------------------------------------ identities and casts

def _identity(c, self, **_):
    return self


for _t in (aten.clone, aten.contiguous, aten.alias, aten.detach, aten.lift_fresh_copy):
    maps(_t)(_identity)


SEED_INPUT = "rng.seed"


def draw_seed() -> torch.Tensor:
    """A dropout seed (a 0-d int64) from torch's default generator: torch.manual_seed makes it reproducible,
    and processes seeded alike draw the same one.

    >>> import torch
    >>> _ = torch.manual_seed(0); a = draw_seed(); _ = torch.manual_seed(0)
    >>> a.shape, a.dtype, bool(a == draw_seed())
    (torch.Size([]), torch.int64, True)
    """
    return torch.randint(-2 ** 63, 2 ** 63 - 1, (), dtype=torch.int64)


def _drop(c, x: TensorView, p: float) -> TensorView:
    """fd.ops.dropout of x under the program's seed input (made on first use) at the next unused offset."""
    if c._seed is None:
        if SEED_INPUT in c.fd.fusion.tensors:
            raise c.error(f"drops out, and the module has an input named {SEED_INPUT!r}, the name of the "
                          f"dropout seed", f"rename that input, or export in eval mode (module.eval())")
        c._seed = c.fd.define_tensor((), torch.int64, SEED_INPUT)
        c.fd.seed_inputs = (SEED_INPUT,)
    offset, c._rng_offset = c._rng_offset, c._rng_offset + math.prod(x.shape)
    return c.ops.dropout(x, c._seed, float(p), offset)


@maps(aten.dropout)
def _dropout(c, input, p, train):
    x = c._tensor(input)
    c.fd.dropouts += p > 0
    return _drop(c, x, p) if train and p > 0 else x


@maps(aten.native_dropout)
def _native_dropout(c, input, p, train=None):
    """(output, keep-mask): the mask is where dropout of ones is nonzero (the same offset: the same mask)."""
    x = c._tensor(input)
    c.fd.dropouts += p > 0
    if train is False or p == 0:
        return x, c.ops.full(x.shape, 1, "bool")
    offset = c._rng_offset
    out = _drop(c, x, p)
    return out, c.ops.ne(c.ops.dropout(c.ops.full(x.shape, 1.0, x.dtype), c._seed, float(p), offset), 0)


def _cast(c, x, dtype):
    x = c._tensor(x)
    return x if dtype is None or canonical_dtype(dtype) == x.dtype else c.ops.cast(x, dtype)


@maps(aten._to_copy, aten.to)
def _to(c, self, dtype=None, other=None, **_):
    if isinstance(other, TensorView):
        dtype = other.dtype
    return _cast(c, self, dtype)


@maps(aten.type_as)
def _type_as(c, self, other):
    return _cast(c, self, other.dtype)


@maps(aten._assert_tensor_metadata)
def _assert_metadata(c, a, size=None, stride=None, dtype=None, **_):
    if dtype is not None and isinstance(a, (TensorView, _Lazy)) and a.dtype != dtype:
        raise c.error(f"asserts dtype {dtype} of {a.name}, which is {a.dtype}", "report this model to egraph-did")
    return None


# ------------------------------------------------------------ views

@maps(aten.view, aten.reshape, aten._unsafe_view)
def _reshape(c, self, size=None, shape=None, **_):
    return c.ops.reshape(c._tensor(self), tuple(size if size is not None else shape))


@maps(aten.permute)
def _permute(c, self, dims):
    return c.ops.permute(c._tensor(self), tuple(dims))


@maps(aten.transpose)
def _transpose(c, self, dim0, dim1):
    return c.ops.transpose(c._tensor(self), dim0, dim1)


@maps(aten.t)
def _t(c, self):
    x = c._tensor(self)
    return x if x.ndim < 2 else c.ops.transpose(x, 0, 1)


@maps(aten.expand)
def _expand(c, self, size, implicit=False):
    return c.ops.expand(c._tensor(self), tuple(size))


@maps(aten.unsqueeze)
def _unsqueeze(c, self, dim):
    return c.ops.unsqueeze(c._tensor(self), dim)


@maps(aten.squeeze)
def _squeeze(c, self, dim=None):
    x = c._tensor(self)
    dims = range(x.ndim) if dim is None else ([dim] if isinstance(dim, int) else dim)
    drop = {d % x.ndim for d in dims if x.shape[d] == 1}
    return c.ops.reshape(x, tuple(e for i, e in enumerate(x.shape) if i not in drop))


@maps(aten.slice)
def _slice(c, self, dim=0, start=None, end=None, step=1):
    if step != 1:
        raise c.error(f"slices with step {step}", "fd.ops.slice takes step 1; slice with step 1, or map it")
    x = c._tensor(self)
    end = None if end is None or end >= x.shape[dim] else end  # torch writes "to the end" as 2**63 - 1
    return c.ops.slice(x, dim, 0 if start is None else start, end)


@maps(aten.select)
def _select(c, self, dim, index):
    x = c._tensor(self)
    d = dim % x.ndim
    row = c.ops.slice(x, d, index, index + 1 if index != -1 else None)
    return c.ops.reshape(row, x.shape[:d] + x.shape[d + 1:])


@maps(aten.split, aten.split_with_sizes)
def _split(c, self, split_size=None, split_sizes=None, dim=0):
    x = c._tensor(self)
    n = x.shape[dim]
    sizes = list(split_sizes) if split_sizes is not None else [min(split_size, n - i) for i in range(0, n, split_size)]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return tuple(c.ops.slice(x, dim, lo, hi) for lo, hi in zip(bounds, bounds[1:]))


@maps(aten.chunk)
def _chunk(c, self, chunks, dim=0):
    n = c._tensor(self).shape[dim]
    return _split(c, self, split_size=-(-n // chunks), dim=dim)


@maps(aten.cat)
def _cat(c, tensors, dim=0):
    ts = [c._tensor(t) for t in tensors]
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    ts = [t if t.dtype == dtype else c.ops.cast(t, dtype) for t in ts]
    out = ts[0]
    for t in ts[1:]:
        out = c.ops.cat(out, t, dim)
    return out


# ------------------------------------------------------------ reductions and normalizations

def _dims(dim):
    return None if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0) else (
        dim if isinstance(dim, int) else tuple(dim))


def _reduce(op_name):
    def fn(c, self, dim=None, keepdim=False, dtype=None):
        x = _cast(c, self, dtype)
        return getattr(c.ops, op_name)(x, _dims(dim), keepdim=keepdim)
    return fn


maps(aten.sum)(_reduce("sum"))
maps(aten.mean)(_reduce("mean"))
maps(aten.amax)(lambda c, self, dim=(), keepdim=False: c.ops.amax(c._tensor(self), _dims(dim), keepdim=keepdim))
maps(aten.amin)(lambda c, self, dim=(), keepdim=False: c.ops.amin(c._tensor(self), _dims(dim), keepdim=keepdim))
maps(aten.prod)(_reduce("prod"))
maps(aten.any)(lambda c, self, dim=None, keepdim=False: c.ops.any(c._tensor(self), _dims(dim), keepdim=keepdim))
maps(aten.all)(lambda c, self, dim=None, keepdim=False: c.ops.all(c._tensor(self), _dims(dim), keepdim=keepdim))


@maps(aten.minimum)
def _minimum(c, self, other):
    return c.ops.minimum(c.operand(self), c.operand(other))


def _extremum(name: str):
    """torch.min/torch.max: over every axis (amin/amax), along dim (the values; the indices, arg{name}, are
    not computed: reading them is refused), or of two tensors (minimum/maximum)."""
    def fn(c, self, dim=None, keepdim=False, other=None):
        x = c._tensor(self)
        if other is not None:
            y = c.operand(other)
            return c.ops.maximum(x, y) if name == "max" else c.ops.minimum(x, y)
        reduce = c.ops.amax if name == "max" else c.ops.amin
        if dim is None:
            return reduce(x, None)
        return reduce(x, dim, keepdim=keepdim), _Unavailable(f"{name}'s indices (torch.arg{name})")
    return fn


maps(aten.min)(_extremum("min"))
maps(aten.max)(_extremum("max"))


# ------------------------------------------------------------ masks: scans, logic and bits

@maps(aten.cumsum)
def _cumsum(c, self, dim, dtype=None):
    return c.ops.cumsum(_cast(c, self, dtype), dim)


for _name in ("bitwise_and", "bitwise_or", "bitwise_xor", "logical_and", "logical_or"):
    maps(getattr(aten, _name))(_binary(_name))
for _aten, _op in (("__and__", "bitwise_and"), ("__or__", "bitwise_or"), ("__xor__", "bitwise_xor")):
    maps(getattr(aten, _aten))(_binary(_op))
maps(aten.logical_not)(_unary("logical_not"))


@maps(aten.bitwise_not)
def _bitwise_not(c, self):
    """~x: not, of a bool mask; x xor -1 (every bit flipped), of an integer tensor."""
    x = c._tensor(self)
    return c.ops.logical_not(x) if x.dtype == torch.bool else c.ops.bitwise_xor(x, -1)


@maps(aten._softmax, aten.softmax)
def _softmax(c, self, dim, half_to_float=False, dtype=None):
    return c.ops.softmax(_cast(c, self, dtype), dim)


@maps(aten._log_softmax, aten.log_softmax)
def _log_softmax(c, self, dim, half_to_float=False, dtype=None):
    """log_softmax(x) = x - max - log(sum(exp(x - max))) in fusion ops; remembered as x's, so that an
    nll_loss of it maps onto cross_entropy(x) (one op, its own vjp and the vocab-parallel rules)."""
    x = _cast(c, self, dtype)
    shifted = c.ops.sub(x, c.ops.amax(x, dim, keepdim=True))
    out = c.ops.sub(shifted, c.ops.log(c.ops.sum(c.ops.exp(shifted), dim, keepdim=True)))
    c.log_softmax_of[id(out)] = (x, dim % x.ndim)
    return out


_REDUCTIONS = ("none", "mean", "sum")  # ATen's reduction enum: 0, 1, 2


def _class_loss(c, x: TensorView, target, reduction: int, ignore_index: int, nll: bool) -> TensorView:
    """torch's cross entropy (nll=False) or nll_loss (nll=True: x holds log-probabilities) of x [N, C] or
    [N, C, d..] against class indices, as fd.ops.cross_entropy; an nll_loss of a log_softmax over the
    classes is the cross entropy of the log_softmax's operand. A loss of [N, C, d..] is the one of its
    rows with the classes last (permute and reshape; 'none' reshaped back to [N, d..])."""
    t = c._tensor(target)
    red = _REDUCTIONS[reduction]
    if nll:
        x, dim = c.log_softmax_of.get(id(x), (None, None))
        if dim != 1:
            return None
    if x.ndim > 2:
        x = c.ops.reshape(c.ops.permute(x, (0, *range(2, x.ndim), 1)), (-1, x.shape[1]))
        t = c.ops.reshape(t, (-1,))
    t = t if t.dtype == torch.int64 else c.ops.cast(t, torch.int64)
    out = c.ops.cross_entropy(x, t, red, ignore_index=ignore_index)
    shape = c._tensor(target).shape
    return c.ops.reshape(out, shape) if red == "none" and out.shape != shape else out


@maps(aten.cross_entropy_loss)
def _cross_entropy_loss(c, self, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """F.cross_entropy with class indices (transformers' ForCausalLMLoss: ignore_index -100, 'mean' or
    'sum'); class weights, label smoothing, probabilities as targets and 1-D logits are opaque steps."""
    x, t = c._tensor(self), c._tensor(target)
    if weight is not None or label_smoothing or x.ndim < 2 or t.dtype.is_floating_point:
        return c.unmapped(c.node)
    return _class_loss(c, x, target, reduction, ignore_index, nll=False)


@maps(aten.nll_loss_nd, aten.nll_loss, aten.nll_loss2d)
def _nll_loss(c, self, target, weight=None, reduction=1, ignore_index=-100):
    """F.nll_loss of a log_softmax over the classes: cross_entropy of its operand; another input (or class
    weights) an opaque step."""
    x = c._tensor(self)
    out = None if weight is not None or x.ndim < 2 else _class_loss(c, x, target, reduction, ignore_index, nll=True)
    return c.unmapped(c.node) if out is None else out


@maps(aten.nll_loss_forward)
def _nll_loss_forward(c, self, target, weight, reduction, ignore_index):
    """nll_loss_forward: the loss as nll_loss; its total_weight (the count of rows kept) is not computed."""
    x = c._tensor(self)
    out = None if weight is not None or x.ndim != 2 else _class_loss(c, x, target, reduction, ignore_index, nll=True)
    if out is None:
        raise c.error("is the loss of an input other than a log_softmax over the classes, with two outputs",
                      "compute the loss with F.cross_entropy, or F.nll_loss of F.log_softmax")
    return out, _Unavailable("nll_loss_forward's total_weight")


@maps(aten.constant_pad_nd, aten.pad)
def _pad(c, self, pad, value=None, mode="constant"):
    """F.pad in constant mode (transformers' ForCausalLMLoss shifts its labels so): along each padded axis a
    cat with a full of `value` (0 where None), a negative pad a slice; other modes are opaque steps."""
    x = c._tensor(self)
    if mode != "constant" or len(pad) % 2 or len(pad) // 2 > x.ndim:
        return c.unmapped(c.node)
    value = 0 if value is None else value
    value = bool(value) if x.dtype == torch.bool else value if x.dtype.is_floating_point else int(value)
    for i in range(len(pad) // 2):
        dim, (lo, hi) = x.ndim - 1 - i, pad[2 * i: 2 * i + 2]
        n = x.shape[dim]
        if lo < 0 or hi < 0:
            x = c.ops.slice(x, dim, max(-lo, 0), n + hi if hi < 0 else None)
        for amount, first in ((lo, True), (hi, False)):
            if amount > 0:
                shape = x.shape[:dim] + (amount,) + x.shape[dim + 1:]
                fill = c.ops.full(shape, value, x.dtype) if x.dtype != torch.bool else \
                    c.ops.ne(c.ops.full(shape, int(value), torch.int64), 0)
                x = c.ops.cat(fill, x, dim) if first else c.ops.cat(x, fill, dim)
    return x


@maps(aten.layer_norm)
def _layer_norm(c, input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    w, b = (None if t is None else c._tensor(t) for t in (weight, bias))
    return c.ops.layer_norm(c._tensor(input), tuple(normalized_shape), w, b, eps)


@maps(aten.native_layer_norm)
def _native_layer_norm(c, input, normalized_shape, weight, bias, eps):
    y = _layer_norm(c, input, normalized_shape, weight, bias, eps)
    return y, _Unavailable("native_layer_norm's mean"), _Unavailable("native_layer_norm's rstd")


@maps(aten.rms_norm)
def _rms_norm(c, input, normalized_shape, weight=None, eps=None):
    x = c._tensor(input)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return c.ops.rms_norm(x, tuple(normalized_shape), None if weight is None else c._tensor(weight), eps)


# ------------------------------------------------------------ matmuls, attention, embedding

def _weight_of(c, t: TensorView) -> TensorView | None:
    """W where t is W transposed ([in, out] as a view of a parameter [out, in]), else None: mm and addmm
    on it are a linear, whose sharding rules the optimizer knows."""
    e = c.fd.fusion.producer(t)
    if e is None or t.ndim != 2:
        return None
    if e.op.name == "permute" and tuple(e.attrs["dims"]) in ((1, 0), (-1, -2), (1, -2), (-1, 0)):
        return e.inputs[0]
    if e.op.name == "transpose" and {e.attrs["dim0"] % 2, e.attrs["dim1"] % 2} == {0, 1}:
        return e.inputs[0]
    return None


def _mm(c, a, b, bias=None):
    a, b = c._tensor(a), c._tensor(b)
    w = _weight_of(c, b)
    if w is not None:
        return c.ops.linear(a, w, bias)
    y = c.ops.matmul(a, b)
    return y if bias is None else c.ops.add(y, bias)


@maps(aten.linear)
def _linear(c, input, weight, bias=None):
    return c.ops.linear(c._tensor(input), c._tensor(weight), None if bias is None else c._tensor(bias))


@maps(aten.mm, aten.bmm)
def _matmul2(c, self, mat2):
    return _mm(c, self, mat2)


@maps(aten.matmul)
def _matmul(c, self, other):
    a, b = c._tensor(self), c._tensor(other)
    if a.ndim >= 2 and b.ndim >= 2:
        return _mm(c, a, b)
    a2 = c.ops.unsqueeze(a, 0) if a.ndim == 1 else a
    b2 = c.ops.unsqueeze(b, 1) if b.ndim == 1 else b
    y = c.ops.matmul(a2, b2)
    shape = y.shape[:-2] + ((y.shape[-2],) if a.ndim > 1 else ()) + ((y.shape[-1],) if b.ndim > 1 else ())
    return c.ops.reshape(y, shape)


@maps(aten.addmm)
def _addmm(c, self, mat1, mat2, beta=1, alpha=1):
    bias = c._tensor(self)
    if beta != 1 or alpha != 1:
        y = c.ops.mul(_mm(c, mat1, mat2), alpha)
        return c.ops.add(y, c.ops.mul(bias, beta))
    if bias.ndim == 1:
        return _mm(c, mat1, mat2, bias)
    return c.ops.add(_mm(c, mat1, mat2), bias)


@maps(aten.embedding)
def _embedding(c, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return c.ops.embedding(c._tensor(indices), c._tensor(weight))


def _is_causal_mask(mask: "_Folded", sq: int, sk: int) -> bool:
    """Whether an attention mask, bool (True keeps) or additive (0 keeps, -inf drops), is the causal one
    on every batch and head. A mask that how it is built proves constant along its diagonals (_on_diagonals:
    transformers' comparison of positions) is checked on one element of each, 2 s - 1 for s tokens;
    any other on all its values.

    >>> causal = _Lazy(aten.le.Tensor, {"self": _Folded(torch.arange(4)[None, :], "j"),
    ...                                 "other": _Folded(torch.arange(4)[:, None], "i")}, "causal", (4, 4), torch.bool)
    >>> _is_causal_mask(causal, 4, 4), causal.done  # checked on 7 elements, never computed whole
    (True, False)
    >>> window = _Lazy(aten.gt.Tensor, {"self": _Folded(torch.arange(4)[None, :] + 2, "j"),
    ...                                 "other": _Folded(torch.arange(4)[:, None], "i")}, "window", (4, 4), torch.bool)
    >>> band = _Lazy(aten.__and__.Tensor, {"self": causal, "other": window}, "band", (4, 4), torch.bool)
    >>> _is_causal_mask(band, 4, 4)
    False
    """
    if sq != sk or tuple(mask.shape[-2:]) != (sq, sk):
        return False
    i = torch.arange(-(sq - 1), sq).neg().clamp(min=0)  # one (i, j) of each diagonal d = j - i, -(s-1) .. s-1
    j = i + torch.arange(-(sq - 1), sq)
    values = _on_diagonals(mask, len(mask.shape), sq, i, j) if isinstance(mask, _Lazy) else None
    if values is not None:  # [.., 1, 1] where the mask is one value broadcast (a [1, 1] keep-all expanded)
        values = values.expand(*values.shape[:-1], len(i))
    if values is None:
        values, i, j = mask.value, torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = (j <= i).expand(values.shape)
    kept = values if values.dtype == torch.bool else (values == 0)
    drops_all = values.dtype == torch.bool or bool(torch.isneginf(values[~kept.expand(values.shape)]).all())
    return drops_all and torch.equal(kept.expand(values.shape), keep)


# the ops that compare or subtract two integers: their value depends on the difference of their operands only
_DIFFERENCES = {aten.sub, aten.rsub, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge}
# bitwise and/or/xor have no pointwise tag; casts and expand give each element from the same one of the operand
_ELEMENTWISE = {aten.__and__, aten.__or__, aten.__xor__, aten.to, aten._to_copy, aten.expand}


def _broadcasts(target, kwargs: dict, val: torch.Tensor) -> bool:
    """Whether a folded node is kept as how it is computed (a _Lazy): an elementwise op whose value is larger
    than each of its operands (a comparison of rows [s, 1] and columns [1, s] of positions into a mask
    [s, s]) or that reads such a value. A causal mask of s tokens is then recognized without its s * s values."""
    if getattr(target, "overloadpacket", None) not in _ELEMENTWISE and torch.Tag.pointwise not in target.tags:
        return False
    tensors = [v for v in kwargs.values() if isinstance(v, _Folded)]
    if not tensors:
        return False
    return any(isinstance(v, _Lazy) for v in tensors) or all(math.prod(v.shape) < val.numel() for v in tensors)


def _on_diagonals(v: _Lazy, n: int, s: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor | None:
    """v's values at (i[d], j[d]) of its last two axes [s, s], one pair of each diagonal, as [.., 1, len(i)]
    (n axes); or None unless how v is built proves it constant along every diagonal (v[.., i, j] a function
    of j - i). Proved where v's op is elementwise and reads values proved so or constant over the last two
    axes; or compares or subtracts a row [.., s, 1] and a column [.., 1, s] of integers that each rise by the
    same step: a + step * i against b + step * j depends on j - i only. Operands smaller than [s, s] are
    computed (s values a row or column); one [s, s] computed whole proves nothing."""
    args, rows_or_columns = {}, []
    for k, x in v.kwargs.items():
        if not isinstance(x, _Folded):
            args[k] = _on_cpu(x)
        elif isinstance(x, _Lazy) and tuple(x.shape[-2:]) == (s, s):
            args[k] = _on_diagonals(x, n, s, i, j)
            if args[k] is None:
                return None
        else:
            t = x.value.reshape((1,) * (n - x.value.ndim) + tuple(x.value.shape))
            if t.shape[-2:] == (s, 1) and s > 1:
                args[k] = t.index_select(-2, i).transpose(-1, -2)
            elif t.shape[-2:] == (1, s) and s > 1:
                args[k] = t.index_select(-1, j)
            elif t.shape[-2:] == (1, 1):
                args[k] = t
            else:
                return None
            if t.shape[-2:] != (1, 1):
                rows_or_columns.append(t)
    difference = v.target.overloadpacket in _DIFFERENCES and v.kwargs.get("alpha", 1) == 1  # not x - 2 y
    if rows_or_columns and not (difference and len(rows_or_columns) == 2 and _same_step(*rows_or_columns, s)):
        return None
    if v.target.overloadpacket is aten.expand:  # it broadcasts the axes before the last two only
        return args["self"]
    with torch.no_grad():
        return v.target(**args)


def _same_step(a: torch.Tensor, b: torch.Tensor, s: int) -> bool:
    """Whether one of a and b (as many axes) is a row [.., s, 1] and the other a column [.., 1, s] of integers,
    each rising by a constant step along it, the same step in both (on each of the axes before)."""
    def step(x, axis):
        if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            return None
        if not bool(((x >= -2**62) & (x < 2**62)).all()):  # near int64's ends, first + rise * i may wrap around
            return None
        x = x.movedim(axis, -1)
        first, rise = x[..., :1], x[..., 1:2] - x[..., :1]
        return rise if torch.equal(x, first + rise * torch.arange(s)) else None

    if (a.shape[-2:], b.shape[-2:]) == ((1, s), (s, 1)):
        a, b = b, a
    if (a.shape[-2:], b.shape[-2:]) != ((s, 1), (1, s)):
        return False
    ra, rb = step(a, -2), step(b, -1)
    return ra is not None and rb is not None and torch.equal(*torch.broadcast_tensors(ra, rb))


@maps(aten.scaled_dot_product_attention)
def _sdpa(c, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p:
        raise c.error(f"drops out attention (dropout_p={dropout_p})", "export in eval mode (module.eval())")
    q, k, v = (c._tensor(t) for t in (query, key, value))
    if enable_gqa and k.shape[1] != q.shape[1]:
        k, v = (_repeat_heads(c, t, q.shape[1] // t.shape[1]) for t in (k, v))
    if attn_mask is None or (isinstance(attn_mask, _Folded) and not is_causal
                             and c.is_causal_mask(attn_mask, q.shape[2], k.shape[2])):
        return c.ops.sdpa(q, k, v, is_causal=bool(is_causal or attn_mask is not None), scale=scale)
    if is_causal:
        raise c.error("has both a mask and is_causal", "torch refuses this too; pass one of them")
    return _sdpa_with_mask(c, q, k, v, c._tensor(attn_mask), scale)


def _repeat_heads(c, t: TensorView, n: int) -> TensorView:
    b, h, s, d = t.shape
    return c.ops.reshape(c.ops.expand(c.ops.unsqueeze(t, 2), (b, h, n, s, d)), (b, h * n, s, d))


def _sdpa_with_mask(c, q, k, v, mask, scale):
    """softmax(q k^T * scale + mask) v, mask bool (True keeps) or additive: sdpa spelled out."""
    ops = c.ops
    s = ops.mul(ops.matmul(q, ops.transpose(k, -2, -1)), scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    s = ops.where(mask, s, -math.inf) if mask.dtype == torch.bool else ops.add(s, ops.cast(mask, s.dtype))
    return ops.matmul(ops.softmax(s, -1), v)


# ------------------------------------------------------------ mixture-of-experts routing

def _argsort(c, x: TensorView, dim: int, descending: bool) -> TensorView:
    """The indices that sort x along dim, stable (ties keep their order): fd.ops.argsort, which shards on
    every axis but dim; an integer result, through which no gradient flows."""
    return c.ops.argsort(x, dim, bool(descending))


@maps(aten.argsort)
def _argsort_op(c, self, dim=-1, descending=False, stable=False):
    """torch.argsort, stable or not (a stable order is one an unstable sort may give)."""
    x = c._tensor(self)
    return _argsort(c, x, dim % max(x.ndim, 1), descending)


@maps(aten.histc)
def _histc(c, self, bins=100, min=0, max=0):
    """torch.histc with its range given (min < max): fd.ops.histc, a pending sum of counts over shards of x
    (float or integer x: transformers' experts count int ids off the CPU, so a model exported on the meta
    device has the CPU export's ops). min == max takes the range from the data: an opaque step."""
    x = c._tensor(self)
    if not (min < max) or x.dtype == torch.bool:
        return c.unmapped(c.node)
    return c.ops.histc(x, int(bins), min, max)


def _grouped(c, x, w, offs):
    """grouped_mm of a 2-D x and a 3-D w over per-expert row ranges (offs), cast to int64 if int32; other
    forms (2-D w, 3-D x, no offsets) are opaque steps."""
    if offs is None:
        return c.unmapped(c.node)
    x, w, offs = c._tensor(x), c._tensor(w), c._tensor(offs)
    if x.ndim != 2 or w.ndim != 3 or offs.ndim != 1 or offs.dtype not in (torch.int32, torch.int64):
        return c.unmapped(c.node)
    return c.ops.grouped_mm(x, w, offs)


@maps(aten._grouped_mm)
def _grouped_mm(c, self, mat2, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm / F.grouped_mm of [rows, d] by [experts, d, f] at offsets: fd.ops.grouped_mm (a bias or
    another output dtype: an opaque step)."""
    if bias is not None or (out_dtype is not None and out_dtype != mat2.dtype):
        return c.unmapped(c.node)
    return _grouped(c, self, mat2, offs)


def _grouped_mm_fallback(c, input, weight, offs):
    """transformers' grouped_mm_fallback custom op (its loop of torch.mm over the experts' rows, rows past
    offs[-1] zero): fd.ops.grouped_mm."""
    return _grouped(c, input, weight, offs)


# custom ops mapped by their schema name (their namespace exists only once the library that defines them loaded)
BY_NAME: dict[str, Callable[..., Any]] = {"transformers::grouped_mm_fallback": _grouped_mm_fallback}


@maps(aten.index_put)
def _index_put(c, self, indices, values, accumulate=False):
    """inverse[perm] = arange(n) into an uninitialized (folded: zeros) 1-D tensor, as transformers' grouped
    experts un-sort tokens: the inverse permutation of perm, which is argsort(perm) (torch's result is
    defined only where perm is a permutation of 0..n-1: with a repeated index it leaves entries
    uninitialized). Other forms are opaque steps."""
    idx = list(indices) if isinstance(indices, (list, tuple)) else []
    if (accumulate or len(idx) != 1 or not isinstance(idx[0], TensorView) or not isinstance(values, _Folded)
            or not isinstance(self, _Folded) or self.value.ndim != 1 or idx[0].ndim != 1):
        return c.unmapped(c.node)
    perm, n = idx[0], self.value.shape[0]
    arange = torch.arange(n, dtype=values.value.dtype)
    if perm.shape != (n,) or perm.dtype != torch.int64 or values.value.shape != (n,) or \
            not torch.equal(values.value, arange) or self.value.dtype != torch.int64:
        return c.unmapped(c.node)
    return _argsort(c, perm, 0, False)


@maps(aten.floor_divide)
def _floor_divide(c, self, other):
    """a // k of an integer tensor by a nonzero int: the float64 quotient truncated (cast), less one where
    truncation rounded up (q k > a for k > 0, q k < a for k < 0), exact for |a| < 2**26; a float or tensor
    divisor is an opaque step."""
    a = c._tensor(self)
    if a.dtype not in (torch.int32, torch.int64) or isinstance(other, bool) or not isinstance(other, int) or not other:
        return c.unmapped(c.node)
    ops = c.ops
    q = ops.cast(ops.div(ops.cast(a, torch.float64), float(other)), a.dtype)
    over = ops.gt(ops.mul(q, other), a) if other > 0 else ops.lt(ops.mul(q, other), a)
    return ops.sub(q, ops.cast(over, a.dtype))


@maps(aten.topk)
def _topk(c, self, k, dim=-1, largest=True, sorted=True):
    """torch.topk as (values, indices): the indices are the first k of a stable argsort (ties go to the
    lower index, as topk's do), the values gathered at them (take_along_axis), so the gradient reaches
    the scores. Sorted either way (topk's order with sorted=False is unspecified)."""
    x = c._tensor(self)
    d = dim % x.ndim
    indices = c.ops.slice(_argsort(c, x, d, largest), d, 0, k if k < x.shape[d] else None)
    return c.ops.take_along_axis(x, indices, d), indices


@maps(aten.sort)
def _sort(c, self, dim=-1, descending=False, stable=None):
    """torch.sort as (values, indices), as topk of every entry: a stable argsort (where torch's unstable sort
    may order ties otherwise, both are sorted) and the values gathered at it."""
    x = c._tensor(self)
    d = dim % x.ndim
    indices = _argsort(c, x, d, descending)
    return c.ops.take_along_axis(x, indices, d), indices


@maps(aten.index)
def _index(c, self, indices):
    """x[idx] with one integer index tensor on the first axis (an expert's weights picked per token):
    rows of x as an embedding table, [x.shape[0], the rest flattened], so that the gather has the
    embedding's sharding rules and gradient. Other forms (boolean masks, several index tensors, an index
    on a later axis) become opaque steps."""
    x = c._tensor(self)
    idx = list(indices)
    if len(idx) != 1 or not isinstance(idx[0], (TensorView, _Folded)) or x.ndim < 1:
        return c.unmapped(c.node)
    ids = c._tensor(idx[0])
    if ids.dtype not in (torch.int32, torch.int64):
        return c.unmapped(c.node)
    rest = x.shape[1:]
    table = x if x.ndim == 2 else c.ops.reshape(x, (x.shape[0], math.prod(rest)))
    rows = c.ops.embedding(ids, table)
    return rows if x.ndim == 2 else c.ops.reshape(rows, ids.shape + rest)


@maps(aten.gather)
def _gather(c, self, dim, index, sparse_grad=False):
    """torch.gather: take_along_axis where index matches x on every axis but dim (an index narrower on
    another axis is an opaque step)."""
    x, ids = c._tensor(self), c._tensor(index)
    d = dim % max(x.ndim, 1)
    if ids.dtype != torch.int64 or ids.ndim != x.ndim or any(
            i != d and a != b for i, (a, b) in enumerate(zip(x.shape, ids.shape))):
        return c.unmapped(c.node)
    return c.ops.take_along_axis(x, ids, d)


@maps(aten.scatter)
def _scatter(c, self, dim, index, value=None, src=None, reduce=None):
    """x.scatter(dim, index, v) of a number v (DeepSeek's router marks its top groups so): where(hit, v, x),
    hit = scatter_add of ones at index > 0; exact with repeated indices too (every write writes v), and x
    keeps its gradient where nothing is written. A tensor src or a reduce is an opaque step."""
    if src is not None or reduce is not None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return c.unmapped(c.node)
    x, ids = c._tensor(self), c._tensor(index)
    d = dim % max(x.ndim, 1)
    if ids.dtype != torch.int64 or ids.ndim != x.ndim or any(
            i != d and a != b for i, (a, b) in enumerate(zip(x.shape, ids.shape))):
        return c.unmapped(c.node)
    ops = c.ops
    hits = ops.scatter_add(ops.full(x.shape, 0.0, torch.float32), d, ids, ops.full(ids.shape, 1.0, torch.float32))
    return ops.where(ops.gt(hits, 0.0), value, x)


@maps(aten.scatter_add)
def _scatter_add(c, self, dim, index, src):
    """torch.scatter_add where index has src's shape and matches x on every axis but dim (the routing
    of mixture-of-experts layers: tokens' outputs summed back per token); other forms are opaque steps."""
    x, ids, y = c._tensor(self), c._tensor(index), c._tensor(src)
    d = dim % max(x.ndim, 1)
    if ids.dtype != torch.int64 or ids.shape != y.shape or ids.ndim != x.ndim or y.dtype != x.dtype or any(
            i != d and a != b for i, (a, b) in enumerate(zip(x.shape, ids.shape))):
        return c.unmapped(c.node)
    return c.ops.scatter_add(x, d, ids, y)


@maps(aten.index_add)
def _index_add(c, self, dim, index, source, alpha=1):
    """x.index_add(dim, idx, src): src's slices along dim added at x's rows idx, as a scatter_add whose
    index is idx broadcast to src's shape (alpha scales src first)."""
    x, ids, y = c._tensor(self), c._tensor(index), c._tensor(source)
    d = dim % max(x.ndim, 1)
    if ids.ndim != 1 or ids.dtype not in (torch.int32, torch.int64) or y.ndim != x.ndim or y.dtype != x.dtype \
            or any(i != d and a != b for i, (a, b) in enumerate(zip(x.shape, y.shape))):
        return c.unmapped(c.node)
    if ids.dtype != torch.int64:
        ids = c.ops.cast(ids, torch.int64)
    wide = c.ops.expand(c.ops.reshape(ids, tuple(ids.shape[0] if i == d else 1 for i in range(y.ndim))), y.shape)
    return c.ops.scatter_add(x, d, wide, y if alpha == 1 else c.ops.mul(y, alpha))


@maps(aten.repeat_interleave)
def _repeat_interleave(c, self=None, repeats=None, dim=None, output_size=None):
    """x.repeat_interleave(n, dim) with an int n: each slice along dim n times in a row, as an expand of
    a new axis after dim, merged into it. A tensor of counts has a data-dependent length: an opaque step."""
    if self is None or not isinstance(repeats, int) or dim is None:  # repeat_interleave.Tensor: counts only
        return c.unmapped(c.node)
    x = c._tensor(self)
    d = dim % x.ndim
    wide = c.ops.expand(c.ops.unsqueeze(x, d + 1), x.shape[:d + 1] + (repeats,) + x.shape[d + 1:])
    return c.ops.reshape(wide, x.shape[:d] + (x.shape[d] * repeats,) + x.shape[d + 1:])


# ------------------------------------------------------------ complex numbers as pairs of reals

@maps(aten.view_as_complex)
def _view_as_complex(c, self):
    """A real [..., 2] tensor read as complex: the same tensor, marked complex (its pairs)."""
    return _Complex(c._tensor(self))


@maps(aten.view_as_real)
def _view_as_real(c, self):
    if not isinstance(self, _Complex):
        raise c.error(f"reads {self!r:.40} as complex", "report this model to egraph-did")
    return self.pairs


def _parts(c, v) -> tuple:
    """(real part, imaginary part) of an operand of a complex product, each keeping a last axis of extent 1
    (so that broadcasting lines the parts up as it does the complex values): slices of a computed value's
    pairs, folded halves of a constant's (torchtitan's rotary table), or (x[..., None], 0) of a real one."""
    if isinstance(v, _Complex):
        return c.ops.slice(v.pairs, -1, 0, 1), c.ops.slice(v.pairs, -1, 1, None)
    if isinstance(v, _Folded) and v.value.is_complex():
        pairs = torch.view_as_real(v.value.resolve_conj())
        return (_Folded(pairs[..., :1].contiguous(), f"{v.name}.real"),
                _Folded(pairs[..., 1:].contiguous(), f"{v.name}.imag"))
    x = c.operand(v)
    return (x if isinstance(x, (int, float, bool)) else c.ops.unsqueeze(x, -1)), 0


def _complex_mul(c, a, b) -> _Complex:
    """a * b with either side complex: (ar br - ai bi, ar bi + ai br), concatenated on the pairs' axis."""
    (ar, ai), (br, bi) = _parts(c, a), _parts(c, b)

    def prod(x, y):
        if isinstance(x, (int, float)) and x == 0 or isinstance(y, (int, float)) and y == 0:
            return 0
        return c.ops.mul(c.operand(x), c.operand(y))

    def combine(x, y, sub: bool):
        if isinstance(y, int) and y == 0:
            return x
        if isinstance(x, int) and x == 0:
            return c.ops.neg(y) if sub else y
        return c.ops.sub(x, y) if sub else c.ops.add(x, y)

    real = combine(prod(ar, br), prod(ai, bi), sub=True)
    imag = combine(prod(ar, bi), prod(ai, br), sub=False)
    return _Complex(c.ops.cat(real, imag, -1))


@maps(aten.flatten)
def _flatten(c, self, start_dim=0, end_dim=-1):
    x = c._tensor(self)
    if x.ndim == 0:
        return c.ops.reshape(x, (1,))
    lo, hi = start_dim % x.ndim, end_dim % x.ndim
    return c.ops.reshape(x, x.shape[:lo] + (math.prod(x.shape[lo:hi + 1]),) + x.shape[hi + 1:])


# ------------------------------------------------------------ shape-only values

@maps(aten.empty_like)
def _empty_like(c, self, **kwargs):
    """An uninitialized tensor like the operand (to be written into, as inverse[perm] = arange): zeros, folded;
    any value is one torch might give, and zeros are the same on every rank."""
    raw = {k: _unfold(v) for k, v in kwargs.items()}
    with torch.no_grad():
        out = torch.zeros_like(torch.empty(self.shape, dtype=self.dtype), **raw)
    return _wrap(out, f"{_module_path(c.node)}.{c.node.name}".lstrip("."))


@maps(aten.zeros_like, aten.ones_like, aten.full_like, aten.new_zeros, aten.new_ones, aten.new_full)
def _like(c, self, **kwargs):
    """A value that depends on the operand's shape and dtype only: folded, as if the operand were known."""
    node = c.node
    stand_in = torch.zeros(self.shape, dtype=self.dtype)
    raw = {"self": stand_in} | {k: _unfold(v) for k, v in kwargs.items()}
    with torch.no_grad():
        return _wrap(node.target(**raw), f"{_module_path(node)}.{node.name}".lstrip("."))


__all__ = ["from_torch", "TorchFusion", "ExportError", "ATEN", "source_line"]
