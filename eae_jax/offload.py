"""Moving stored boundaries between device memory and pinned host memory.

Inside ``jit`` an array is moved with `jax.device_put` to a memory *kind*
rather than a device. The spelling changed across JAX releases
(``jax.memory.Space.Host`` in new ones, ``TransferToMemoryKind`` before), so
the two helpers below pick whichever the installed JAX has.
"""

from __future__ import annotations

import jax


def _host_target():
    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is not None and hasattr(space, "Host"):
        return space.Host
    from jax._src.sharding_impls import TransferToMemoryKind  # older JAX

    return TransferToMemoryKind("pinned_host")


def _device_target():
    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is not None and hasattr(space, "Device"):
        return space.Device
    from jax._src.sharding_impls import TransferToMemoryKind

    return TransferToMemoryKind("device")


def host_offload_supported() -> bool:
    """True when the default device has a pinned-host memory space."""
    try:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # pragma: no cover - very old runtimes
        return False
    return "pinned_host" in kinds


def to_host(x: jax.Array) -> jax.Array:
    """Place ``x`` in pinned host memory (works inside ``jit``)."""
    return jax.device_put(x, _host_target())


def to_device(x: jax.Array) -> jax.Array:
    """Bring ``x`` back to device memory (works inside ``jit``)."""
    return jax.device_put(x, _device_target())
