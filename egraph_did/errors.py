"""One exception family. Every message names the tensor, the axis and what to do about it."""


class EgraphDidError(Exception):
    """Base class of every error egraph-did raises on purpose."""


class ShapeError(EgraphDidError, ValueError):
    """An op got operands whose shapes, dtypes or axes do not fit (raised at the op that is wrong)."""


class ShardingError(EgraphDidError, ValueError):
    """A loop-domain transform or a DID binding that cannot be honoured."""


class MeshError(EgraphDidError, ValueError):
    """A device mesh that is malformed, or a mesh axis that does not exist."""


class PlanError(EgraphDidError, ValueError):
    """A plan that cannot be built, loaded or run as asked."""


class DtypeError(ShapeError):
    """A dtype that is unknown, or not allowed for the op it was given to."""
