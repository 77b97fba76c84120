"""`synthetic_gradient`: a small MLP learns to predict the adjoint and may replace it."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from eae_jax.passes._util import require_float_spec, require_int, require_number, sum_f32
from eae_jax.passes.base import AdjointTransformation

_HI = jax.lax.Precision.HIGHEST  # the predictor is tiny; keep fp32 matmuls exact-ish on every backend


class SyntheticState(NamedTuple):
    """State of `synthetic_gradient` at one boundary.

    Attributes:
      params: predictor params ``{'fc1': {'w': (H, F), 'b': (H,)}, 'fc2':
        {'w': (F, H), 'b': (F,)}}`` (float32, torch ``nn.Linear`` layout:
        ``w`` is ``(out, in)``).
      opt_state: the `optax.adam` state of ``params``.
      count: int32 scalar, calls so far (the seed's ``_step``).
      loss: float32 scalar, the regression loss of the last call (computed
        before that call's Adam step, like the seed's ``last_loss``).

    Example:
      >>> import jax
      >>> from eae_jax.passes import synthetic_gradient
      >>> state = synthetic_gradient(hidden_dim=4).init(jax.ShapeDtypeStruct((2, 3), "float32"), jax.random.key(0))
      >>> state.params["fc1"]["w"].shape, int(state.count)
      ((4, 3), 0)
    """

    params: Any
    opt_state: Any
    count: jax.Array
    loss: jax.Array


def feature_dim(shape) -> int:
    """Predictor width for an adjoint of ``shape``: ``prod(shape[1:])`` (``numel`` for rank <= 1).

    Example:
      >>> from eae_jax.passes.synthetic import feature_dim
      >>> feature_dim((2, 8, 4)), feature_dim((5,)), feature_dim(())
      (32, 5, 1)
    """
    shape = tuple(shape)
    return math.prod(shape[1:]) if len(shape) > 1 else math.prod(shape)


def _flatten(x: jax.Array) -> jax.Array:
    """``(shape[0], -1)`` view of the adjoint; rank <= 1 becomes one row (the seed's layout)."""
    return x.reshape(x.shape[0], -1) if x.ndim > 1 else x.reshape(1, -1)


def init_predictor(key: jax.Array, feature_dim: int, hidden_dim: int) -> dict:
    """Predictor params with torch's default ``nn.Linear`` init.

    Each layer's weight and bias are drawn from ``U(-1/sqrt(fan_in),
    1/sqrt(fan_in))`` (what ``kaiming_uniform_(a=sqrt(5))`` reduces to),
    in float32.

    Returns:
      ``{'fc1': {'w': (hidden, feature), 'b': (hidden,)}, 'fc2': {'w':
      (feature, hidden), 'b': (feature,)}}``.

    Example:
      >>> import jax
      >>> from eae_jax.passes import init_predictor
      >>> params = init_predictor(jax.random.key(0), feature_dim=4, hidden_dim=16)
      >>> params["fc1"]["w"].shape, params["fc2"]["b"].shape, float(abs(params["fc1"]["w"]).max()) <= 0.5
      ((16, 4), (4,), True)
    """
    feature_dim = require_int("init_predictor", "feature_dim", feature_dim, low=1)
    hidden_dim = require_int("init_predictor", "hidden_dim", hidden_dim, low=1)
    k1, k2, k3, k4 = jax.random.split(key, 4)

    def uniform(k, shape, fan_in):
        bound = 1.0 / math.sqrt(fan_in)
        return jax.random.uniform(k, shape, jnp.float32, -bound, bound)

    return {
        "fc1": {"w": uniform(k1, (hidden_dim, feature_dim), feature_dim), "b": uniform(k2, (hidden_dim,), feature_dim)},
        "fc2": {"w": uniform(k3, (feature_dim, hidden_dim), hidden_dim), "b": uniform(k4, (feature_dim,), hidden_dim)},
    }


def _empty_predictor(hidden_dim: int) -> dict:
    """The predictor of a zero-width adjoint (``F == 0``): zero-size weights,
    fc1 bias 0 (torch draws a ``fan_in == 0`` bias from ``U(0, 0)``)."""
    return {
        "fc1": {"w": jnp.zeros((hidden_dim, 0), jnp.float32), "b": jnp.zeros((hidden_dim,), jnp.float32)},
        "fc2": {"w": jnp.zeros((0, hidden_dim), jnp.float32), "b": jnp.zeros((0,), jnp.float32)},
    }


def predictor_apply(params: dict, flat: jax.Array) -> jax.Array:
    """``Linear -> ReLU -> Linear`` on float32 rows ``flat: (N, feature)``; returns ``(N, feature)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.passes import predictor_apply
      >>> params = {"fc1": {"w": jnp.array([[1.0, 0.0], [0.0, -1.0]]), "b": jnp.zeros(2)},
      ...           "fc2": {"w": jnp.eye(2), "b": jnp.array([0.0, 0.5])}}
      >>> predictor_apply(params, jnp.array([[2.0, 3.0]])).tolist()    # relu([2, -3]) + [0, 0.5]
      [[2.0, 0.5]]
    """
    h = jnp.dot(flat, params["fc1"]["w"].T, precision=_HI) + params["fc1"]["b"]
    h = jax.nn.relu(h)
    return jnp.dot(h, params["fc2"]["w"].T, precision=_HI) + params["fc2"]["b"]


def _check_predictor(name: str, params: Any, feature: int, hidden: int) -> dict:
    want = {"fc1": {"w": (hidden, feature), "b": (hidden,)}, "fc2": {"w": (feature, hidden), "b": (feature,)}}
    try:
        got = {l: {p: tuple(params[l][p].shape) for p in ("w", "b")} for l in ("fc1", "fc2")}
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{name}: predictor_params must be {want} (shapes), got {params!r}") from err
    if got != want:
        raise ValueError(f"{name}: predictor_params shapes {got} do not match the adjoint's predictor {want}")
    # Copy: jnp.asarray may alias a numpy buffer on CPU (e.g. a torch weight's .numpy() view).
    return jax.tree_util.tree_map(lambda a: jnp.array(a, jnp.float32, copy=True), params)


def synthetic_gradient(hidden_dim: int = 64, lr: float = 1e-3, warmup_steps: int = 0, use_synthetic: bool = False,
                       predictor_params: Optional[dict] = None) -> AdjointTransformation:
    """Decoupled-neural-interface style synthetic adjoint (the seed's ``SyntheticGradientPass``).

    Per call: ``flat = adjoint.reshape(shape[0], -1)`` in float32 (rank <= 1:
    one row); the predictor ``Linear(F, H) -> ReLU -> Linear(H, F)`` (``F =
    prod(shape[1:])``) takes one `optax.adam` step (``lr``, torch's Adam
    defaults b1=0.9, b2=0.999, eps=1e-8) on ``mean((pred(flat) - flat)**2)``;
    the call count is incremented. If ``use_synthetic`` and ``count >
    warmup_steps`` the adjoint is replaced by the updated predictor's output
    (cast to the adjoint's dtype), else it passes unchanged.

    Each boundary has its own predictor and Adam state (the seed shares one
    predictor across all boundaries; per-boundary predictors are the DNI
    design and let scanned segments vmap them). The predictor has ``2*F*H``
    weights per boundary, so it is meant for small activations.

    An empty (size-0) adjoint is a legal adjoint: it is returned unchanged
    and the state too (no Adam step, ``count`` not advanced: the loss over
    no entries is undefined), as in every built-in pass. For ``F == 0``
    (e.g. shape ``(4, 0)``) the predictor has zero-size weights and an fc1
    bias of zeros (torch's ``nn.Linear(0, H)`` init).

    Args:
      hidden_dim: predictor width H, >= 1.
      lr: Adam learning rate, >= 0.
      warmup_steps: calls before the prediction may replace the adjoint.
      use_synthetic: replace the adjoint after warmup (else only train).
      predictor_params: optional initial predictor params (see
        `init_predictor` for the layout), used at every boundary; default:
        torch-style init from each boundary's key.

    Returns:
      An `AdjointTransformation` with `SyntheticState`.

    Raises:
      TypeError / ValueError: bad hyper-parameters, or predictor_params whose
        shapes do not fit the adjoint (raised by init).
      TypeError (at init): the adjoint spec is not a floating array spec, or
        no PRNG key is given without predictor_params.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import synthetic_gradient
      >>> p = synthetic_gradient(hidden_dim=8, lr=1e-2)
      >>> g = jnp.ones((2, 3))
      >>> state = p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(0))
      >>> for _ in range(3):
      ...     out, state = p.update(g, state, None)
      >>> bool((out == g).all()), int(state.count), float(state.loss) > 0     # trains, adjoint kept
      (True, 3, True)
    """
    name = "synthetic_gradient"
    hidden_dim = require_int(name, "hidden_dim", hidden_dim, low=1)
    lr = require_number(name, "lr", lr, low=0.0)
    warmup_steps = require_int(name, "warmup_steps", warmup_steps, low=0)
    if not isinstance(use_synthetic, bool):
        raise TypeError(f"{name}: use_synthetic must be a bool, got {use_synthetic!r}")
    opt = optax.adam(lr)

    def loss_fn(params, flat):
        # mse over the flattened errors (sum_f32): a 2-D mean loses precision on CPU
        return sum_f32(jnp.square(predictor_apply(params, flat) - flat)) / flat.size

    def init(spec, key):
        require_float_spec(name, spec)
        feature = feature_dim(spec.shape)
        if predictor_params is None:
            if key is None:
                raise TypeError(f"{name}: init needs a PRNG key to draw the predictor (or give predictor_params)")
            params = init_predictor(key, feature, hidden_dim) if feature else _empty_predictor(hidden_dim)
        else:
            params = _check_predictor(name, predictor_params, feature, hidden_dim)
        return SyntheticState(params, opt.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def update(adjoint, state, ctx):
        del ctx
        if adjoint.size == 0:  # nothing to fit (mean over no entries); static shape
            return adjoint, state
        flat = _flatten(adjoint).astype(jnp.float32)
        loss, grads = jax.value_and_grad(loss_fn)(state.params, flat)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        count = state.count + 1
        new_state = SyntheticState(params, opt_state, count, loss)
        if not use_synthetic:
            return adjoint, new_state
        synthetic = predictor_apply(params, flat).reshape(adjoint.shape).astype(adjoint.dtype)
        return jnp.where(count > warmup_steps, synthetic, adjoint), new_state

    return AdjointTransformation(init, update, name)
