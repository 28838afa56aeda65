"""The two error types raised by `eqx_multimap`.

- [`eqx_multimap.ShapeError`][] is for bad *data*: the arrays passed at call time do
  not have the shapes (or dtypes) that the dims describe.
- [`eqx_multimap.SpecError`][] is for a bad *specification*: a malformed dims string,
  a strategy naming an unknown dim, an `in_dims` that does not fit the arguments.

They deliberately do not share a base class other than `Exception`, so that code
catching one never swallows the other (as in jaxtyping, where `AnnotationError` does
not inherit from `TypeCheckError`).
"""


class ShapeError(TypeError):
    """Raised when the arrays passed to a mapped function do not match their dims.

    The message names the argument path as written at the call site (for example
    `model.flux` or `kwargs['nu']`), the dim, and every size that was seen for it,
    together with where each size was bound.
    """


class SpecError(ValueError):
    """Raised when a dims string, strategy or `in_dims`/`out_dims` is malformed.

    This is an error in the code that calls [`eqx_multimap.filter_multi_vmap`][], not
    in the data it is called with.
    """


ShapeError.__module__ = "eqx_multimap"
SpecError.__module__ = "eqx_multimap"
