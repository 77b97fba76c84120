"""`Reconstruct`: a linen block repeated ``length`` times, run with explicit adjoint execution.

Where a linen model would write ``nn.scan(nn.remat(Block),
variable_axes={'params': 0, 'batch_stats': 0}, split_rngs={'params': True,
'dropout': True}, length=n)``, `Reconstruct(Block(...), length=n)` applies
the block ``n`` times with `eae_jax.reconstruct`. Every collection the
block creates at init is stacked over a leading axis of length ``n`` under
the name ``"layers"``.

* **Randomness**: for every name in ``rng_collections`` the module has a
  stream for, layer i draws from ``jax.random.split(self.make_rng(name),
  length)[i]``. Those keys are inputs of the stack, so the backward's
  recomputation of a layer draws the same dropout mask as its forward.
  As in any linen model, pass a fresh ``rngs={'dropout': key}`` per step.
* **Mutable collections** (batch statistics): the collections the block
  created at init and that are mutable in this ``apply`` are carried: the
  forward returns the block's updates and the module writes them back (at
  init they stay as the block's init made them, as linen's own layers
  leave them). Writing to a collection that is not mutable fails with
  linen's error, which names it; a block that creates a collection while it
  runs (``sow`` into a mutable ``"intermediates"``) is refused, named.
* **The carry** (pass state, per-boundary statistics) is the variable
  ``"carry"`` in the `CARRY_COLLECTION` collection. Differentiate with
  respect to that collection as well as ``"params"``; its gradient is its
  next value, which `update_carries` returns (the convention of linen's
  fp8 ``OVERWRITE_WITH_GRADIENT`` collection, with the carry's update
  rules of `Reconstructed.update`).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple, Union

import flax.linen as nn
import jax

from eae_jax import carry as carry_lib
from eae_jax.reconstruct import Reconstructed, Scan, Storage, reconstruct

#: The collection holding each `Reconstruct`'s carry (variable ``"carry"``).
CARRY_COLLECTION = "adjoint_carry"
#: The name of the stacked variables in every collection.
LAYERS = "layers"


def _state_of(updated: Dict[str, Any], known: Sequence[str], where: str) -> Dict[str, Any]:
    """The collections a block call updated that the stack carries (params dropped)."""
    created = sorted(c for c, v in updated.items()
                     if c not in ("params", CARRY_COLLECTION) and c not in known and jax.tree_util.tree_leaves(v))
    if created:
        raise ValueError(f"{where}: the block writes the collection(s) {created} while it runs; a reconstructed stack "
                         f"carries only collections the block creates at init ({sorted(known)}). Make them "
                         "immutable in this apply, or collect them outside the stack")
    return {c: v for c, v in updated.items() if c in known}


class Reconstruct(nn.Module):
    """``length`` copies of a linen block applied one after the other, reconstructed.

    Attributes:
      block: the linen module of one layer (a template: its variables
        live here, stacked). Called as ``block(x, *side)``; must return an
        array of ``x``'s shape and dtype.
      length: number of layers.
      passes: adjoint passes (`eae_jax.passes`; a pass, an optax
        transform or a sequence of them).
      storage: what the forward keeps for the backward
        (`eae_jax.reconstruct.GradSlots` by default).
      stats: collect per-boundary adjoint norms into the carry.
      rng_collections: RNG streams the block draws from.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class Layer(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + nn.Dropout(0.1, deterministic=False)(jnp.tanh(nn.Dense(4)(x)))
    >>> model = Reconstruct(Layer(), length=3)
    >>> x = jnp.ones((2, 4))
    >>> variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    >>> loss = lambda p, c: jnp.mean(model.apply({"params": p, CARRY_COLLECTION: c}, x,
    ...                                          rngs={"dropout": jax.random.key(2)}) ** 2)
    >>> g_p, g_c = jax.grad(loss, argnums=(0, 1))(variables["params"], variables[CARRY_COLLECTION])
    >>> carries, stats = update_carries(variables[CARRY_COLLECTION], g_c)
    >>> g_p["layers"]["Dense_0"]["kernel"].shape, stats["carry"]["adjoint_norm"].shape
    ((3, 4, 4), (4,))
    """

    block: nn.Module
    length: int
    passes: Any = None
    storage: Union[Storage, Tuple[Storage, ...], None] = None
    stats: bool = True
    rng_collections: Tuple[str, ...] = ("dropout",)

    def _template(self) -> nn.Module:
        return self.block.clone(parent=None)

    def _rngs(self) -> Dict[str, jax.Array]:
        """One key per layer for each RNG stream the block draws from."""
        return {c: jax.random.split(self.make_rng(c), self.length) for c in self.rng_collections if self.has_rng(c)}

    def _init_layers(self, template, x, side, rng) -> Dict[str, Any]:
        """Every collection of ``length`` initialisations of the block, stacked."""
        rngs = {"params": jax.random.split(rng, self.length), **self._rngs()}
        return jax.vmap(lambda r: template.init(r, x, *side))(rngs)

    @nn.compact
    def __call__(self, x: jax.Array, *side: Any) -> jax.Array:
        """Apply the ``length`` layers to ``x`` (``side``: more arguments for
        every layer, constant to the backward)."""
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"eae_jax.flax.linen.Reconstruct: length must be an int >= 1, got {self.length!r}")
        template, where = self._template(), f"eae_jax.flax.linen.Reconstruct({type(self.block).__name__})"
        if self.is_initializing() and not self.has_variable("params", LAYERS):
            # Not self.param(name, init_fn) at apply: linen evaluates init_fn there too (a shape check),
            # which would draw from the RNG streams the layers draw from.
            made = self._init_layers(template, x, side, self.make_rng("params"))
            for c, value in made.items():
                if c == "params":
                    self.param(LAYERS, lambda _, value=value: value)
                else:
                    self.variable(c, LAYERS, lambda value=value: value)
        if not self.has_variable("params", LAYERS):
            raise ValueError(f"{where}: apply with the params init made (params/{LAYERS} is missing)")
        params = self.get_variable("params", LAYERS)
        known = [c for c in self.variables if c not in ("params", CARRY_COLLECTION) and LAYERS in self.variables[c]]
        state_vars = {c: self.get_variable(c, LAYERS) for c in known}
        initializing = self.is_initializing()
        mutable = True if initializing else _block_mutable(self.scope.mutable)

        def block_fn(p, h, s=()):
            y, updated = template.apply({"params": p["params"], **p["state"]}, h, *s, rngs=p["rngs"], mutable=mutable)
            return y, ({} if initializing else _state_of(updated, known, where))

        stack = reconstruct(Scan(block_fn, type(self.block).__name__), passes=self.passes, storage=self.storage,
                            stats=self.stats, block_state=True)
        stack_params = {"params": params, "state": state_vars, "rngs": self._rngs()}
        side_arg = tuple(side) if side else None
        carry = None
        if self.has_variable(CARRY_COLLECTION, "carry") or initializing:
            carry = self.variable(CARRY_COLLECTION, "carry", lambda: stack.init(
                stack_params, x, self.make_rng("params"), side=side_arg)).value
        elif self.passes is not None:
            raise ValueError(f"{where}: the passes keep their state in the carry; apply with the "
                             f"{CARRY_COLLECTION!r} collection that init made")
        y, new_state = stack(stack_params, x, carry, side=side_arg)
        for c, value in new_state.items():
            self.put_variable(c, LAYERS, value)
        return y


def _block_mutable(outer: Any) -> Any:
    """What the block may mutate: what this ``apply`` may (a ``mutable=``
    filter: a bool, a name, a list of names or a ``DenyList``), the carry's
    collection and the stacked params left out where names are listed."""
    if outer is False or outer is None:
        return []
    if isinstance(outer, str):
        outer = [outer]
    if isinstance(outer, (list, tuple)):
        return [c for c in outer if c not in ("params", CARRY_COLLECTION)]
    return outer  # True or a DenyList: the params the block returns are dropped (`_state_of`)


def update_carries(carries: Any, grads: Any, *, strict: bool = True) -> Tuple[Any, Any]:
    """Fold the gradient of every carry in ``carries`` (a `CARRY_COLLECTION`
    collection, or any tree of `AdjointCarry`) into the next carries.

    Returns:
      ``(new carries, stats)``: the same tree with each carry updated
      (`Reconstructed.update`), and one with each carry's statistics in
      its place.

    Raises:
      ValueError: ``grads`` has another structure than ``carries``.

    >>> import jax.numpy as jnp
    >>> from eae_jax import carry
    >>> old = {"carry": carry.encode({"step": jnp.int32(0), "stats": {}})}
    >>> grad = {"carry": carry.encode_like({"step": jnp.int32(0), "stats": {}}, old["carry"])}
    >>> new, stats = update_carries(old, grad)
    >>> int(carry.decode(new["carry"])["step"]), float(stats["carry"]["calls"])
    (1, 1.0)
    """
    is_carry = lambda node: isinstance(node, carry_lib.AdjointCarry)  # noqa: E731
    olds, treedef = jax.tree_util.tree_flatten(carries, is_leaf=is_carry)
    try:
        gs = treedef.flatten_up_to(grads)
    except (ValueError, TypeError) as err:
        raise ValueError(f"update_carries: the gradients do not have the carries' structure: {err}") from None
    out = [Reconstructed.update(c, g, strict=strict) if is_carry(c) else (c, None) for c, g in zip(olds, gs)]
    return treedef.unflatten([o[0] for o in out]), treedef.unflatten([o[1] for o in out])
