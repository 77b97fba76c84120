"""A seam's contract, checked where JAX can check it.

Two timescales, as in the seed's guard, mapped onto JAX:

* **Trace time**: what is static under ``jit`` — the input's dtype, width,
  row count and the platform — is checked once when the seam is traced.
  A width that does not fit the weights cannot be run by either path and
  raises `GuardRefused`. A dtype, row count or platform outside the
  contract makes the traced graph take the high-precision path; every call
  of that graph is then counted as a fallback with that reason (in strict
  mode the trace raises instead).
* **In the graph**: what depends on values — non-finite inputs and
  saturation (the fraction of elements whose magnitude after scaling lies
  beyond the fp8 range by more than rounding, see `saturation_limit`) — is
  computed by reductions over the values being quantized, and one
  ``lax.cond`` per call hands back the high-precision result for that call
  only (see `eae_jax.fp8.seams` for why the check comes after the fp8
  work). Under ``vmap`` the cond becomes a select and both paths run.

Platform: fp8 GEMMs need NVIDIA compute capability >= 8.9 (Ada, Hopper). On
an older GPU the seam falls back at trace time (reason ``device``) instead
of letting XLA run something that is not an fp8 GEMM. CPU is allowed by
default because XLA emulates fp8 there exactly (tests); pass
``platforms=('gpu',)`` to fall back everywhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from eae_jax.dtypes import parse_compute_dtype


class GuardRefused(RuntimeError):
    """A seam was called outside its contract and could not (or, in strict
    mode, was not allowed to) fall back."""


#: Platform names a contract may allow (``'gpu'`` covers cuda and rocm).
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")


def platform_names(platforms: Any) -> Optional[Tuple[str, ...]]:
    """``platforms`` as a tuple of names (one string is one name, not its
    characters); None stays None.

    Raises:
      ValueError: a name not in `PLATFORMS`.
    """
    if platforms is None:
        return None
    names = (platforms,) if isinstance(platforms, str) else tuple(platforms)
    bad = [p for p in names if p not in PLATFORMS]
    if bad:
        raise ValueError(f"unknown platform(s) {bad}; expected names from {PLATFORMS}")
    return names


@dataclasses.dataclass(frozen=True)
class Contract:
    """The form a seam was bound for.

    Attributes:
      width: input width K.
      dtypes: input dtypes the fp8 path accepts (names or dtypes).
      min_rows, max_rows: bounds on the number of rows (product of the
        leading axes); None for no upper bound. Tiny row counts gain nothing
        from fp8 GEMMs.
      platforms: allowed platforms (``'cpu'``, ``'gpu'``, ``'cuda'``,
        ``'rocm'``, ``'tpu'``); None allows any.
      min_compute_capability: on NVIDIA GPUs, the lowest compute capability
        with fp8 tensor cores.
    """

    width: int
    dtypes: Tuple[Any, ...] = ("bf16", "fp16", "fp32")
    min_rows: int = 1
    max_rows: Optional[int] = None
    platforms: Optional[Tuple[str, ...]] = None
    min_compute_capability: float = 8.9

    def __post_init__(self):
        dtypes = (self.dtypes,) if isinstance(self.dtypes, str) else self.dtypes
        object.__setattr__(self, "dtypes", tuple(parse_compute_dtype(d) for d in dtypes))
        object.__setattr__(self, "platforms", platform_names(self.platforms))
        if self.width < 1 or self.min_rows < 0 or (self.max_rows is not None and self.max_rows < self.min_rows):
            raise ValueError(f"bad contract bounds: width={self.width}, rows=[{self.min_rows}, {self.max_rows}]")


def _device_of(x) -> Optional[Any]:
    """The device a concrete array lives on; None for tracers (use the default)."""
    try:
        devices = x.devices()
    except Exception:  # a tracer (no concrete device) or a numpy input: use the default device
        return None
    return next(iter(devices)) if len(devices) == 1 else None


def _platform_problem(contract: Contract, x) -> Optional[str]:
    device = _device_of(x)
    if device is None:
        device = jax.devices()[0]
    platform = device.platform
    if contract.platforms is not None:
        aliases = {platform, "gpu" if platform in ("cuda", "rocm") else platform}
        if not aliases & set(contract.platforms):
            return f"platform {platform!r} not in {contract.platforms}"
    if platform in ("gpu", "cuda"):
        cc = getattr(device, "compute_capability", None)
        if cc is not None:
            try:
                value = float(cc)
            except (TypeError, ValueError):
                value = None
            if value is not None and value < contract.min_compute_capability:
                return (f"GPU compute capability {cc} has no fp8 tensor cores "
                        f"(needs >= {contract.min_compute_capability})")
    return None


def trace_check(contract: Contract, x) -> Optional[Tuple[str, str]]:
    """Check the static form of ``x`` against ``contract``.

    Returns:
      None when the fp8 path may run, else ``(reason, detail)`` with reason
      one of ``'dtype'``, ``'rows'``, ``'device'``.

    Raises:
      GuardRefused: wrong width or a non-floating input (no path can run it).
    """
    shape = tuple(x.shape)
    if not shape or shape[-1] != contract.width:
        raise GuardRefused(f"input of shape {shape} has width {shape[-1] if shape else None}; "
                           f"the seam was bound for width {contract.width}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise GuardRefused(f"input dtype {x.dtype} is not floating; a seam computes on float activations")
    if jnp.dtype(x.dtype) not in contract.dtypes:
        return "dtype", f"input dtype {jnp.dtype(x.dtype).name} (bound for {', '.join(d.name for d in contract.dtypes)})"
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    if rows < contract.min_rows or (contract.max_rows is not None and rows > contract.max_rows):
        return "rows", f"{rows} row(s) (bound for [{contract.min_rows}, {contract.max_rows}])"
    problem = _platform_problem(contract, x)
    if problem is not None:
        return "device", problem
    return None


def magnitude(x: jax.Array) -> jax.Array:
    """float32 ``|x|`` with NaN mapped to +inf.

    A max over it is non-finite whenever ``x`` holds a NaN or an inf, on
    every backend: XLA's CPU max reduction may drop NaNs (its fast min/max
    mode), so a NaN must not rely on max to propagate.
    """
    mag = jnp.abs(x.astype(jnp.float32))
    return jnp.where(jnp.isnan(mag), jnp.inf, mag)


def value_stats(x: jax.Array, scale: Optional[jax.Array], fmax: float):
    """In-graph statistics of one quantization point.

    Args:
      x: the values about to be quantized.
      scale: their static scale (None for dynamic per-row scaling, which
        cannot saturate).
      fmax: the fp8 format's largest magnitude.

    Returns:
      ``(amax, saturated_fraction)`` float32 scalars; ``amax`` is inf
      when ``x`` holds a NaN or an inf (see `magnitude`).
    """
    # Statistics, not values to differentiate (lax.reduce with several
    # operands has no JVP rule either).
    mag = magnitude(jax.lax.stop_gradient(x))
    if scale is None:
        return jnp.max(mag), jnp.zeros((), jnp.float32)
    limit = saturation_limit(fmax) * jnp.asarray(scale, jnp.float32)
    # One variadic reduction computes both statistics in a single pass over
    # x (two separate reductions are two kernels, each reading all of x).
    amax, count = jax.lax.reduce(
        (mag, (mag > limit).astype(jnp.float32)), (jnp.float32(0), jnp.float32(0)),
        lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]), tuple(range(x.ndim)))
    return amax, count / max(1, x.size)


def saturation_limit(fmax: float) -> float:
    """Scaled magnitude beyond which clipping changes a value by more than
    rounding would: ``fmax`` plus half an ulp of the top binade (464 for
    e4m3fn, 61440 for e5m2). An element just above ``fmax`` is not saturated,
    it rounds to ``fmax`` anyway."""
    import numpy as np

    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        info = jnp.finfo(dtype)
        if float(info.max) == fmax:
            return fmax + 2.0 ** (int(np.floor(np.log2(fmax))) - int(info.nmant) - 1)
    return fmax
