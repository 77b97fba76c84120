"""Device meshes named by a spec string such as ``"data=2,fsdp=2,model=2"``.

Every mesh has the same four axes, in this order (outermost first)::

    data    batch sharded, params replicated
    stage   pipeline stages: contiguous block ranges
    fsdp    batch sharded, params / gradients / optimizer state sharded (ZeRO-3)
    model   tensor parallelism (Megatron: heads and FFN width split)

Axes left out of a spec have size 1, so sharding rules can always name all
four. ``model`` is innermost: its collectives run every block and want the
fastest links; ``data`` is outermost: across hosts it only all-reduces
gradients once per step.
"""

from __future__ import annotations

import math
import re
from typing import Dict, Optional, Sequence

import jax
import numpy as np

#: The mesh axes, outermost first.
AXES = ("data", "stage", "fsdp", "model")

_ITEM = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*([^\s,]+)\s*$")


def parse_mesh(spec: str) -> Dict[str, int]:
    """The axis sizes a mesh spec names: ``{'data': 2, 'stage': 1, 'fsdp': 2, 'model': 1}``.

    ``spec`` is a comma-separated list of ``axis=size`` (any order, each axis
    at most once); axes not named have size 1. An empty spec is one device.

    >>> parse_mesh("data=2,fsdp=4")
    {'data': 2, 'stage': 1, 'fsdp': 4, 'model': 1}
    >>> parse_mesh("tensor=2")
    Traceback (most recent call last):
    ...
    ValueError: mesh spec 'tensor=2': unknown axis 'tensor'; the axes are data, stage, fsdp, model

    Raises:
      ValueError: unknown or repeated axis, a size that is not an int >= 1, bad syntax.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a mesh spec is a string such as 'data=2,fsdp=4', got {type(spec).__name__}")
    sizes = {axis: 1 for axis in AXES}
    seen = set()
    for item in (part for part in spec.split(",") if part.strip()):
        m = _ITEM.match(item)
        if not m:
            raise ValueError(f"mesh spec {spec!r}: {item.strip()!r} is not axis=size (e.g. 'data=2,fsdp=4')")
        axis, size = m.group(1), m.group(2)
        if axis not in AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {axis!r}; the axes are {', '.join(AXES)}")
        if axis in seen:
            raise ValueError(f"mesh spec {spec!r}: axis {axis!r} is given twice")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"mesh spec {spec!r}: {axis}={size} is not a size (an int >= 1)")
        seen.add(axis)
        sizes[axis] = int(size)
    return sizes


def format_mesh(sizes: Dict[str, int]) -> str:
    """The spec string of axis sizes, axes of size 1 left out (``'data=1'`` for one device).

    >>> format_mesh({"data": 2, "stage": 1, "fsdp": 4, "model": 1})
    'data=2,fsdp=4'
    """
    named = [f"{axis}={sizes.get(axis, 1)}" for axis in AXES if sizes.get(axis, 1) != 1]
    return ",".join(named) or "data=1"


def make_mesh(spec, devices: Optional[Sequence] = None) -> jax.sharding.Mesh:
    """A `jax.sharding.Mesh` with the axes `AXES` (sizes from a spec string or dict).

    ``devices`` (default: all of `jax.devices`, over every process) must
    hold at least as many devices as the mesh; the first ones are used. The
    axes are ``Auto`` (sharding propagated by XLA from the constraints the
    library places), the same on every JAX version.

    >>> mesh = make_mesh("data=1")
    >>> dict(mesh.shape)
    {'data': 1, 'stage': 1, 'fsdp': 1, 'model': 1}

    Raises:
      ValueError: a bad spec, or more devices asked for than given.
    """
    sizes = parse_mesh(spec) if isinstance(spec, str) else {axis: int(spec.get(axis, 1)) for axis in AXES}
    unknown = set(sizes) - set(AXES) if not isinstance(spec, str) else set()
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {', '.join(AXES)}")
    count = math.prod(sizes.values())
    available = list(jax.devices() if devices is None else devices)
    if count > len(available):
        raise ValueError(f"mesh {format_mesh(sizes)} needs {count} devices, {len(available)} are available")
    shape = tuple(sizes[axis] for axis in AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    if count == len(available) and devices is None:
        # jax.make_mesh lays the axes out over the physical topology (and over processes).
        return jax.make_mesh(shape, AXES, axis_types=auto)
    return jax.sharding.Mesh(np.array(available[:count]).reshape(shape), AXES, axis_types=auto)


def mesh_size(mesh: jax.sharding.Mesh, *axes: str) -> int:
    """The product of the sizes of ``axes`` in ``mesh`` (1 for an axis it lacks).

    >>> mesh_size(make_mesh("data=1"), "data", "fsdp")
    1
    """
    return math.prod(dict(mesh.shape).get(axis, 1) for axis in axes)
