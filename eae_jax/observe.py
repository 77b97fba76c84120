"""`observe`: the one channel for what a backward pass learns.

A `jax.custom_vjp` rule can hand values back only as cotangents of its
primal inputs. Everything the library learns in a backward pass leaves it
that way: the adjoint carry's updated pass state, fp8 fallback counts, the
amax of gradients and of weights. Each kind goes through a `Handle`, an
extra input the caller differentiates with respect to; its cotangent holds
the observation, and `receive` reads it back::

    h = handle({"amax": jnp.zeros(())}, reduce="max")
    def loss(w, h):
        y = observe(x @ w, h, {"amax": jnp.max(jnp.abs(x))})
        return jnp.sum(y)
    g_w, g_h = jax.grad(loss, argnums=(0, 1))(w, h)
    seen, calls = receive(h, g_h)    # seen["amax"] == max|x|, calls == 1

How uses of one handle combine. Autodiff *sums* the cotangents of an input
used several times, and that is the one accumulation rule there is:

* ``reduce="sum"`` (counts): the sum over uses is the exact total.
* ``reduce="max"`` (amax): exact for one use per handle (per-layer handles
  stacked on a leading axis and scanned are one use each); ``k`` uses give
  the sum of their maxima, an upper bound (at most ``k`` times the max, so
  scales derived from it stay conservative). Observations differentiated
  separately (microbatches) combine exactly with `combine`.
* ``reduce="replace"`` (state): the cotangent *is* the next value; it is
  valid only when exactly one use emitted it.

Every cotangent carries ``calls``, a float32 token to which each use adds
1.0, so `receive` knows how many uses contributed (and a replace handle
used twice, or a cotangent scaled by user arithmetic, is detected).
Observations of ``sum`` and ``max`` handles are recorded only where finite
(a non-finite one counts as 0, "nothing observed"), so one NaN cannot
poison a running total.

Cotangents must be floating, so non-float leaves (ints, bools, typed PRNG
keys) are encoded as two float32 values per 32-bit word, its high and low
16 bits: small whole numbers, exact in float32 and far from the subnormal
range, so they survive what JAX and XLA may do to a cotangent on its way
out (adding a zero, flushing subnormals, averaging identical replicas),
where a plain bit-cast would not. Decoding rounds, so it is exact.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Tuple

import jax
import jax.numpy as jnp

from eae_jax.buffers import unalias

#: How the uses of one handle combine (see the module docstring).
REDUCES = ("sum", "max", "replace")


class LeafCodec(NamedTuple):
    """Static description of how one leaf is stored.

    Attributes:
      kind: ``'float'`` (as is), ``'bits32'`` (a 32-bit word), ``'widen'``
        (an int/bool narrower than 32 bits, widened to int32) or ``'key'``
        (a typed PRNG key's data).
      dtype: the original dtype name (for ``'key'``: the key implementation).

    >>> LeafCodec("float", "bfloat16").kind
    'float'
    """

    kind: str
    dtype: str


def codec_for(leaf: Any) -> LeafCodec:
    """The `LeafCodec` of an array (raises TypeError for unsupported dtypes).

    >>> codec_for(jnp.zeros(3, jnp.int8))
    LeafCodec(kind='widen', dtype='int8')
    """
    dtype = leaf.dtype
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return LeafCodec("key", str(jax.random.key_impl(leaf)))
    if jnp.issubdtype(dtype, jnp.floating):
        return LeafCodec("float", jnp.dtype(dtype).name)
    if jnp.dtype(dtype).itemsize == 4:
        return LeafCodec("bits32", jnp.dtype(dtype).name)
    if jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
        if jnp.dtype(dtype).itemsize > 4:
            raise TypeError(f"a leaf of dtype {dtype} is wider than 32 bits; use int32")
        return LeafCodec("widen", jnp.dtype(dtype).name)
    raise TypeError(f"cannot carry a leaf of dtype {dtype}")


def _words_to_halves(words: jax.Array) -> jax.Array:
    """uint32 ``(...)`` -> float32 ``(2, ...)``: high and low 16 bits as whole numbers."""
    return jnp.stack([(words >> 16).astype(jnp.float32), (words & 0xFFFF).astype(jnp.float32)])


def _halves_to_words(halves: jax.Array) -> jax.Array:
    """Inverse of `_words_to_halves` (rounding first, so small drift is undone)."""
    hi = jnp.clip(jnp.round(halves[0]), 0, 0xFFFF).astype(jnp.uint32)
    lo = jnp.clip(jnp.round(halves[1]), 0, 0xFFFF).astype(jnp.uint32)
    return (hi << 16) | lo


def encode_leaf(leaf: jax.Array, codec: LeafCodec) -> jax.Array:
    """``leaf`` as a floating array (see the module docstring).

    >>> encode_leaf(jnp.int32(65537), LeafCodec("bits32", "int32"))
    Array([1., 1.], dtype=float32)
    """
    if codec.kind == "float":
        return leaf
    if codec.kind == "key":
        words = jax.random.key_data(leaf)
    else:
        words = jax.lax.bitcast_convert_type(leaf.astype(jnp.int32) if codec.kind == "widen" else leaf, jnp.uint32)
    return _words_to_halves(words.astype(jnp.uint32))


def decode_leaf(leaf: jax.Array, codec: LeafCodec) -> jax.Array:
    """Inverse of `encode_leaf` (exact).

    >>> decode_leaf(jnp.array([1.0, 1.0]), LeafCodec("bits32", "int32"))
    Array(65537, dtype=int32)
    """
    if codec.kind == "float":
        return leaf
    words = _halves_to_words(leaf)
    if codec.kind == "key":
        return jax.random.wrap_key_data(words, impl=codec.dtype)
    if codec.kind == "widen":
        return jax.lax.bitcast_convert_type(words, jnp.int32).astype(codec.dtype)
    return jax.lax.bitcast_convert_type(words, jnp.dtype(codec.dtype))


@jax.tree_util.register_pytree_node_class
class Handle:
    """Where the observations of one kind land (encoded leaves + a ``calls`` token).

    Treat it as opaque: make it with `handle`, pass it into the function
    being differentiated, differentiate with respect to it, and read the
    cotangent with `receive`. The cotangent is itself a `Handle` of the
    same structure. Handles stack (``jax.tree.map(jnp.stack, ...)``) and
    ``vmap``: per-layer handles scanned over depth are one use each.

    >>> h = handle({"n": jnp.zeros(())}, reduce="sum")
    >>> h.reduce, float(h.calls)
    ('sum', 0.0)
    """

    def __init__(self, leaves, calls, treedef, codecs, reduce):
        self.leaves = tuple(leaves)
        self.calls = calls
        self.treedef = treedef
        self.codecs = tuple(codecs)
        self.reduce = reduce

    def tree_flatten(self):
        return (self.leaves, self.calls), (self.treedef, self.codecs, self.reduce)

    @classmethod
    def tree_unflatten(cls, aux, children):
        leaves, calls = children
        return cls(leaves, calls, *aux)

    def __repr__(self):
        return f"{type(self).__name__}({len(self.leaves)} leaves, reduce={self.reduce!r}, calls={self.calls})"


def _flatten_checked(tree: Any) -> Tuple[list, Any, list]:
    """Leaves (as arrays), treedef and codecs of ``tree``."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, codecs = [], []
    for path, x in with_path:
        try:
            x = jnp.asarray(x)
            codecs.append(codec_for(x))
        except TypeError as err:
            raise TypeError(f"cannot carry the state leaf {jax.tree_util.keystr(path)}: {err}") from err
        leaves.append(x)
    return leaves, treedef, codecs


def _check_reduce(reduce: str) -> str:
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")
    return reduce


def handle(template: Any, reduce: str = "sum", cls: type = Handle) -> Handle:
    """A handle for observations shaped like ``template`` (a pytree of arrays).

    ``sum`` and ``max`` handles hold zeros (the template gives structure,
    shapes and dtypes); a ``replace`` handle holds ``template`` itself (the
    current state, which `receive` replaces with the emitted one).

    Raises:
      ValueError: unknown ``reduce``.
      TypeError: a leaf of a dtype that cannot be carried (strings, 64-bit
        ints), or a non-float leaf in a ``sum``/``max`` handle.

    >>> h = handle({"amax": jnp.zeros((2,))}, reduce="max")
    >>> value(h)["amax"].shape
    (2,)
    """
    _check_reduce(reduce)
    leaves, treedef, codecs = _flatten_checked(template)
    if reduce != "replace":
        bad = [c.dtype for c in codecs if c.kind != "float"]
        if bad:
            raise TypeError(f"a {reduce!r} handle holds floating observations only, got dtypes {bad} "
                            "(counts and maxima are float32; state of any dtype goes in a 'replace' handle)")
        leaves = [jnp.zeros_like(x) for x in leaves]
    # A handle whose leaves share one buffer could not be donated (a state
    # made with one zero array for several fields is easy to write).
    encoded = unalias([encode_leaf(x, c) for x, c in zip(leaves, codecs)])
    return cls(encoded, jnp.zeros((), jnp.float32), treedef, codecs, reduce)


def value(h: Handle) -> Any:
    """The pytree a handle (or a cotangent of one) holds, decoded.

    >>> value(handle({"step": jnp.int32(7)}, reduce="replace"))["step"]
    Array(7, dtype=int32)
    """
    return jax.tree_util.tree_unflatten(h.treedef, [decode_leaf(x, c) for x, c in zip(h.leaves, h.codecs)])


def emit(h: Handle, observed: Any, calls: Any = 1.0) -> Handle:
    """The cotangent of ``h`` that carries ``observed`` (use inside a VJP rule).

    ``observed`` must have ``h``'s structure, and per leaf its dtype (after
    encoding, its shape); ``sum``/``max`` observations are recorded where
    finite, 0 elsewhere.

    Raises:
      ValueError: another structure, or a leaf of another dtype or shape
        (encoded as raw bits, it would be reinterpreted).

    >>> h = handle({"n": jnp.zeros(())})
    >>> float(emit(h, {"n": jnp.float32(3)}).leaves[0])
    3.0
    """
    leaves, treedef = jax.tree_util.tree_flatten(observed)
    hint = "the observation does not fit its handle (make the handle from a template of the same shapes)"
    if treedef != h.treedef:
        raise ValueError(f"observation structure changed ({hint}): {treedef} vs {h.treedef}")
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(observed)[0]]
    encoded = []
    for x, c, ref, path in zip(leaves, h.codecs, h.leaves, paths):
        x = jnp.asarray(x)
        now = codec_for(x)
        if now.kind != c.kind or (c.kind != "float" and now.dtype != c.dtype):
            raise ValueError(f"state leaf {path} changed dtype from {c.dtype} to {x.dtype}: an update must "
                             "return its state in the dtypes its init made")
        e = encode_leaf(x, c)
        if e.shape != ref.shape:
            raise ValueError(f"state leaf {path} changed shape from {ref.shape} to {e.shape} ({hint})")
        e = e.astype(ref.dtype)
        if h.reduce != "replace":
            e = jnp.where(jnp.isfinite(e), e, jnp.zeros_like(e))
        encoded.append(e)
    return type(h)(encoded, jnp.asarray(calls, jnp.float32), h.treedef, h.codecs, h.reduce)


