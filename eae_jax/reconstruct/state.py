"""The stack's carry: its pass state per boundary, step counter and statistics slots."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax import carry as carry_lib


def as_prng_key(key: Any) -> jax.Array:
    """``key`` as something `jax.random.split` takes: a typed key, a raw
    ``uint32[2]`` key or an int seed (None: ``key(0)``).

    Raises:
      TypeError: anything else, named.

    >>> as_prng_key(3).dtype
    key<fry>
    """
    if key is None:
        return jax.random.key(0)
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        return jax.random.key(int(key))
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if not isinstance(shape, tuple):
        dtype = None  # not an array (a scalar type such as jnp.uint32 has a dtype): named by its repr
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if shape != ():
            raise TypeError(f"init: key must be a single PRNG key, got a key array of shape {shape}")
        return key
    if dtype is not None and jnp.dtype(dtype) == jnp.uint32 and shape == (2,):
        return key
    raise TypeError(f"init: key must be a jax.random.key, a uint32[2] jax.random.PRNGKey or an int seed; "
                    f"got {type(key).__name__}" + (f" of dtype {dtype} and shape {shape}"
                                                   if dtype is not None else f" {key!r}"))


def _is_float(spec) -> bool:
    return bool(jnp.issubdtype(spec.dtype, jnp.floating))


def init_carry(passes, scanned: Sequence[bool], depths: Sequence[int], specs: Sequence[Any],
               key: jax.Array) -> carry_lib.AdjointCarry:
    """The carry of a stack whose segments (scanned or not) have ``depths``
    blocks and whose boundaries x0..xL have ``specs``: one pass state per
    float boundary (stacked over a scanned segment's boundaries), step 0,
    zeroed statistics.

    >>> from eae_jax.passes import identity
    >>> spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    >>> c = init_carry(identity(), [True], [2], [spec] * 3, jax.random.key(0))
    >>> carry_lib.decode(c)["stats"]["adjoint_norm"].shape
    (3,)
    """
    keys = jax.random.split(key, len(specs))

    def state(spec, k):
        return passes.init(spec, k) if _is_float(spec) else None

    seg_states, b = [], 0
    for is_scanned, n in zip(scanned, depths):
        spec = specs[b]
        if is_scanned:
            seg_states.append(jax.vmap(lambda k: state(spec, k))(keys[b:b + n]) if _is_float(spec) else None)
        else:
            seg_states.append(state(spec, keys[b]))
        b += n
    num = len(specs)
    tree = {
        "step": jnp.zeros((), jnp.int32),
        "state": {"segments": seg_states, "top": state(specs[-1], keys[-1])},
        "stats": {
            "adjoint_norm": jnp.zeros((num,), jnp.float32),
            "adjoint_norm_after_passes": jnp.zeros((num,), jnp.float32),
        },
    }
    return carry_lib.encode(tree)


def check_carry(carry, names: List[str], scanned: List[bool], depths: List[int], num: int,
                expected: Optional[Callable[[], Any]] = None) -> None:
    """Raise ValueError when ``carry`` was made for another stack or depth
    (the backward would otherwise fail inside its scans with a bare shape
    error, or misread the state), or when its pass state differs in
    structure, shape or dtype from ``expected()`` (what init makes for this
    call: a state made for other shapes or dtypes would otherwise be
    broadcast against or cast into the adjoints).

    >>> from eae_jax.passes import identity
    >>> spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    >>> c = init_carry(identity(), [True], [2], [spec] * 3, jax.random.key(0))
    >>> check_carry(c, ["b"], [True], [5], 6)
    Traceback (most recent call last):
    ValueError: the carry was made for a stack with 3 boundaries in 1 segments; this call has 6 boundaries in 1 segments (depths [5]); make the carry with this stack's init() from params and x of the shapes the stack is called with
    """
    tree = jax.eval_shape(carry_lib.decode, carry)
    hint = "make the carry with this stack's init() from params and x of the shapes the stack is called with"
    try:
        have = tree["stats"]["adjoint_norm"].shape[0]
        seg_states = tree["state"]["segments"]
    except (KeyError, TypeError, IndexError) as err:
        raise ValueError(f"the carry was not made by Reconstructed.init ({hint})") from err
    if have != num or len(seg_states) != len(names):
        raise ValueError(
            f"the carry was made for a stack with {have} boundaries in {len(seg_states)} segments; this call "
            f"has {num} boundaries in {len(names)} segments (depths {depths}); {hint}"
        )
    for name, is_scanned, n, st in zip(names, scanned, depths, seg_states):
        if is_scanned:
            lead = {leaf.shape[0] if leaf.ndim else None for leaf in jax.tree_util.tree_leaves(st)}
            if lead - {n}:
                raise ValueError(
                    f"the carry's pass state for segment {name!r} covers {sorted(lead, key=str)} blocks, "
                    f"this call has {n}; {hint}"
                )
    if expected is None:
        return
    want = jax.eval_shape(carry_lib.decode, expected())
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(tree["state"])
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want["state"])
    if got_def != want_def:
        raise ValueError(f"the carry's pass state has another structure than this stack's passes make for this "
                         f"call; {hint}")
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"the carry's pass state {jax.tree_util.keystr(path)} is {a.dtype}{list(a.shape)}, this call's "
                f"passes need {b.dtype}{list(b.shape)} (params, x or side of other shapes or dtypes than the "
                f"carry was made for); {hint}"
            )
