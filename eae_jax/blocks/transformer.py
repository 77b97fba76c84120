"""The pre-norm decoder block and stacks of it.

A block is a pure function ``block(params, x) -> x`` on ``(batch, seq, dim)``
arrays; params are plain dicts (see `init_block`). A stack of ``depth``
blocks is the same dict with a leading depth axis on every leaf
(`init_stack`), which is what `eae_jax.reconstruct` scans over.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from eae_jax.blocks.attention import causal_attention, init_attention
from eae_jax.blocks.norm import init_rms_norm, rms_norm
from eae_jax.blocks.rope import ROPE_STYLES, RopeTables, rope_tables
from eae_jax.blocks.swiglu import default_ffn_hidden_dim, init_swiglu, swiglu


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Shape and conventions of one LLaMA-style decoder block.

    Attributes:
      dim: model width D.
      num_heads: query heads H (``dim % num_heads == 0``).
      num_kv_heads: key/value heads (divides ``num_heads``); None means H (MHA).
      ffn_hidden_dim: SwiGLU width F; None applies the seed's rule
        (`default_ffn_hidden_dim` with ``multiple_of``).
      multiple_of: rounding for the default F.
      norm_eps: RMSNorm epsilon (seed: 1e-6; llama2.c and HF LLaMA: 1e-5).
      rope_theta: RoPE base.
      rope_style: ``interleaved`` (seed, llama2.c) or ``half`` (HF LLaMA).
      max_seq_len: RoPE table length; longer sequences raise.
      compute_dtype: dtype the block computes in (params are cast to it);
        None computes in the input's dtype.
      attention_impl: forwarded to `jax.nn.dot_product_attention`
        (None: `default_attention_impl`'s choice; ``'cudnn'`` forces the
        fused GPU kernel).

    Example:
      >>> from eae_jax.blocks import BlockConfig
      >>> cfg = BlockConfig(dim=64, num_heads=8, num_kv_heads=2)
      >>> cfg.head_dim, cfg.ffn_hidden_dim                  # F from the seed's rule
      (8, 256)
      >>> BlockConfig(dim=64, num_heads=6)
      Traceback (most recent call last):
      ...
      ValueError: dim (64) must be divisible by num_heads (6)
    """

    dim: int
    num_heads: int
    num_kv_heads: Optional[int] = None
    ffn_hidden_dim: Optional[int] = None
    multiple_of: int = 256
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_style: str = "interleaved"
    max_seq_len: int = 4096
    compute_dtype: Any = None
    attention_impl: Optional[str] = None

    def __post_init__(self):
        import math
        import numbers

        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        ints = ("dim", "num_heads", "num_kv_heads", "multiple_of", "max_seq_len") + (
            ("ffn_hidden_dim",) if self.ffn_hidden_dim is not None else ())
        for name in ints:  # a float 32.0 fails much later, deep inside init, with a JAX shape error
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"BlockConfig {name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or \
                    value < 0 or (name == "rope_theta" and value <= 1):
                want = "> 1" if name == "rope_theta" else ">= 0"
                raise ValueError(f"BlockConfig {name} must be a finite number {want}, got {value!r}")
        if self.ffn_hidden_dim is None:
            object.__setattr__(self, "ffn_hidden_dim", default_ffn_hidden_dim(self.dim, self.multiple_of))
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got head_dim={self.head_dim} (dim {self.dim} / {self.num_heads} heads)")
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"unknown rope_style {self.rope_style!r}; expected one of {ROPE_STYLES}")
        if self.compute_dtype is not None:
            from eae_jax.dtypes import parse_compute_dtype

            object.__setattr__(self, "compute_dtype", parse_compute_dtype(self.compute_dtype))

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def rope(self, seq_len: int) -> RopeTables:
        """RoPE tables for ``seq_len`` positions (raises past ``max_seq_len``)."""
        return rope_tables(seq_len, self.head_dim, self.rope_theta, self.max_seq_len)

    def param_shapes(self) -> dict:
        """Expected shape of every leaf of one block's params."""
        d, h, kv, hd, f = self.dim, self.num_heads, self.num_kv_heads, self.head_dim, self.ffn_hidden_dim
        return {
            "attn_norm": {"scale": (d,)},
            "attn": {"wq": (h * hd, d), "wk": (kv * hd, d), "wv": (kv * hd, d), "wo": (d, h * hd)},
            "ffn_norm": {"scale": (d,)},
            "ffn": {"w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)},
        }

    def block_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of one block: 2 x matmul params + causal attention.

        Causal attention scores and values: ``2 * 2 * seq * dim / 2`` per token
        (QK^T and PV, half the square masked).
        """
        d, hd, kv, f = self.dim, self.head_dim, self.num_kv_heads, self.ffn_hidden_dim
        matmul_params = d * d + 2 * d * kv * hd + d * d + 3 * d * f
        return 2.0 * matmul_params + 2.0 * seq_len * d


def init_block(key: jax.Array, cfg: BlockConfig, dtype=jnp.float32) -> dict:
    """Params of one block as a plain dict (see `BlockConfig.param_shapes`).

    Linear weights use torch's nn.Linear default init and layout ``(out, in)``;
    norm scales are ones.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig, init_block
      >>> params = init_block(jax.random.key(0), BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32))
      >>> sorted(params), params["ffn"]["w_down"].shape
      (['attn', 'attn_norm', 'ffn', 'ffn_norm'], (16, 32))
    """
    ka, kf = jax.random.split(key)
    return {
        "attn_norm": init_rms_norm(cfg.dim, dtype),
        "attn": init_attention(ka, cfg.dim, cfg.num_heads, cfg.num_kv_heads, dtype),
        "ffn_norm": init_rms_norm(cfg.dim, dtype),
        "ffn": init_swiglu(kf, cfg.dim, cfg.ffn_hidden_dim, dtype),
    }


def init_stack(key: jax.Array, cfg: BlockConfig, depth: int, dtype=jnp.float32) -> dict:
    """Params of ``depth`` blocks with a leading depth axis on every leaf.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig, init_stack
      >>> params = init_stack(jax.random.key(0), BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32), depth=2)
      >>> params["attn"]["wq"].shape
      (2, 16, 16)
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    keys = jax.random.split(key, depth)
    return jax.vmap(lambda k: init_block(k, cfg, dtype))(keys)


