"""Functions and modules annotated under `from __future__ import annotations`.

Every annotation here is a string until `typing.get_type_hints` resolves it, and some
are forward references (`Spectrum`, `Prediction` are defined after their users).
"""

# ruff: noqa: F821, UP037
# (UP037 would unquote single-name dims, `Float[Array, "F"]` -> `Float[Array, F]`.)
from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from eqx_multimap import filter_multi_vmap
from jaxtyping import Array, Float, Int


class Sky(eqx.Module):
    flux: Float[Array, "S F"]
    spectra: tuple[Spectrum, ...]
    name: str = eqx.field(static=True, default="sky")


class Spectrum(eqx.Module):
    values: Float[Array, "F"]
    gain: Float[Array, "T"]


@filter_multi_vmap(scan="T", core="F")
def predict(sky: Sky, vis: Float[Array, "T F B"], nu: Float[Array, "F"]) -> Prediction:
    assert sky.name == "sky"
    assert vis.shape == nu.shape == sky.spectra[0].values.shape
    assert sky.spectra[0].gain.shape == ()
    model = jnp.sum(sky.flux, axis=0) * sky.spectra[0].values * sky.spectra[0].gain
    return Prediction(vis=vis * model * nu, count=jnp.sum(vis > 0).astype(jnp.int32))


class Prediction(eqx.Module):
    vis: Float[Array, "F B T"]
    count: Int[Array, "T B"]


class Model(eqx.Module):
    w: Float[Array, "F"]

    @filter_multi_vmap(vmap="B")
    def __call__(self, x: Float[Array, "B F"]) -> Output:
        return Output(jnp.dot(self.w, x))


class Output(eqx.Module):
    y: Float[Array, "B"]
