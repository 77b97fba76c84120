"""How pass state and statistics get out of the backward pass.

The backward pass of `eae_jax.reconstruct` is a `jax.custom_vjp` rule; the
only values it can hand back are cotangents of the primal inputs. So the
stack takes one extra input, an `AdjointCarry`, and its backward rule
returns the *updated* carry as that input's cotangent (flax's fp8 ops pass
scale histories out the same way). The caller differentiates with respect
to the carry too and calls `Reconstructed.update(carry, carry_grad)`.

Cotangents must be floating, so every leaf is stored encoded: floating leaves
as they are; integers, bools and typed PRNG keys (their key data) as two
float32 values per 32-bit word, its high and low 16 bits. Those are small
whole numbers, exact in float32 and far from the subnormal range, so they
survive what JAX and XLA may do to a cotangent on its way out (adding a zero,
flushing subnormals, averaging identical replicas); a plain bit-cast would
not (``bitcast(int32 5)`` is a subnormal that XLA flushes to 0 in
arithmetic). Decoding rounds, so it is exact. The codec is static (part of
the pytree structure).

``calls`` is a float32 token: every backward rule that runs writes 1.0 into
its cotangent. A stack called twice with the same carry sums to 2.0, which
`decode_update` detects (the two updated states were summed, so neither can
be trusted).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class LeafCodec(NamedTuple):
    """Static description of how one leaf is stored."""

    kind: str  # 'float' | 'bits32' | 'widen' | 'key'
    dtype: str  # original dtype name (or key impl for 'key')


def _codec_for(leaf: Any) -> LeafCodec:
    dtype = leaf.dtype
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return LeafCodec("key", str(jax.random.key_impl(leaf)))
    if jnp.issubdtype(dtype, jnp.floating):
        return LeafCodec("float", jnp.dtype(dtype).name)
    if jnp.dtype(dtype).itemsize == 4:
        return LeafCodec("bits32", jnp.dtype(dtype).name)
    if jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
        if jnp.dtype(dtype).itemsize > 4:
            raise TypeError(f"carry leaf of dtype {dtype} is wider than 32 bits; use int32")
        return LeafCodec("widen", jnp.dtype(dtype).name)
    raise TypeError(f"cannot carry a state leaf of dtype {dtype}")


def _words_to_halves(words: jax.Array) -> jax.Array:
    """uint32 ``(...)`` -> float32 ``(2, ...)``: high and low 16 bits as whole numbers."""
    hi = (words >> 16).astype(jnp.float32)
    lo = (words & 0xFFFF).astype(jnp.float32)
    return jnp.stack([hi, lo])


def _halves_to_words(halves: jax.Array) -> jax.Array:
    """Inverse of `_words_to_halves` (rounding first, so small drift is undone)."""
    hi = jnp.clip(jnp.round(halves[0]), 0, 0xFFFF).astype(jnp.uint32)
    lo = jnp.clip(jnp.round(halves[1]), 0, 0xFFFF).astype(jnp.uint32)
    return (hi << 16) | lo


def _encode_leaf(leaf: jax.Array, codec: LeafCodec) -> jax.Array:
    if codec.kind == "float":
        return leaf
    if codec.kind == "key":
        words = jax.random.key_data(leaf)
    else:
        words = jax.lax.bitcast_convert_type(leaf.astype(jnp.int32) if codec.kind == "widen" else leaf, jnp.uint32)
    return _words_to_halves(words.astype(jnp.uint32))


def _decode_leaf(leaf: jax.Array, codec: LeafCodec) -> jax.Array:
    if codec.kind == "float":
        return leaf
    words = _halves_to_words(leaf)
    if codec.kind == "key":
        return jax.random.wrap_key_data(words, impl=codec.dtype)
    if codec.kind == "widen":
        return jax.lax.bitcast_convert_type(words, jnp.int32).astype(codec.dtype)
    return jax.lax.bitcast_convert_type(words, jnp.dtype(codec.dtype))


@jax.tree_util.register_pytree_node_class
class AdjointCarry:
    """Encoded pass state, step counter and statistics slots of one stack.

    Treat it as opaque: make it with `Reconstructed.init`, pass it to the
    stack, differentiate with respect to it, and read it back with
    `Reconstructed.update` / `Reconstructed.state`.
    """

    def __init__(self, leaves, calls, treedef, codecs):
        self.leaves = tuple(leaves)
        self.calls = calls
        self.treedef = treedef
        self.codecs = tuple(codecs)

    def tree_flatten(self):
        return (self.leaves, self.calls), (self.treedef, self.codecs)

    @classmethod
    def tree_unflatten(cls, aux, children):
        leaves, calls = children
        return cls(leaves, calls, *aux)

    def __repr__(self):
        return f"AdjointCarry({len(self.leaves)} leaves, calls={self.calls})"


def encode(tree: Any) -> AdjointCarry:
    """Encode a pytree of arrays (ints, floats, bools, typed keys) into a carry."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, codecs = [], []
    for path, x in with_path:
        try:
            x = jnp.asarray(x)
            codecs.append(_codec_for(x))
        except TypeError as err:
            raise TypeError(f"cannot carry the state leaf {jax.tree_util.keystr(path)}: {err}") from err
        leaves.append(x)
    return AdjointCarry([_encode_leaf(x, c) for x, c in zip(leaves, codecs)], jnp.zeros((), jnp.float32), treedef, codecs)


