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
    """True when the default device has a pinned-host memory space.

    Whether compiled programs really place arrays there is the backend's
    choice: XLA:CPU has the memory kind but compiles placement as a no-op.

    >>> isinstance(host_offload_supported(), bool)
    True
    """
    try:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # pragma: no cover - very old runtimes
        return False
    return "pinned_host" in kinds


def to_host(x: jax.Array) -> jax.Array:
    """Place ``x`` in pinned host memory (works inside ``jit``).

    >>> import jax.numpy as jnp
    >>> jax.jit(to_host)(jnp.ones(2)).sharding.memory_kind
    'pinned_host'
    """
    return jax.device_put(x, _host_target())


def to_device(x: jax.Array) -> jax.Array:
    """Bring ``x`` back to device memory (works inside ``jit``).

    >>> import jax.numpy as jnp
    >>> jax.jit(lambda x: to_device(to_host(x)) + 1)(jnp.ones(2))
    Array([2., 2.], dtype=float32)
    """
    return jax.device_put(x, _device_target())