def check_block_params(params: Any, cfg: BlockConfig, leading: tuple = (), where: str = "block") -> None:
    """Raise a ValueError listing every missing, unexpected or mis-shaped leaf.

    Args:
      params: the param tree to check.
      cfg: the block configuration it should fit.
      leading: expected leading axes (``(depth,)`` for a stack).
      where: name used in the message.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig, check_block_params, init_stack
      >>> cfg = BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32)
      >>> params = init_stack(jax.random.key(0), cfg, depth=2)
      >>> check_block_params(params, cfg, leading=(2,))             # fits: returns None
      >>> del params["ffn"]["w_up"]
      >>> check_block_params(params, cfg, leading=(3,), where="stack")
      Traceback (most recent call last):
      ...
      ValueError: stack params do not match BlockConfig(dim=16, ...):
        attn_norm/scale: shape (2, 16), expected (3, 16)
      ...
        missing ffn/w_up
      ...
    """
    expected = cfg.param_shapes()
    problems = []

    def walk(exp, got, path):
        if isinstance(exp, dict):
            if not isinstance(got, dict):
                problems.append(f"{path or '<root>'}: expected a dict, got {type(got).__name__}")
                return
            for k in exp:
                if k not in got:
                    problems.append(f"missing {path + '/' + k if path else k}")
                else:
                    walk(exp[k], got[k], f"{path}/{k}" if path else k)
            for k in got:
                if k not in exp:
                    problems.append(f"unexpected {path + '/' + k if path else k}")
        else:
            shape = tuple(getattr(got, "shape", ()))
            want = tuple(leading) + tuple(exp)
            if shape != want:
                problems.append(f"{path}: shape {shape}, expected {want}")

    walk(expected, params, "")
    if problems:
        raise ValueError(f"{where} params do not match {cfg}:\n  " + "\n  ".join(problems))