def silent(h: Handle) -> Handle:
    """The cotangent of a use of ``h`` that observed nothing (zeros, ``calls`` 0).

    >>> float(silent(handle({"n": jnp.zeros(())})).calls)
    0.0
    """
    return jax.tree_util.tree_map(jnp.zeros_like, h)


@jax.custom_vjp
def observe(y: Any, h: Handle, observed: Any) -> Any:
    """Identity on ``y`` whose VJP hands ``observed`` back as ``h``'s cotangent.

    For observations known in the forward pass (fallback counts, a weight's
    amax). ``observed`` itself gets a zero cotangent: it is data, not a
    function to differentiate. Inside a ``jax.checkpoint`` or a
    reconstructed stack the forward may run twice, but the VJP runs once,
    so each use is observed once.

    >>> h = handle({"n": jnp.zeros(())})
    >>> g = jax.grad(lambda x, h: observe(x, h, {"n": jnp.float32(1)}), argnums=1)(2.0, h)
    >>> receive(h, g)[0]["n"], float(receive(h, g)[1])
    (Array(1., dtype=float32), 1.0)
    """
    del h, observed
    return y


def _observe_fwd(y, h, observed):
    return y, (h, observed)


def _observe_bwd(res, g):
    h, observed = res
    return g, emit(h, observed), jax.tree_util.tree_map(jnp.zeros_like, observed)


