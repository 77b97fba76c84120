"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

The distribution `sampling_probs` describes is what `sample_tokens` draws
from, in this order (the order of Hugging Face's ``generate``):

1. divide the logits by ``temperature`` (0 means greedy: the argmax);
2. top-k: keep the ``k`` highest logits (ties go to the lower id, so exactly
   ``k`` ids are kept and ``top_k=1`` is greedy);
3. top-p: renormalise, sort the probabilities in decreasing order (ties: lower
   id first) and keep the shortest prefix whose mass is ``>= top_p``;
4. renormalise and draw with an explicit PRNG key.

Every function is pure and works on ``(..., V)`` logits.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (hashable: a static argument of the jitted decode step).

    Attributes:
      temperature: 0 for greedy decoding (argmax, ties to the lowest id);
        otherwise the logits are divided by it.
      top_k: keep only the ``top_k`` most likely ids (None: all).
      top_p: keep the smallest most-likely set with probability mass
        ``>= top_p`` (None or 1.0: all).

    Example:
      >>> from eae_jax.models.sampling import Sampling
      >>> Sampling(temperature=0.8, top_k=40).greedy, Sampling(temperature=0).greedy
      (False, True)
      >>> Sampling(top_p=0.0)
      Traceback (most recent call last):
      ...
      ValueError: top_p must be a number in (0, 1], got 0.0
    """

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        object.__setattr__(self, "temperature", float(t))
        k = self.top_k
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
                raise ValueError(f"top_k must be an int >= 1 (or None: no top-k), got {k!r}")
            object.__setattr__(self, "top_k", int(k))
        p = self.top_p
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0.0 < p <= 1.0):
                raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
            object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        """Whether this picks the argmax (temperature 0)."""
        return self.temperature == 0.0


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
    """Boolean mask of the ``k`` highest entries along the last axis.

    Ties at the boundary go to the lower index (`jax.lax.top_k`'s order), so
    exactly ``min(k, V)`` entries are kept.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.models.sampling import top_k_mask
      >>> top_k_mask(jnp.array([1.0, 3.0, 3.0, 2.0]), 2).tolist()
      [False, True, True, False]
      >>> top_k_mask(jnp.array([5.0, 1.0, 5.0, 5.0]), 2).tolist()     # a tie: the lower ids win
      [True, False, True, False]
    """
    vocab = logits.shape[-1]
    k = min(int(k), vocab)
    _, idx = jax.lax.top_k(logits, k)
    return jnp.any(idx[..., :, None] == jnp.arange(vocab, dtype=idx.dtype), axis=-2)


def top_p_mask(probs: jax.Array, p: float) -> jax.Array:
    """Boolean mask of the smallest most-likely set whose probability mass is ``>= p``.

    Probabilities are sorted in decreasing order (ties: lower index first); an
    entry is kept when the mass strictly before it is ``< p``. So a prefix
    reaching exactly ``p`` ends the set, and the most likely entry is always kept.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.models.sampling import top_p_mask
      >>> probs = jnp.array([0.125, 0.5, 0.125, 0.25])
      >>> top_p_mask(probs, 0.75).tolist()           # 0.5 + 0.25 reaches 0.75 exactly
      [False, True, False, True]
      >>> top_p_mask(probs, 0.76).tolist()           # one more: the lower id of the tied pair
      [True, True, False, True]
    """
    order = jnp.argsort(-probs, axis=-1, stable=True)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    # An exclusive cumsum by shifting, not by subtraction: the mass before entry i is a true prefix sum.
    before = jnp.concatenate([jnp.zeros_like(sorted_probs[..., :1]), jnp.cumsum(sorted_probs, axis=-1)[..., :-1]],
                             axis=-1)
    keep_sorted = before < p
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep_sorted, inverse, axis=-1)


def filtered_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Float32 logits divided by the temperature, ``-inf`` outside the top-k / top-p set.

    Not for greedy settings (temperature 0): there the choice is the argmax.

    Raises:
      ValueError: ``sampling.greedy``.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.models.sampling import Sampling, filtered_logits
      >>> filtered_logits(jnp.array([0.0, 2.0, 1.0]), Sampling(temperature=2.0, top_k=2)).tolist()
      [-inf, 1.0, 0.5]
    """
    if sampling.greedy:
        raise ValueError("greedy sampling (temperature 0) has no filtered distribution; take the argmax")
    scaled = logits.astype(jnp.float32) / jnp.float32(sampling.temperature)
    keep = jnp.ones(scaled.shape, bool)
    if sampling.top_k is not None and sampling.top_k < scaled.shape[-1]:
        keep = top_k_mask(scaled, sampling.top_k)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
        keep = keep & top_p_mask(probs, sampling.top_p)
    return jnp.where(keep, scaled, -jnp.inf)


def sampling_probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The float32 distribution `sample_tokens` draws from (one-hot at the argmax when greedy).

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.models.sampling import Sampling, sampling_probs
      >>> logits = jnp.log(jnp.array([0.1, 0.6, 0.3]))
      >>> [round(p, 4) for p in sampling_probs(logits, Sampling(top_k=2)).tolist()]
      [0.0, 0.6667, 0.3333]
      >>> sampling_probs(logits, Sampling(temperature=0)).tolist()
      [0.0, 1.0, 0.0]
    """
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(filtered_logits(logits, sampling), axis=-1)


def sample_tokens(key: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Draw int32 ids ``(...)`` from logits ``(..., V)``; greedy needs no randomness.

    Args:
      key: a PRNG key (ignored when greedy); the same key gives the same ids.
      logits: ``(..., V)``.
      sampling: the settings.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.models.sampling import Sampling, sample_tokens
      >>> logits = jnp.array([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]])
      >>> sample_tokens(jax.random.key(0), logits, Sampling(temperature=0)).tolist()
      [1, 0]
      >>> sample_tokens(jax.random.key(0), logits, Sampling(top_k=1)).tolist()    # top-k 1 is greedy too
      [1, 0]
    """
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, sampling), axis=-1).astype(jnp.int32)
