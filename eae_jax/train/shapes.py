"""A training run's model shape: a preset, then flags (or a config file) over it.

`resolve_shape` is the one place where a preset and the shape flags
(``--dim --depth --heads --kv-heads --ffn --vocab-size``, RoPE and norm
settings) become one shape, each problem named; `shape_of` goes the other
way, from a loaded model's `LMConfig` (``--init``) to the flags that rebuild
it.
"""

from __future__ import annotations

import math
from typing import Optional

from eae_jax.blocks import default_ffn_hidden_dim

#: Model and batch presets. ``tiny`` trains in seconds on a laptop CPU.
PRESETS = {
    "tiny": dict(vocab_size=256, depth=4, dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=176,
                 seq_len=64, batch=16),
    "small": dict(vocab_size=4096, depth=8, dim=256, num_heads=8, num_kv_heads=2, ffn_hidden_dim=768,
                  seq_len=256, batch=16),
    "medium": dict(vocab_size=32000, depth=16, dim=2048, num_heads=16, num_kv_heads=4, ffn_hidden_dim=5632,
                   seq_len=2048, batch=4),
    "7b-like": dict(vocab_size=32000, depth=8, dim=4096, num_heads=32, num_kv_heads=8, ffn_hidden_dim=11008,
                    seq_len=4096, batch=2),
}

#: TrainConfig field -> the preset / `BlockConfig` name it overrides.
SHAPE_FIELDS = {"vocab_size": "vocab_size", "depth": "depth", "dim": "dim", "heads": "num_heads",
                "kv_heads": "num_kv_heads", "ffn": "ffn_hidden_dim"}
#: Block conventions a model may differ in (presets use the `BlockConfig` defaults).
CONVENTION_DEFAULTS = {"norm_eps": 1e-6, "rope_theta": 10000.0, "rope_style": "interleaved"}
ROPE_STYLES = ("interleaved", "half")


def ffn_width(dim: int) -> int:
    """The SwiGLU width for ``--dim`` without ``--ffn``: LLaMA's 8/3 of ``dim``, rounded up to a
    multiple of 256 (of 16 below a width of 256), as every preset's is.

    Example:
      >>> from eae_jax.train.shapes import ffn_width
      >>> ffn_width(64), ffn_width(128), ffn_width(4096)
      (176, 352, 11008)
    """
    return default_ffn_hidden_dim(dim, 256 if dim >= 256 else 16)


