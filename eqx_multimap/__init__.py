"""Map one per-element function over several named dims: scan outside, vmap inside."""

import importlib.metadata

from ._dims import Dims as Dims, parse_dims as parse_dims
from ._errors import ShapeError as ShapeError, SpecError as SpecError
from ._multi_vmap import (
    DimsSpec as DimsSpec,
    filter_multi_vmap as filter_multi_vmap,
    InDims as InDims,
    OutDims as OutDims,
    ScanSpec as ScanSpec,
    ShardSpec as ShardSpec,
)
from ._planner import explain as explain, Plan as Plan
from ._shim import multi_vmap as multi_vmap


__version__ = importlib.metadata.version("eqx_multimap")