def decoder_block(
    cfg: BlockConfig,
    *,
    ffn_fn: Optional[Callable[[dict, jax.Array], jax.Array]] = None,
    attention_fn: Optional[Callable[..., jax.Array]] = None,
) -> Callable[[dict, jax.Array], jax.Array]:
    """Build the pure pre-norm block function for ``cfg``.

    The returned ``block(params, x)`` computes::

        x = x + attention(rms_norm(x))
        x = x + ffn(rms_norm(x))

    on ``x`` of shape ``(batch, seq, dim)`` and returns the same shape and
    dtype (``cfg.compute_dtype`` when set: the input and params are cast to
    it first). RoPE tables are computed inside, once per call; XLA hoists
    them out of a scan over depth.

    Args:
      cfg: the block configuration.
      ffn_fn: replacement for the SwiGLU FFN, ``ffn_fn(ffn_params, h)`` (an
        fp8 seam, for instance). Default `swiglu`.
      attention_fn: replacement for `causal_attention` with the same keyword
        signature.

    Raises (when called):
      ValueError: wrong input rank or width, sequence longer than
        ``cfg.max_seq_len``, or (default FFN and attention) params that do
        not fit ``cfg`` (`check_block_params`, every problem listed).
      TypeError: a non-floating input.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig, decoder_block, init_block
      >>> cfg = BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32)
      >>> block = decoder_block(cfg)                     # pure: block(params, x)
      >>> x = jax.random.normal(jax.random.key(1), (2, 5, 16))
      >>> jax.jit(block)(init_block(jax.random.key(0), cfg), x).shape
      (2, 5, 16)
    """
    ffn = ffn_fn or swiglu
    attention = attention_fn or causal_attention

    def block(params: dict, x: jax.Array) -> jax.Array:
        if x.ndim != 3 or x.shape[-1] != cfg.dim:
            raise ValueError(f"decoder block expects input (batch, seq, {cfg.dim}), got shape {x.shape}")
        if ffn_fn is None and attention_fn is None:  # replacements may take params of their own form
            check_block_params(params, cfg)
        if cfg.compute_dtype is not None:
            x = x.astype(cfg.compute_dtype)
            params = jax.tree_util.tree_map(
                lambda p: p.astype(cfg.compute_dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params
            )
        rope = cfg.rope(x.shape[1])
        h = rms_norm(params["attn_norm"], x, cfg.norm_eps)
        x = x + attention(
            params["attn"], h,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            rope=rope, rope_style=cfg.rope_style, implementation=cfg.attention_impl,
        ).astype(x.dtype)
        h = rms_norm(params["ffn_norm"], x, cfg.norm_eps)
        return x + ffn(params["ffn"], h).astype(x.dtype)

    block.__name__ = f"decoder_block_d{cfg.dim}_h{cfg.num_heads}_kv{cfg.num_kv_heads}"
    return block


def plain_stack(block_fn: Callable, params: Any, x: jax.Array, remat_policy: Any = "none") -> jax.Array:
    """Reference: apply a stacked block with `jax.lax.scan` and ordinary autodiff.

    Args:
      block_fn: ``block_fn(params_i, x) -> x``.
      params: stacked params (leading depth axis).
      x: input.
      remat_policy: ``'none'`` (store every internal, J-plain), or a
        `jax.checkpoint_policies` policy or one of `eae_jax.reconstruct`'s
        policy names (``'boundaries'``, ``'dots'``, ...) (J-remat).

    Raises:
      ValueError: an unknown policy name.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import BlockConfig, decoder_block, init_stack, plain_stack
      >>> cfg = BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32)
      >>> block, params = decoder_block(cfg), init_stack(jax.random.key(0), cfg, depth=2)
      >>> x = jax.random.normal(jax.random.key(1), (1, 4, 16))
      >>> y = jax.jit(plain_stack, static_argnums=0)(block, params, x)
      >>> one_block = jax.jit(block)                                      # the same, block by block:
      >>> h = one_block(jax.tree_util.tree_map(lambda p: p[0], params), x)
      >>> h = one_block(jax.tree_util.tree_map(lambda p: p[1], params), h)
      >>> bool(jnp.allclose(y, h, atol=1e-5))
      True
    """
    if isinstance(remat_policy, str) and remat_policy == "none":
        fn = block_fn
    else:
        from eae_jax.reconstruct import resolve_policy  # reconstruct builds on blocks

        fn = jax.checkpoint(block_fn, policy=resolve_policy(remat_policy))

    def body(h, p):
        return fn(p, h), None

    out, _ = jax.lax.scan(body, x, params)
    return out
