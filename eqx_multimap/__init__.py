"""Map one per-element function over several named dims: scan outside, vmap inside."""

import os as _os
from collections.abc import Sequence as _Sequence
from importlib.metadata import version as _version

import jax as _jax
from jax._src import traceback_util as _traceback_util

from ._dims import Dims as Dims, parse_dims as parse_dims
from ._doc_utils import for_help as _for_help
from ._errors import ShapeError as ShapeError, SpecError as SpecError
from ._explain import explain as explain, tune as tune
from ._multi_vmap import (
    DimsSpec as DimsSpec,
    filter_multi_vmap as filter_multi_vmap,
    InDims as InDims,
    OutDims as OutDims,
)
from ._options import ScanSpec as ScanSpec
from ._planner import Plan as Plan, Planner as Planner, TimeModel as TimeModel
from ._reduce import (
    Monoid as Monoid,
    ReduceOp as ReduceOp,
    ReduceSpec as ReduceSpec,
)
from ._shard import ShardSpec as ShardSpec
from ._shim import multi_vmap as multi_vmap


# Tracebacks of errors raised through JAX's transforms and our own entry points
# (`jax._src.traceback_util.api_boundary`) end in the user's code: our frames are
# hidden as JAX hides its own (as Equinox does; `JAX_TRACEBACK_FILTERING=off` shows
# them). The path is matched as a prefix, so this covers every module here.
_traceback_util.register_exclusion(_os.path.dirname(_os.path.abspath(__file__)))

_Names = str | _Sequence[str] | None
_Mesh = _jax.sharding.Mesh | None
# `help()` reads `__doc__` and prints the signature; the API reference reads the
# source.
_for_help(
    {k: v for k, v in globals().items() if not k.startswith("_")},
    {
        "InDims": InDims,
        "OutDims": OutDims,
        "ScanSpec": ScanSpec,
        "ReduceSpec": ReduceSpec,
        "ShardSpec": ShardSpec,
        "str | Sequence[str] | None": _Names,
        "jax.sharding.Mesh | None": _Mesh,
    },
)

__version__ = _version("eqx_multimap")