observe.defvjp(_observe_fwd, _observe_bwd)


def _same_handle(h: Handle, cot: Any) -> None:
    if not isinstance(cot, Handle):
        raise TypeError(f"expected the {type(h).__name__} cotangent, got {type(cot).__name__}")
    if cot.treedef != h.treedef or cot.reduce != h.reduce:
        raise ValueError("the cotangent does not belong to this handle (structure differs)")


def receive(h: Handle, cot: Handle) -> Tuple[Any, jax.Array]:
    """Read a handle's cotangent: ``(observation, calls)``.

    ``sum``: the total over uses. ``max``: the max for one use (``calls``
    1), an upper bound for several. ``replace``: the emitted state where
    exactly one use emitted it (``calls == 1``), else ``h``'s own value.

    Raises:
      TypeError / ValueError: ``cot`` is not a cotangent of ``h``.

    >>> h = handle({"n": jnp.zeros(())})
    >>> receive(h, emit(h, {"n": jnp.float32(2)}))[0]["n"]
    Array(2., dtype=float32)
    """
    _same_handle(h, cot)
    if h.reduce == "replace":
        ok = cot.calls == 1.0
        leaves = [jnp.where(ok, c.astype(o.dtype), o) for c, o in zip(cot.leaves, h.leaves)]
        cot = type(h)(leaves, cot.calls, h.treedef, h.codecs, h.reduce)
    return value(cot), cot.calls


def combine(a: Handle, b: Handle) -> Handle:
    """Two cotangents of one handle from separate differentiations (microbatches), combined.

    ``sum`` adds, ``max`` takes the elementwise maximum (exact), ``calls``
    add.

    Raises:
      ValueError: ``replace`` cotangents (two next states cannot be merged),
        or cotangents of different handles.

    >>> h = handle({"m": jnp.zeros(())}, reduce="max")
    >>> c = combine(emit(h, {"m": jnp.float32(2)}), emit(h, {"m": jnp.float32(5)}))
    >>> receive(h, c)[0]["m"], float(c.calls)
    (Array(5., dtype=float32), 2.0)
    """
    _same_handle(a, b)
    if a.reduce == "replace":
        raise ValueError("cannot combine two cotangents of a 'replace' handle: each carries a whole next state")
    op = jnp.add if a.reduce == "sum" else jnp.maximum
    leaves = [op(x, y) for x, y in zip(a.leaves, b.leaves)]
    return type(a)(leaves, a.calls + b.calls, a.treedef, a.codecs, a.reduce)