def encode_like(tree: Any, like: AdjointCarry, calls: Any = 1.0) -> AdjointCarry:
    """Encode ``tree`` with the structure and codecs of ``like`` (for cotangents).

    Raises:
      ValueError: ``tree`` does not have ``like``'s structure.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    hint = ("the carry does not fit this stack call: make it with this stack's init() from params and x "
            "of the shapes the stack is called with")
    if treedef != like.treedef:
        raise ValueError(f"carry structure changed ({hint}): {treedef} vs {like.treedef}")
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    encoded = []
    for x, c, ref, path in zip(leaves, like.codecs, like.leaves, paths):
        x = jnp.asarray(x)
        now = _codec_for(x)
        if now.kind != c.kind or (c.kind != "float" and now.dtype != c.dtype):
            # Stored as raw bits, a leaf of another dtype would be reinterpreted (1.0f read as 1065353216).
            raise ValueError(f"pass state leaf {path} changed dtype from {c.dtype} to {x.dtype}: a pass's update "
                             "must return its state in the dtypes its init made")
        e = _encode_leaf(x, c)
        if e.shape != ref.shape:
            raise ValueError(f"carry leaf shape changed from {ref.shape} to {e.shape} ({hint})")
        encoded.append(e.astype(ref.dtype))
    return AdjointCarry(encoded, jnp.asarray(calls, jnp.float32), like.treedef, like.codecs)


def decode(carry: AdjointCarry) -> Any:
    """The pytree a carry holds."""
    return jax.tree_util.tree_unflatten(
        carry.treedef, [_decode_leaf(x, c) for x, c in zip(carry.leaves, carry.codecs)]
    )


def _raise_on_bad_calls(calls):
    calls = float(calls)
    if calls != 1.0:
        raise RuntimeError(
            f"eae_jax: the reconstructed stack's backward pass ran {calls:g} times with one carry in this step; "
            "each call of the stack needs its own carry (split it, or call the stack once). The pass state "
            "was left unchanged."
            if calls > 1 else
            "eae_jax: the carry gradient holds no update (the stack's backward pass did not run with this "
            "carry: differentiate with respect to the carry as well). The pass state was left unchanged."
        )


def decode_update(old: AdjointCarry, grad: AdjointCarry, strict: bool = True):
    """Turn the cotangent of a carry into the next carry.

    Returns ``(new_carry, calls)``. When the backward pass did not run
    exactly once with this carry (``calls != 1``) the old carry is kept;
    with ``strict`` a host callback also raises a RuntimeError naming the
    problem (surfacing as a `JaxRuntimeError` from inside ``jit``).
    """
    if not isinstance(grad, AdjointCarry):
        raise TypeError(f"expected the AdjointCarry cotangent, got {type(grad).__name__}")
    if grad.treedef != old.treedef:
        raise ValueError("carry gradient does not belong to this carry (structure differs)")
    calls = grad.calls
    ok = calls == 1.0
    leaves = [jnp.where(ok, g.astype(o.dtype), o) for g, o in zip(grad.leaves, old.leaves)]
    if strict:
        jax.debug.callback(_raise_on_bad_calls, calls)
    return AdjointCarry(leaves, jnp.zeros((), jnp.float32), old.treedef, old.codecs), calls
