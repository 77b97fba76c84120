"""SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from eae_jax.blocks.linear import init_linear, linear


def default_ffn_hidden_dim(dim: int, multiple_of: int = 256) -> int:
    """The seed's hidden-size rule: ``multiple_of * ceil(int(2*4*dim/3) / multiple_of)``.

    Example:
      >>> from eae_jax.blocks import default_ffn_hidden_dim
      >>> default_ffn_hidden_dim(4096), default_ffn_hidden_dim(64, multiple_of=32)
      (11008, 192)
    """
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def init_swiglu(key: jax.Array, dim: int, hidden_dim: int, dtype=jnp.float32) -> dict:
    """Params ``{'w_gate': (F, D), 'w_up': (F, D), 'w_down': (D, F)}``.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import init_swiglu
      >>> {name: w.shape for name, w in init_swiglu(jax.random.key(0), 8, 16).items()}
      {'w_gate': (16, 8), 'w_up': (16, 8), 'w_down': (8, 16)}
    """
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w_gate": init_linear(k1, hidden_dim, dim, dtype),
        "w_up": init_linear(k2, hidden_dim, dim, dtype),
        "w_down": init_linear(k3, dim, hidden_dim, dtype),
    }


def swiglu(params: dict, x: jax.Array) -> jax.Array:
    """SwiGLU FFN on ``x`` of shape ``(..., D)``; returns ``(..., D)``.

    The two up-projections are named ``ffn_gate`` and ``ffn_up``
    (`jax.ad_checkpoint.checkpoint_name`), so a checkpoint policy can keep them.

    Raises:
      ValueError: a weight's shape does not fit ``x``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import init_swiglu, swiglu
      >>> params = init_swiglu(jax.random.key(0), 8, 16)
      >>> swiglu(params, jnp.ones((2, 3, 8))).shape
      (2, 3, 8)
      >>> float(jnp.abs(swiglu(params, jnp.zeros((1, 8)))).max())   # silu(0) = 0
      0.0
    """
    # Named for `jax.checkpoint` policies (`save_only_these_names`): keeping
    # both spares the backward the two largest matmuls of the block.
    gate = checkpoint_name(linear(x, params["w_gate"]), "ffn_gate")
    up = checkpoint_name(linear(x, params["w_up"]), "ffn_up")
    return linear(jax.nn.silu(gate) * up, params["w_down"])