def resolve_shape(preset: str, **flags) -> dict:
    """The model shape of ``preset`` with ``flags`` (TrainConfig field names; None keeps the preset's).

    Returns a dict with ``vocab_size, depth, dim, num_heads, num_kv_heads,
    ffn_hidden_dim, norm_eps, rope_theta, rope_style``. Given ``dim`` but no
    ``ffn``, the FFN width follows `ffn_width`, as the presets' widths do.

    Raises:
      ValueError: an unknown preset, a value below 1, heads that do not divide
        ``dim`` (or kv heads that do not divide heads), a bad RoPE setting;
        the message names the flag.

    Example:
      >>> from eae_jax.train.shapes import resolve_shape
      >>> s = resolve_shape("tiny", dim=128, depth=2)
      >>> s["dim"], s["depth"], s["num_heads"], s["ffn_hidden_dim"], s["vocab_size"]
      (128, 2, 4, 352, 256)
      >>> resolve_shape("tiny", dim=66)
      Traceback (most recent call last):
      ...
      ValueError: --dim 66 is not divisible by --heads 4 (the preset's): pass --heads that divides it
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    unknown = sorted(set(flags) - set(SHAPE_FIELDS) - set(CONVENTION_DEFAULTS))
    if unknown:
        raise TypeError(f"resolve_shape: unknown shape fields {unknown}")
    base = PRESETS[preset]
    shape, given = {}, {}
    for field, key in SHAPE_FIELDS.items():
        value = flags.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"--{_flag(field)} must be an int >= 1, got {value!r}")
        given[key] = value is not None
        shape[key] = base[key] if value is None else value
    if given["dim"] and not given["ffn_hidden_dim"]:
        shape["ffn_hidden_dim"] = ffn_width(shape["dim"])

    def origin(key):
        return "" if given[key] else " (the preset's)"

    if shape["dim"] % shape["num_heads"]:
        raise ValueError(f"--dim {shape['dim']}{origin('dim')} is not divisible by --heads {shape['num_heads']}"
                         f"{origin('num_heads')}: pass --heads that divides it")
    if shape["num_heads"] % shape["num_kv_heads"]:
        raise ValueError(f"--heads {shape['num_heads']}{origin('num_heads')} is not a multiple of --kv-heads "
                         f"{shape['num_kv_heads']}{origin('num_kv_heads')}: pass --kv-heads that divides it")
    if (shape["dim"] // shape["num_heads"]) % 2:
        raise ValueError(f"head width {shape['dim'] // shape['num_heads']} (--dim / --heads) must be even for RoPE")
    for name, default in CONVENTION_DEFAULTS.items():
        value = flags.get(name)
        shape[name] = default if value is None else value
    for name in ("norm_eps", "rope_theta"):
        value = shape[name]
        low_ok = value > 1 if name == "rope_theta" else value >= 0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low_ok:
            raise ValueError(f"--{_flag(name)} must be a finite number {'> 1' if name == 'rope_theta' else '>= 0'}, "
                             f"got {value!r}")
        shape[name] = float(value)
    if shape["rope_style"] not in ROPE_STYLES:
        raise ValueError(f"--rope-style must be one of {', '.join(ROPE_STYLES)}, got {shape['rope_style']!r}")
    return shape


def shape_of(lm) -> dict:
    """The TrainConfig fields that rebuild ``lm`` (an `LMConfig`): what ``--init`` takes from a checkpoint.

    Example:
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig
      >>> from eae_jax.train.shapes import shape_of
      >>> lm = LMConfig(512, 2, BlockConfig(64, 8, 4, 172, norm_eps=1e-5), tie_embeddings=True)
      >>> f = shape_of(lm)
      >>> f["dim"], f["kv_heads"], f["ffn"], f["norm_eps"], f["tie_embeddings"]
      (64, 4, 172, 1e-05, True)
    """
    b = lm.block
    return {"vocab_size": lm.vocab_size, "depth": lm.depth, "dim": b.dim, "heads": b.num_heads,
            "kv_heads": b.num_kv_heads, "ffn": b.ffn_hidden_dim, "norm_eps": float(b.norm_eps),
            "rope_theta": float(b.rope_theta), "rope_style": b.rope_style, "tie_embeddings": bool(lm.tie_embeddings)}


def conflicts(fields: dict, wanted: dict) -> list:
    """``"--flag A, the checkpoint B"`` for each of ``fields`` (given, not None) that differs from ``wanted``.

    Example:
      >>> from eae_jax.train.shapes import conflicts
      >>> conflicts({"dim": 128, "depth": None}, {"dim": 64, "depth": 2})
      ['--dim 128 but the checkpoint has 64']
    """
    out = []
    for name, value in fields.items():
        if value is not None and name in wanted and value != wanted[name]:
            out.append(f"--{_flag(name)} {value} but the checkpoint has {wanted[name]}")
    return out


def _flag(field: str) -> str:
    return field.replace("_", "-")


def describe_shape(shape: dict, params: Optional[int] = None) -> str:
    """One line: ``depth x dim, heads/kv heads, FFN, vocab`` (and the parameter count).

    Example:
      >>> from eae_jax.train.shapes import describe_shape, resolve_shape
      >>> describe_shape(resolve_shape("tiny"), 1234567)
      '4 layers x 64 wide, 4/2 heads, FFN 176, vocab 256 (1.23M params)'
    """
    line = (f"{shape['depth']} layers x {shape['dim']} wide, {shape['num_heads']}/{shape['num_kv_heads']} heads, "
            f"FFN {shape['ffn_hidden_dim']}, vocab {shape['vocab_size']}")
    return line if params is None else f"{line} ({params / 1e6:.2f}M params)"
