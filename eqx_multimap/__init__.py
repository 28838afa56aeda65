"""Map one per-element function over several named dims: scan outside, vmap inside."""

import importlib.metadata

from . import timing as timing
from ._dims import Dims as Dims, parse_dims as parse_dims
from ._errors import ShapeError as ShapeError, SpecError as SpecError
from ._multi_vmap import (
    DimsSpec as DimsSpec,
    explain as explain,
    filter_multi_vmap as filter_multi_vmap,
    InDims as InDims,
    OutDims as OutDims,
)
from ._options import ScanSpec as ScanSpec
from ._plan import Plan as Plan
from ._planner import Planner as Planner
from ._reduce import (
    Monoid as Monoid,
    ReduceOp as ReduceOp,
    ReduceSpec as ReduceSpec,
)
from ._shard import ShardSpec as ShardSpec
from ._shim import multi_vmap as multi_vmap
from ._time_model import TimeModel as TimeModel


__version__ = importlib.metadata.version("eqx_multimap")
