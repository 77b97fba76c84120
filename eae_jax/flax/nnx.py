"""`Reconstruct`: a stack of Flax NNX layers run with explicit adjoint execution.

Where a model would apply its stacked layers with
``nnx.scan(nnx.remat(lambda layer, x: layer(x)))``, `Reconstruct(layers)`
applies them with `eae_jax.reconstruct`: the forward keeps only the
boundaries between layers, the backward re-runs each layer from its input
and runs the adjoint passes between layers.

State a layer updates while it runs (a dropout layer's RNG count, batch
statistics, caches: any variable that is not an ``nnx.Param``) is carried:
the forward returns it and the module writes it back, and the backward's
recomputation of a layer starts from the state its forward started from,
so it draws the same dropout mask. A layer that creates variables while it
runs (``sow``, lazily built caches) or updates an ``nnx.Param`` is refused
when the stack is traced, the error naming the variables.

The `AdjointCarry` (pass state and per-boundary statistics) lives in an
`AdjointCarryVar`. As with flax's fp8 variables (linen's
``OVERWRITE_WITH_GRADIENT`` collection), the gradient step differentiates
it together with the params, and its gradient *is* its next value:
`update_carries` writes it back, next to ``optimizer.update``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import jax
from flax import nnx

from eae_jax.reconstruct import Reconstructed, Scan, Storage, reconstruct
from eae_jax.reconstruct.state import as_prng_key


class AdjointCarryVar(nnx.Variable):
    """The variable holding a `Reconstruct`'s `AdjointCarry`.

    Differentiate it with the params (`PARAMS_AND_CARRIES`); its gradient
    is the updated carry, which `update_carries` writes back. The
    optimizer never sees it (``nnx.Optimizer(..., wrt=nnx.Param)``).

    >>> import jax.numpy as jnp
    >>> from eae_jax import carry
    >>> AdjointCarryVar(carry.encode({"step": jnp.int32(0)})).get_value().reduce
    'replace'
    """


#: What the train step differentiates: the params and every `AdjointCarryVar`
#: (``nnx.grad(loss, argnums=nnx.DiffState(0, PARAMS_AND_CARRIES))``).
PARAMS_AND_CARRIES = nnx.Any(nnx.Param, AdjointCarryVar)


def _value(var: nnx.Variable) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var.value


def _set_value(var: nnx.Variable, value: Any) -> None:
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:  # flax < 0.12
        var.value = value


def _data(value: Any) -> Any:
    mark = getattr(nnx, "data", None)  # flax >= 0.12 tells data from static attributes
    return value if mark is None else mark(value)


def _flat(state) -> Dict[Tuple, Any]:
    """``{path: Variable}`` of an ``nnx.State``."""
    return dict(nnx.to_flat_state(state))


def _describe(path, var) -> str:
    return f"{'/'.join(str(p) for p in path)} ({type(var).__name__})"


def _leaves(var) -> list:
    return jax.tree_util.tree_leaves(_value(var))


def layer_block(graphdef: nnx.GraphDef) -> Callable[..., Tuple[jax.Array, nnx.State]]:
    """The pure block of one layer of ``graphdef``, for ``reconstruct(...,
    block_state=True)``: ``block(state, x, side=()) -> (y, new_state)``,
    the layer called as ``layer(x, *side)``.

    ``state`` is the layer's whole ``nnx.State``; ``new_state`` holds every
    variable that is not an ``nnx.Param``, as the call left it.

    Raises (when traced):
      ValueError: the call creates variables, or updates an ``nnx.Param``;
        the message names them.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> graphdef, state = nnx.split(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
    >>> y, new = layer_block(graphdef)(state, jnp.array([[0.0, 1.0], [2.0, 3.0]]))
    >>> new["mean"].get_value()                      # 0.99 * 0 + 0.01 * the batch mean
    Array([0.01, 0.02], dtype=float32)
    """

    def block(state, x, side=()):
        # the arrays before the call (merge may share its Variable objects with ``state``)
        before = {path: _leaves(var) for path, var in _flat(state).items()}
        layer = nnx.merge(graphdef, state)
        y = layer(x, *side)
        after_def, after = nnx.split(layer)
        after_vars = _flat(after)
        created = [_describe(p, v) for p, v in after_vars.items() if p not in before]
        if created or after_def != graphdef:
            raise ValueError(
                "eae_jax.flax.Reconstruct: the layer changes its structure while it runs"
                + (f": it creates {', '.join(created)}" if created else " (a static attribute or submodule changed)")
                + ". A reconstructed stack carries updates of the variables a layer holds before the call; "
                "create them in __init__ (or collect intermediates outside the stack)")
        updated = [_describe(p, v) for p, v in after_vars.items()
                   if isinstance(v, nnx.Param) and any(a is not b for a, b in zip(_leaves(v), before[p]))]
        if updated:
            raise ValueError(f"eae_jax.flax.Reconstruct: the layer updates {', '.join(updated)} while it runs; a "
                             "reconstructed stack differentiates params and cannot update them")
        return y, nnx.state(layer, nnx.Not(nnx.Param))

    return block


@dataclasses.dataclass(frozen=True)
class _Options:
    """The stack's settings (static: part of the module's graph definition)."""

    passes: Any
    storage: Union[Storage, Tuple[Storage, ...], None]
    stats: bool
    name: str

    def stack(self, graphdef) -> Reconstructed:
        return reconstruct(Scan(layer_block(graphdef), self.name), passes=self.passes, storage=self.storage,
                           stats=self.stats, block_state=True)


class Reconstruct(nnx.Module):
    """Stacked NNX layers applied one after the other, with explicit adjoint execution.

    A drop-in for ``nnx.scan(nnx.remat(lambda layer, x: layer(x)))`` over
    layers made with ``nnx.split_rngs`` + ``nnx.vmap`` (every variable with
    a leading depth axis). Each layer is called as ``layer(x, *side)`` and
    must return an array of ``x``'s shape and dtype.

    Args:
      layers: the stacked layers (an ``nnx.Module``).
      passes: adjoint passes run at every boundary (`eae_jax.passes`; a
        pass, an optax transform or a sequence of them).
      storage: what the forward keeps for the backward
        (`eae_jax.reconstruct.GradSlots` by default; ``OnDevice``,
        ``Policy``, ``Host`` ...).
      stats: collect per-boundary adjoint norms into the carry.
      input_spec: an example input (array or ``jax.ShapeDtypeStruct``):
        makes the carry now. Without it the module runs without a carry
        until `init_carry` is called, which passes need.
      key: PRNG key (or int seed) for the passes' initial state.

    Train step: differentiate with respect to `PARAMS_AND_CARRIES`, let
    the optimizer update the params and `update_carries` the carry.

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from eae_jax import passes as P
    >>> class Layer(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.linear = nnx.Linear(4, 4, rngs=rngs)
    ...         self.dropout = nnx.Dropout(0.1, rngs=rngs)
    ...     def __call__(self, x):
    ...         return x + self.dropout(jnp.tanh(self.linear(x)))
    >>> @nnx.split_rngs(splits=3)
    ... @nnx.vmap(in_axes=(0,), out_axes=0)
    ... def make_layers(rngs):
    ...     return Layer(rngs)
    >>> x = jnp.ones((2, 4))
    >>> model = Reconstruct(make_layers(nnx.Rngs(0, dropout=1)), passes=P.clip_by_norm(1.0), input_spec=x)
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> @nnx.jit
    ... def step(model, optimizer, x):
    ...     loss = lambda m: jnp.mean(m(x) ** 2)
    ...     grads = nnx.grad(loss, argnums=nnx.DiffState(0, PARAMS_AND_CARRIES))(model)
    ...     optimizer.update(model, grads)
    ...     return update_carries(model, grads)
    >>> stats = step(model, optimizer, x)
    >>> stats[()]["adjoint_norm"].shape, model.layers.dropout.rngs.count.get_value().tolist()
    ((4,), [1, 1, 1])
    """

    def __init__(self, layers: nnx.Module, *, passes: Any = None,
                 storage: Union[Storage, Sequence[Storage], None] = None, stats: bool = True,
                 input_spec: Any = None, key: Any = None):
        if not isinstance(layers, nnx.Module):
            raise TypeError(f"Reconstruct: layers must be an nnx.Module (stacked with nnx.vmap), got "
                            f"{type(layers).__name__}")
        # sequences as tuples: the options are static, hashed into the module's graph definition
        storage = tuple(storage) if isinstance(storage, list) else storage
        passes = tuple(passes) if isinstance(passes, list) else passes
        # reconstruct checks passes and storage now, not at the first call
        reconstruct(lambda p, x: x, passes=passes, storage=storage)
        self.layers = layers
        self.options = _Options(passes, storage, bool(stats), type(layers).__name__)
        # a data attribute (nnx.data) even while None: init_carry puts the variable there
        self.carry: Optional[AdjointCarryVar] = _data(None)
        if input_spec is not None:
            self.init_carry(input_spec, key)

    def stack(self) -> Reconstructed:
        """The `eae_jax.reconstruct` stack over the layers as they are now.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> layers = nnx.vmap(lambda r: nnx.Linear(2, 2, rngs=r), in_axes=0)(nnx.Rngs(0).fork(split=3))
        >>> [s.kind for s in Reconstruct(layers).stack().storages(nnx.state(layers), jnp.ones((1, 2)))]
        ['grad_slots']
        """
        return self.options.stack(nnx.graphdef(self.layers))

    def init_carry(self, x: Any, key: Any = None) -> None:
        """Make (or remake) the carry for inputs shaped like ``x``.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> layers = nnx.vmap(lambda r: nnx.Linear(2, 2, rngs=r), in_axes=0)(nnx.Rngs(0).fork(split=3))
        >>> model = Reconstruct(layers)
        >>> model.carry is None, model.init_carry(jnp.ones((1, 2))), type(model.carry).__name__
        (True, None, 'AdjointCarryVar')
        """
        spec = jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
        carry = self.stack().init(nnx.state(self.layers), spec, as_prng_key(key))
        self.carry = AdjointCarryVar(carry)

    def __call__(self, x: jax.Array, *side: Any) -> jax.Array:
        """Apply the layers to ``x`` (``side``: more arguments for every layer,
        constant to the backward, such as masks or positions)."""
        stack = self.stack()
        if self.carry is None and self.options.passes is not None:
            raise ValueError("eae_jax.flax.Reconstruct: the passes keep their state in the carry; give "
                             "input_spec= (an example input) or call init_carry(x) before the first call")
        carry = None if self.carry is None else _value(self.carry)
        y, new_state = stack(nnx.state(self.layers), x, carry, side=tuple(side) if side else None)
        nnx.update(self.layers, new_state)
        return y


def _grad_at(grads: Any, path: Tuple) -> Any:
    node = grads
    for part in path:
        try:
            node = node[part]
        except (KeyError, TypeError, IndexError):
            node = None
            break
    if not isinstance(node, AdjointCarryVar):
        where = "/".join(str(p) for p in path)
        raise ValueError(f"update_carries: the gradients hold no carry gradient at {where!r}; differentiate "
                         "with nnx.DiffState(0, eae_jax.flax.PARAMS_AND_CARRIES) so the carries get one")
    return _value(node)


def update_carries(model: nnx.Module, grads: Any, *, strict: bool = True) -> Dict[Tuple, Dict[str, jax.Array]]:
    """Write every `Reconstruct` carry of ``model`` back from its gradient.

    ``grads`` is what ``nnx.grad`` returned with `PARAMS_AND_CARRIES`.
    Each carry's gradient is its updated value (`Reconstructed.update`).

    Returns:
      ``{module path: stats}``, the statistics of each carry
      (``adjoint_norm``, ``adjoint_norm_after_passes``, ``step``, ``calls``).

    Raises:
      ValueError: ``model`` has no `Reconstruct` with a carry, or ``grads``
        lacks a carry's gradient.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> layers = nnx.vmap(lambda r: nnx.Linear(2, 2, rngs=r), in_axes=0)(nnx.Rngs(0).fork(split=3))
    >>> model = Reconstruct(layers, input_spec=jnp.ones((1, 2)))
    >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum(), argnums=nnx.DiffState(0, PARAMS_AND_CARRIES))(model)
    >>> stats = update_carries(model, grads)[()]
    >>> from eae_jax.carry import decode
    >>> int(stats["calls"]), stats["adjoint_norm"].shape, int(decode(model.carry.get_value())["step"])
    (1, (4,), 1)
    """
    out = {}
    modules = nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()  # flax < 0.12
    for path, module in modules:
        if isinstance(module, Reconstruct) and module.carry is not None:
            new, stats = Reconstructed.update(_value(module.carry), _grad_at(grads, tuple(path) + ("carry",)),
                                              strict=strict)
            _set_value(module.carry, new)
            out[tuple(path)] = stats
    if not out:
        raise ValueError("update_carries: the model has no eae_jax.flax.Reconstruct with a carry (give "
                         "input_spec= or call init_carry)")
    return out
