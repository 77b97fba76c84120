"""Regularising passes: `decay` (shrink the adjoint) and `gaussian_noise`."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eae_jax.passes._util import require_float_spec
from eae_jax.passes.base import AdjointTransformation, stateless
from eae_jax.passes.schedule import ScalarOrSchedule, hyper


def decay(strength: ScalarOrSchedule) -> AdjointTransformation:
    """Shrink the adjoint: ``g * (1 - strength)``.

    The seed's ``RegularizationPass``: a decay proportional to the adjoint
    itself (a stand-in for gradient-space regularisation, not weight decay).
    The product is taken in (at least) float32 and rounded once to the
    adjoint's dtype, as torch multiplies a tensor by a Python float (a
    bfloat16 or float16 adjoint equals the seed's bit for bit).
    ``strength == 0`` leaves the adjoint untouched.

    Args:
      strength: Python float; any real value (``> 1`` flips the sign); or
        a schedule of the step (`eae_jax.passes.schedule`), the factor
        ``1 - strength`` then computed in float32.

    Returns:
      A stateless `AdjointTransformation`.

    Raises:
      TypeError / ValueError: ``strength`` is not a finite number.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.passes import EmptyState, decay
      >>> decay(0.25).update(jnp.array([4.0, -8.0]), EmptyState(), None)[0].tolist()
      [3.0, -6.0]
    """
    bound = hyper("decay", "strength", strength, finite=True)
    name = f"decay({bound.label})"

    def apply(adjoint, ctx):
        if bound.fixed and bound.value == 0.0:
            return adjoint
        # torch keeps a Python scalar in float32 for a bf16/fp16 tensor: rounding the
        # factor to the adjoint's dtype first would move ~30% of the results by an ulp.
        wide = jnp.promote_types(adjoint.dtype, jnp.float32)
        factor = jnp.asarray(1.0 - bound.value, wide) if bound.fixed else (1.0 - bound.at(ctx.step)).astype(wide)
        return (adjoint.astype(wide) * factor).astype(adjoint.dtype)

    return stateless(apply, name)


class NoiseState(NamedTuple):
    """State of `gaussian_noise` at one boundary.

    Attributes:
      key: typed PRNG key, split on every call (the noise of a call is drawn
        from the second half of the split, the first becomes the new key).

    Example:
      >>> import jax
      >>> from eae_jax.passes import gaussian_noise
      >>> state = gaussian_noise(0.1).init(jax.ShapeDtypeStruct((2,), "float32"), jax.random.key(0))
      >>> jax.dtypes.issubdtype(state.key.dtype, jax.dtypes.prng_key)
      True
    """

    key: jax.Array


def gaussian_noise(std: ScalarOrSchedule) -> AdjointTransformation:
    """Add zero-mean Gaussian noise: ``g + std * N(0, 1)``.

    The seed's ``GaussianNoisePass``. The noise is drawn in the adjoint's
    dtype from the key in the state, which is split on every call, so a run
    is reproducible from the key given to ``Reconstructed.init`` (each
    boundary gets its own key from that one). ``std == 0`` leaves the
    adjoint and the key untouched.

    Args:
      std: Python float >= 0, or a schedule of the step
        (`eae_jax.passes.schedule`; the key is split on every call then,
        a value of 0 included).

    Returns:
      An `AdjointTransformation` with `NoiseState`.

    Raises:
      TypeError / ValueError: ``std`` negative or not a number.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import PassContext, gaussian_noise
      >>> p = gaussian_noise(1e-3)
      >>> g = jnp.ones(1000)
      >>> ctx = PassContext(boundary=jnp.int32(1), block=jnp.int32(1), step=jnp.int32(0), num_boundaries=2)
      >>> out, state = p.update(g, p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(0)), ctx)
      >>> 0.5e-3 < float(jnp.std(out - g)) < 2e-3
      True
    """
    scale = hyper("gaussian_noise", "std", std, low=0.0)
    name = f"gaussian_noise({scale.label})"

    def init(spec, key):
        require_float_spec(name, spec)
        if key is None:
            raise TypeError(f"{name}: init needs a PRNG key (jax.random.key)")
        dtype = getattr(key, "dtype", None)
        if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            # Accept raw uint32 keys (jax.random.PRNGKey) too; store a typed key.
            key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
        return NoiseState(key)

    def update(adjoint, state, ctx):
        if scale.fixed and scale.value == 0.0:
            return adjoint, state
        key, sub = jax.random.split(state.key)
        noise = jax.random.normal(sub, adjoint.shape, adjoint.dtype)
        return adjoint + scale.at(ctx.step, adjoint.dtype) * noise, NoiseState(key)

    return AdjointTransformation(init, update, name)
