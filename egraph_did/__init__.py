"""egraph-did: shard tensor programs across GPUs by equality saturation over DID splits of the loop domain.

>>> import torch, egraph_did as ed
>>> mesh = ed.DeviceMesh.arange(4)
>>> with ed.FusionDefinition() as fd:
...     x = fd.define_tensor((8, 16), name="x", axis_names=("s", "h"))
...     fd.add_output(fd.ops.relu(x), name="y")
>>> _ = x.set_device_mesh(mesh).outer_split(0, mesh.size).axis(0).parallelize(ed.ParallelType.DIDx)
>>> x.loop_str(), x.local_shape(3)
('[DIDx{4}, s/4, h]', (2, 16))
"""
import os as _os

# rewrites/ and lowering/ sit at the top of the repository and install as egraph_did.rewrites and
# egraph_did.lowering (package-dir mapping); from a plain checkout (no install, e.g. on a GPU machine
# with PYTHONPATH set) the same names resolve through the package path.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "rewrites")) and _root not in __path__:
    __path__.append(_root)

import torch as _torch  # noqa: E402

# Triton's jit reads TRITON_INTERPRET once, when triton.language is first imported (by our kernels, or by
# torch.export / transformers importing inductor): a CPU build of torch runs the kernels only interpreted, so
# set it before anything imports Triton (from_torch and the lowering set it too, which is late once transformers
# has imported it: tl.sum inside an interpreted kernel then raises "Cannot call @triton.jit'd outside ...").
# torch.version, not torch.cuda.is_available(): asking the driver at import would tie forked workers to it.
if _torch.version.cuda is None and getattr(_torch.version, "hip", None) is None:
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .errors import DtypeError, EgraphDidError, MeshError, PlanError, ShapeError, ShardingError
from .evaluate import decompose, evaluate
from .fusion import Expr, Fusion, FusionDefinition
from .grad import SGD, AdamW, grad, training_step, value_and_grad
from .ir import IterDomain, IterType, ParallelType, TensorView
from .mesh import DeviceMesh
from .ops import OPS, op_names
from .sharding import local_indices, local_shape, placements, shard_tensor, unshard_tensor

__version__ = "0.1.0"

__all__ = [
    "DeviceMesh", "ParallelType", "IterType", "IterDomain", "TensorView",
    "FusionDefinition", "Fusion", "Expr", "OPS", "op_names",
    "evaluate", "decompose", "grad", "value_and_grad", "training_step", "SGD", "AdamW",
    "shard_tensor", "unshard_tensor", "local_shape", "local_indices", "placements",
    "EgraphDidError", "ShapeError", "DtypeError", "ShardingError", "MeshError", "PlanError",
]

from .cost import CostModel, Link  # noqa: E402
from .layout import Layout, Placement  # noqa: E402
from .optimize import optimize  # noqa: E402
from .plan import Collective, ComputeStep, Plan  # noqa: E402

__all__ += ["CostModel", "Link", "Layout", "Placement", "optimize", "Plan", "Collective", "ComputeStep"]
from .simulate import simulate  # noqa: E402
from . import runtime as _runtime  # noqa: E402,F401  (registers the runner plan.run() calls)

__all__ += ["simulate"]


from .launcher import LaunchError, launch  # noqa: E402

__all__ += ["launch", "LaunchError"]
from .frontend import ExportError, TorchFusion, from_torch  # noqa: E402

__all__ += ["from_torch", "TorchFusion", "ExportError"]
from .parallelize import ParallelModule, ParallelizeError, parallelize  # noqa: E402

__all__ += ["parallelize", "ParallelModule", "ParallelizeError"]
