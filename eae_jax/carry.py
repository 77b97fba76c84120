"""How pass state and statistics get out of the backward pass.

The stack of `eae_jax.reconstruct` takes one extra input, an `AdjointCarry`:
a ``replace`` handle of `eae_jax.observe` holding the pass state, the step
counter and the statistics slots. Its backward rule emits the *updated*
carry as that input's cotangent (flax's fp8 ops pass scale histories out
the same way). The caller differentiates with respect to the carry too and
calls `Reconstructed.update(carry, carry_grad)`.

The cotangent's ``calls`` token tells how many backward rules emitted it:
a stack called twice with the same carry sums to 2.0, which `decode_update`
detects (the two updated states were summed, so neither can be trusted).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from eae_jax import observe


@jax.tree_util.register_pytree_node_class
class AdjointCarry(observe.Handle):
    """Encoded pass state, step counter and statistics slots of one stack.

    Treat it as opaque: make it with `Reconstructed.init`, pass it to the
    stack, differentiate with respect to it, and read it back with
    `Reconstructed.update` / `Reconstructed.state`.

    >>> c = encode({"step": jnp.int32(0)})
    >>> isinstance(c, AdjointCarry), c.reduce
    (True, 'replace')
    """


def encode(tree: Any) -> AdjointCarry:
    """Encode a pytree of arrays (ints, floats, bools, typed keys) into a carry.

    Leaves that are one object in several places are copied, so the carry
    can be donated.

    >>> decode(encode({"n": jnp.int32(5)}))["n"]
    Array(5, dtype=int32)
    """
    return observe.handle(tree, reduce="replace", cls=AdjointCarry)


def encode_like(tree: Any, like: AdjointCarry, calls: Any = 1.0) -> AdjointCarry:
    """Encode ``tree`` with the structure and codecs of ``like`` (for cotangents).

    Raises:
      ValueError: ``tree`` does not have ``like``'s structure, or a leaf
        changed dtype or shape.

    >>> c = encode({"n": jnp.int32(5)})
    >>> decode(encode_like({"n": jnp.int32(6)}, c))["n"]
    Array(6, dtype=int32)
    """
    return observe.emit(like, tree, calls)


def decode(carry: AdjointCarry) -> Any:
    """The pytree a carry holds.

    >>> decode(encode({"x": jnp.ones(2)}))["x"]
    Array([1., 1.], dtype=float32)
    """
    return observe.value(carry)


def bad_calls_message(calls: float) -> str:
    """Why a carry gradient whose ``calls`` token is not 1 was refused.

    >>> bad_calls_message(2.0).split(";")[0]
    "eae_jax: the reconstructed stack's backward pass ran 2 times with one carry in this step"
    """
    calls = float(calls)
    kept = "The pass state was left unchanged."
    if calls == 0.0:
        return ("eae_jax: the carry gradient holds no update (the stack's backward pass did not run with this "
                "carry: differentiate with respect to the carry as well). " + kept)
    if calls > 1.0 and calls.is_integer():
        return (f"eae_jax: the reconstructed stack's backward pass ran {calls:g} times with one carry in this "
                "step; each call of the stack needs its own carry (split it, or call the stack once). " + kept)
    return (f"eae_jax: the carry gradient's call token is {calls:g}, not 1: the carry gradient was changed "
            "after differentiation (scaled, averaged or mixed with another gradient, e.g. by dividing all "
            "gradients by the number of microbatches). Pass the carry's gradient to update() as "
            "differentiation returned it. " + kept)


def _raise_on_bad_calls(calls):
    if float(calls) != 1.0:
        raise RuntimeError(bad_calls_message(calls))


def decode_update(old: AdjointCarry, grad: AdjointCarry, strict: bool = True):
    """Turn the cotangent of a carry into the next carry.

    Returns ``(new_carry, calls)``. When the backward pass did not run
    exactly once with this carry (``calls != 1``) the old carry is kept;
    with ``strict`` a host callback also raises a RuntimeError naming the
    problem (surfacing as a `JaxRuntimeError` from inside ``jit``).

    Raises:
      TypeError / ValueError: ``grad`` is not a cotangent of ``old``.

    >>> c = encode({"n": jnp.int32(5)})
    >>> new, calls = decode_update(c, encode_like({"n": jnp.int32(6)}, c))
    >>> decode(new)["n"], float(calls)
    (Array(6, dtype=int32), 1.0)
    """
    if not isinstance(grad, AdjointCarry):
        raise TypeError(f"expected the AdjointCarry cotangent, got {type(grad).__name__}")
    if grad.treedef != old.treedef:
        raise ValueError("carry gradient does not belong to this carry (structure differs)")
    calls = grad.calls
    ok = calls == 1.0
    # The encoded leaves are taken as they are: decoding and encoding again would be exact, but work.
    leaves = [jnp.where(ok, g.astype(o.dtype), o) for g, o in zip(grad.leaves, old.leaves)]
    if strict:
        jax.debug.callback(_raise_on_bad_calls, calls)
    return AdjointCarry(leaves, jnp.zeros((), jnp.float32), old.treedef, old.codecs, old.reduce), calls
