"""Flax front ends of `eae_jax.reconstruct`.

* NNX (`eae_jax.flax.nnx`, re-exported here): `Reconstruct(layers, passes=...)`
  over layers stacked with ``nnx.split_rngs`` + ``nnx.vmap``, a drop-in for
  ``nnx.scan(nnx.remat(...))``; its carry lives in an `AdjointCarryVar`
  that the train step differentiates (`PARAMS_AND_CARRIES`) and writes back
  (`update_carries`).
* linen (`eae_jax.flax.linen`): `eae_jax.flax.linen.Reconstruct(block,
  length)`, a lifted module like ``nn.scan(nn.remat(block), length=...)``,
  its carry in the ``"adjoint_carry"`` collection.

State a layer updates while it runs (dropout RNG counts, batch statistics)
is carried through the stack; the backward recomputes every layer from the
state its forward started from. See docs/flax.md.
"""

from eae_jax.flax import linen
from eae_jax.flax.nnx import PARAMS_AND_CARRIES, AdjointCarryVar, Reconstruct, layer_block, update_carries

__all__ = ["AdjointCarryVar", "PARAMS_AND_CARRIES", "Reconstruct", "layer_block", "linen", "update_carries"]
