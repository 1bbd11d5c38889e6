"""Schedule builders: pure functions of a :class:`~..spec.BuildRequest` (stages, micro-batches, stages per rank,
costs, placement), one family each."""

from .gpipe import gpipe
from .one_f_one_b import interleaved_one_f_one_b, one_f_one_b
from .zero_bubble import zero_bubble

__all__ = ["gpipe", "interleaved_one_f_one_b", "one_f_one_b", "zero_bubble"]
