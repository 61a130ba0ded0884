"""One exception family. Every message names the tensor, the axis and what to do about it."""


class EgraphDidError(Exception):
    """Base class of every error egraph-did raises on purpose: catch it to catch them all.

    >>> import egraph_did as ed
    >>> try:
    ...     ed.DeviceMesh([0, 0])
    ... except ed.EgraphDidError as e:
    ...     print(type(e).__name__)
    MeshError
    """


class ShapeError(EgraphDidError, ValueError):
    """An op got operands whose shapes, dtypes or axes do not fit (raised at the op that is wrong); or a
    tensor handed to evaluate, simulate or run does not fit the input it is bound to (missing, unknown,
    not a tensor, on the meta device, the wrong shape, or indices outside the table they index).

    >>> import egraph_did as ed
    >>> fd = ed.FusionDefinition()
    >>> x, w = fd.define_tensor((8, 3), name="x"), fd.define_tensor((4, 5), name="w")
    >>> fd.ops.linear(x, w)
    Traceback (most recent call last):
    ...
    egraph_did.errors.ShapeError: linear(x, w): w has in-features 5 but x's last axis is 3 (w is [out, in], as in torch)
    """


class ShardingError(EgraphDidError, ValueError):
    """A loop-domain transform or a DID binding that cannot be honoured.

    >>> import egraph_did as ed
    >>> x = ed.FusionDefinition().define_tensor((8, 3), name="x").set_device_mesh(ed.DeviceMesh.arange(4))
    >>> try:
    ...     x.parallelize(0, ed.ParallelType.DIDx)  # DIDx binds a split of the axis, not the axis
    ... except ed.ShardingError as e:
    ...     print(e)
    x: loop axis 8 has extent 8 but DIDx binds mesh axis 'x' of size 4; use outer_split(axis, 4)
    """


class MeshError(EgraphDidError, ValueError):
    """A device mesh that is malformed, or a mesh axis that does not exist.

    >>> import egraph_did as ed
    >>> ed.DeviceMesh([0, 0])
    Traceback (most recent call last):
    ...
    egraph_did.errors.MeshError: DeviceMesh: rank(s) [0] appear more than once; every rank holds one place
    """


class PlanError(EgraphDidError, ValueError):
    """A plan that cannot be built, loaded or run as asked.

    >>> import egraph_did as ed
    >>> ed.Plan.from_json("{}")
    Traceback (most recent call last):
    ...
    egraph_did.errors.PlanError: not an egraph-did plan (expected format 'egraph-did-plan/2')
    """


class MemoryBoundError(PlanError):
    """No plan fits the cost model's memory bound (per device); the message says what the smallest plan
    found needs. A PlanError too.

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> ed.optimize(mlp(8, 16), ed.DeviceMesh.arange(2), ed.CostModel.h200(memory_limit=64))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    egraph_did.errors.MemoryBoundError: no plan fits the memory bound of 64 B per device ...
    """


class CostModelError(PlanError):
    """A cost model that cannot price a plan: a bad field (memory_limit, a link's bandwidth), an object
    without CostModel's methods, or links that do not match the mesh. A PlanError too.

    >>> import egraph_did as ed
    >>> ed.CostModel.h200(memory_limit=0)
    Traceback (most recent call last):
    ...
    egraph_did.errors.CostModelError: CostModel h200-nvlink: memory_limit must be a positive number of bytes per device, or None for no bound; got 0 (e.g. memory_limit=80 * 2**30 for 80 GiB)
    """


class DtypeError(ShapeError):
    """A dtype that is unknown, or not allowed for the op it was given to. A ShapeError too.

    >>> import egraph_did as ed
    >>> ed.FusionDefinition().define_tensor((2,), dtype="float128", name="z")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    egraph_did.errors.DtypeError: define_tensor(z): unknown or unsupported dtype 'float128'; use one of float32, ...
    >>> ed.FusionDefinition().define_tensor((2,), dtype="complex64", name="z")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    egraph_did.errors.DtypeError: define_tensor(z): complex64 is a complex dtype, which egraph-did does not take ...
    """


class UnknownNameError(ShapeError, KeyError, AttributeError):
    """A name that is not there: an op `fd.ops` lacks, a tensor `fd[name]` lacks. Also a KeyError and an
    AttributeError, so `hasattr`, `getattr(..., default)` and `except KeyError` behave as for any mapping.

    >>> import egraph_did as ed
    >>> fd = ed.FusionDefinition()
    >>> fd.ops.gelo  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    egraph_did.errors.UnknownNameError: fd.ops has no op 'gelo' (did you mean 'gelu'?); known ops: ...
    """

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""
