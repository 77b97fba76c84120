"""Device buffers shared between the leaves of a pytree.

``jax.jit(f, donate_argnums=...)`` refuses a pytree in which two leaves are
the same buffer ("Attempt to donate the same buffer twice"). Eagerly built
states alias easily: one ``jnp.zeros(())`` used for several fields, an
optax ``init`` that reuses an array, ``jnp.asarray`` returning its input.
Outputs of a jitted call never alias, so only states built or restored
outside ``jit`` need `unalias`.
"""

from __future__ import annotations

from typing import Any, List

import jax


def _buffers(leaf: Any) -> tuple:
    """Identities of the device buffers behind ``leaf`` (empty for a non-array or a tracer)."""
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
        return ()
    try:
        return tuple(("ptr", str(s.device), s.data.unsafe_buffer_pointer()) for s in leaf.addressable_shards)
    except Exception:  # deleted, or an array kind without raw pointers: fall back to object identity
        return (("id", id(leaf)),)


def aliased_leaves(tree: Any) -> List[str]:
    """Tree paths (``jax.tree_util.keystr``) of the leaves whose buffer an
    earlier leaf of ``tree`` already holds; ``[]`` when none does.

    >>> import jax.numpy as jnp
    >>> z = jnp.zeros(())
    >>> aliased_leaves({"a": z, "b": z, "c": jnp.zeros(())})
    ["['b']"]
    """
    seen, out = set(), []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        ids = set(_buffers(leaf))
        if ids & seen:
            out.append(jax.tree_util.keystr(path))
        seen |= ids
    return out


def unalias(tree: Any) -> Any:
    """``tree`` with every leaf that shares a buffer with an earlier leaf
    replaced by a copy (same value, dtype and sharding), so the tree can be
    donated. Leaves that alias nothing are returned as they are (no copy).

    >>> import jax.numpy as jnp
    >>> z = jnp.zeros(())
    >>> t = unalias((z, z))
    >>> t[0] is z, t[1] is z, aliased_leaves(t)
    (True, False, [])
    """
    seen = set()

    def fresh(leaf):
        ids = set(_buffers(leaf))
        if ids & seen:
            leaf = leaf.copy()
            ids = set(_buffers(leaf))
        seen.update(ids)
        return leaf

    return jax.tree_util.tree_map(fresh, tree)
