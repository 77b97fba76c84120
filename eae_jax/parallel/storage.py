"""A reconstruct storage for a segment whose params are sharded over a mesh.

`Sharded` wraps another `eae_jax.reconstruct.Storage` (what is kept for the
backward: boundaries on the device, a policy's residuals, host memory) and
adds what a mesh needs, in the one place the storage protocol gives a
segment's shapes to its storage (`Storage.bind`):

* FSDP: each block's params are all-gathered over the ``gather`` axes when
  that block runs, forward and backward recomputation alike, and its
  gradient is constrained back to the sharded layout where its VJP makes it
  (`gather_block`): inside the scan body, one block at a time.
* Boundary storage under sharding: a boundary is kept in the batch layout
  (``x_spec``). Gradient slots (`GradSlots`) are laid out like the params;
  on a mesh of more than one device every boundary written into a slot and
  read back would be resharded between the two layouts (all-gathers of the
  batch for replicated params, all-to-alls for FSDP-split ones:
  ``experiments/scaleout_memory.py`` counts them), so there the boundaries
  are kept plainly on the device (`OnDevice`, same dtype) instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

from jax.sharding import PartitionSpec

from eae_jax.parallel.fsdp import gather_block
from eae_jax.reconstruct.slots import GradSlots
from eae_jax.reconstruct.storage import OnDevice, SegmentLayout, Storage


def storage_for_mesh(inner: Storage, mesh) -> Storage:
    """The storage ``inner`` stands for on ``mesh``: `GradSlots` keeps its dtype but
    becomes `OnDevice` on a mesh of more than one device (see the module doc).

    >>> from eae_jax.parallel import make_mesh
    >>> storage_for_mesh(GradSlots("bfloat16"), make_mesh("data=1")).kind
    'grad_slots'
    """
    if isinstance(inner, GradSlots) and mesh.size > 1:
        return OnDevice(inner.dtype)
    return inner


@dataclasses.dataclass(frozen=True)
class Sharded(Storage):
    """``inner``'s storage for a segment whose params are laid out by ``param_specs`` on ``mesh``.

    Attributes:
      inner: the storage of the residuals (`storage_for_mesh` picks the one
        that suits the mesh).
      mesh: the mesh the specs refer to.
      param_specs: one block's params' sharded layout (a tree prefix of
        `PartitionSpec`; None leaves a subtree alone).
      gather: the mesh axes a block's params are gathered over when it runs.
      x_spec: the layout of the segment's boundaries (the batch split), or None.

    >>> import jax, jax.numpy as jnp
    >>> from eae_jax.parallel import make_mesh
    >>> from eae_jax.reconstruct import GradSlots, Scan, reconstruct
    >>> store = Sharded(GradSlots(), make_mesh("data=1"), {"w": PartitionSpec("fsdp")})
    >>> stack = reconstruct(Scan(lambda p, x: jnp.tanh(x * p["w"])), storage=store)
    >>> jax.grad(lambda p: stack(p, jnp.ones(4)).sum())({"w": jnp.ones((3, 4))})["w"].shape
    (3, 4)
    """

    inner: Storage
    mesh: Any
    param_specs: Any
    gather: Tuple[str, ...] = ("fsdp",)
    x_spec: Optional[PartitionSpec] = None

    kind = "sharded"

    def bind(self, layout: SegmentLayout) -> Storage:
        fn = gather_block(layout.segment.fn, self.param_specs, self.mesh, self.gather, self.x_spec,
                          stateful=layout.segment.stateful)
        wrapped = layout._replace(segment=layout.segment._replace(fn=fn))
        return _Bound(storage_for_mesh(self.inner, self.mesh).bind(wrapped), wrapped)


@dataclasses.dataclass(frozen=True)
class _Bound(Storage):
    """The bound inner storage, run against the layout whose block gathers its params."""

    inner: Storage
    layout: SegmentLayout

    @property
    def kind(self) -> str:
        return self.inner.kind

    # Every call runs against the gathering layout; outputs are the inner storage's, stateful ones
    # included (``(y, new_state)`` per block, `SegmentLayout.split` / `join`).
    def save(self, layout: SegmentLayout, params: Any, x: Any, side: Any) -> Tuple[Any, Any]:
        return self.inner.save(self.layout, params, x, side)

    def restore(self, layout: SegmentLayout, params: Any, residual: Any, g: Any, side: Any) -> Tuple[Any, Any]:
        return self.inner.restore(self.layout, params, residual, g, side)

    def forward(self, layout: SegmentLayout, params: Any, x: Any, side: Any) -> Tuple[Any, Any]:
        return self.inner.forward(self.layout, params, x, side)

    def backward(self, layout: SegmentLayout, params: Any, residuals: Any, g: Any, states: Any, at: Any,
                 side: Any) -> Tuple[Any, Any]:
        return self.inner.backward(self.layout, params, residuals, g, states, at, side)
