"""Logical axis names -> mesh axes, in one place (MaxText's ``logical_axis_rules``).

A param (or activation) says what each of its dimensions *is* with a tuple
of logical names, e.g. ``('layers', 'heads', 'embed')`` for a stacked q
projection; `LOGICAL_AXIS_RULES` says which mesh axes each logical name is
split over. Changing how a model is sharded is changing the rules, never
the model.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import jax
from jax.sharding import NamedSharding, PartitionSpec

from eae_jax.parallel.mesh import AXES, mesh_size

#: ``(logical name, mesh axes)``: a mesh axis name, a tuple of them, or None (replicated).
LOGICAL_AXIS_RULES: Tuple[Tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),   # every batch-sharding axis: activations and tokens
    ("layers", "stage"),           # a stacked block axis: contiguous block ranges per stage
    ("vocab", "model"),            # embedding / head rows: logits split over vocab
    ("embed", "fsdp"),             # model width: ZeRO-3's split of every weight
    ("heads", "model"),            # q heads: column-split q, row-split o (Megatron)
    ("kv_heads", "model"),         # k/v heads: column-split k, v
    ("mlp", "model"),              # FFN hidden: column-split gate/up, row-split down
    ("norm", None),                # norm scales: small, replicated
    ("seq", None),
)


def _is_logical(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _rule(name: str, rules) -> tuple:
    for logical, mesh_axes in rules:
        if logical == name:
            if mesh_axes is None:
                return ()
            return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    known = ", ".join(r[0] for r in rules)
    raise ValueError(f"logical axis {name!r} has no rule (known: {known}); add ({name!r}, <mesh axes or None>) "
                     "to the rules")


def logical_to_spec(logical: Sequence[Optional[str]], rules=LOGICAL_AXIS_RULES, mesh=None, shape=None,
                    name: str = "array") -> PartitionSpec:
    """The `PartitionSpec` of an array whose dimensions are ``logical``.

    None as a logical name is a replicated dimension. Given ``mesh`` and
    ``shape``, every dimension must split evenly over its mesh axes, and
    mesh axes of size 1 are dropped (the spec names only real splits).

    >>> tuple(logical_to_spec(("layers", "heads", "embed")))
    ('stage', 'model', 'fsdp')
    >>> tuple(logical_to_spec(("batch", "seq", None)))
    (('data', 'fsdp'), None, None)

    Raises:
      ValueError: a name without a rule, a mesh axis used twice, or a
        dimension the mesh does not split evenly (naming ``name``).
    """
    parts, used = [], set()
    sizes = dict(mesh.shape) if mesh is not None else None
    if shape is not None and len(shape) != len(logical):
        raise ValueError(f"{name}: {len(logical)} logical axes {tuple(logical)} for shape {tuple(shape)}")
    for dim, axis_name in enumerate(logical):
        axes = () if axis_name is None else _rule(axis_name, rules)
        for a in axes:
            if a not in AXES and (sizes is None or a not in sizes):
                raise ValueError(f"rule for {axis_name!r} names mesh axis {a!r}; the axes are {', '.join(AXES)}")
            if a in used:
                raise ValueError(f"{name}: mesh axis {a!r} splits two dimensions of logical axes {tuple(logical)}")
            used.add(a)
        if sizes is not None:
            axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
            split = mesh_size(mesh, *axes)
            if shape is not None and shape[dim] % split:
                raise ValueError(f"{name}: dimension {dim} ({axis_name}) of shape {tuple(shape)} does not split "
                                 f"evenly over mesh axes {axes} of {split} devices")
        parts.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return PartitionSpec(*parts)


def tree_specs(logical_tree: Any, shapes: Any = None, mesh=None, rules=LOGICAL_AXIS_RULES) -> Any:
    """`logical_to_spec` over a tree of logical-axis tuples (its structure
    ends where ``shapes`` has leaves: arrays or `jax.ShapeDtypeStruct`).

    >>> {name: tuple(spec) for name, spec in tree_specs({"w": ("embed", "mlp"), "b": ("mlp",)}).items()}
    {'b': ('model',), 'w': ('fsdp', 'model')}
    """
    if shapes is None:
        return jax.tree_util.tree_map(lambda lg: logical_to_spec(lg, rules), logical_tree, is_leaf=_is_logical)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    logical = treedef.flatten_up_to(logical_tree) if not _is_logical(logical_tree) else [logical_tree] * len(flat)
    specs = [logical_to_spec(lg, rules, mesh, tuple(leaf.shape), jax.tree_util.keystr(path) or "array")
             for (path, leaf), lg in zip(flat, logical)]
    return jax.tree_util.tree_unflatten(treedef, specs)


def tree_shardings(logical_tree: Any, shapes: Any, mesh, rules=LOGICAL_AXIS_RULES) -> Any:
    """`NamedSharding` per leaf of ``shapes`` on ``mesh`` (see `tree_specs`).

    >>> from eae_jax.parallel.mesh import make_mesh
    >>> import jax.numpy as jnp
    >>> tuple(tree_shardings({"w": ("embed", "mlp")}, {"w": jnp.zeros((4, 8))}, make_mesh("data=1"))["w"].spec)
    (None, None)
    """
    specs = tree_specs(logical_tree, shapes, mesh, rules)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda s: isinstance(s, PartitionSpec))


def without_axes(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
    """``spec`` with the mesh ``axes`` removed (those dimensions gathered over them).

    >>> tuple(without_axes(PartitionSpec("model", ("data", "fsdp")), ["fsdp"]))
    ('model', 'data')
    """
    out = []
    for part in spec:
        names = () if part is None else ((part,) if isinstance(part, str) else tuple(part))
        kept = tuple(n for n in names if n not in axes)
        out.append(None if not kept else (kept[0] if len(kept) == 1 else kept))
    return PartitionSpec(*out)
