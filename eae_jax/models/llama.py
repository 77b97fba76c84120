"""A whole LLaMA-style language model: embedding, block stack, final norm, head.

Params are a plain dict::

    {'embed': (V, D),
     'blocks': <stacked block params, leading depth axis>,
     'final_norm': {'scale': (D,)},
     'lm_head': (V, D)}            # absent when cfg.tie_embeddings

`lm_apply` is the plain reference forward; `lm_stack` gives the same model as
an `eae_jax.reconstruct` stack of three segments (embedding, scanned blocks,
head), with `split_params` / `merge_grads` to move between the dict and the
segment list (tied embeddings get the sum of both uses' gradients).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.blocks.linear import linear
from eae_jax.blocks.norm import init_rms_norm, rms_norm
from eae_jax.blocks.transformer import BlockConfig, check_block_params, decoder_block, init_stack, plain_stack
from eae_jax.reconstruct import Scan, reconstruct


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """A decoder-only language model.

    Attributes:
      vocab_size: number of token ids V.
      depth: number of decoder blocks L.
      block: the block configuration (width, heads, RoPE convention ...).
      tie_embeddings: the head reuses the embedding table (llama2.c style).

    Example:
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig
      >>> cfg = LMConfig(vocab_size=16, depth=2, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16))
      >>> cfg.depth, cfg.block.head_dim, cfg.tie_embeddings
      (2, 4, False)
    """

    vocab_size: int
    depth: int
    block: BlockConfig
    tie_embeddings: bool = False

    def __post_init__(self):
        import numbers

        for name in ("vocab_size", "depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"LMConfig {name} must be an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.block, BlockConfig):
            raise TypeError(f"LMConfig block must be a BlockConfig, got {type(self.block).__name__}")

    @property
    def dim(self) -> int:
        return self.block.dim

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        per_block = sum(int(jnp.prod(jnp.asarray(s))) for s in jax.tree_util.tree_leaves(
            self.block.param_shapes(), is_leaf=lambda t: isinstance(t, tuple)))
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.depth * per_block + self.dim + head


def init_lm(key: jax.Array, cfg: LMConfig, dtype=jnp.float32) -> dict:
    """Random params for ``cfg`` (embedding ~ N(0, 1), blocks as `init_stack`).

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> params = init_lm(jax.random.key(0), LMConfig(16, 2, BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16)))
      >>> sorted(params), params["embed"].shape
      (['blocks', 'embed', 'final_norm', 'lm_head'], (16, 8))
      >>> params["blocks"]["attn"]["wq"].shape                       # stacked over the depth
      (2, 8, 8)
    """
    ke, kb, kh = jax.random.split(key, 3)
    params = {
        "embed": jax.random.normal(ke, (cfg.vocab_size, cfg.dim), dtype),
        "blocks": init_stack(kb, cfg.block, cfg.depth, dtype),
        "final_norm": init_rms_norm(cfg.dim, dtype),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = jax.random.normal(kh, (cfg.vocab_size, cfg.dim), dtype) / jnp.sqrt(cfg.dim).astype(dtype)
    return params


def check_lm_params(params: Any, cfg: LMConfig) -> None:
    """Raise ValueError listing every missing, unexpected or mis-shaped entry.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, check_lm_params, init_lm
      >>> cfg = LMConfig(16, 1, BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16))
      >>> check_lm_params(init_lm(jax.random.key(0), cfg), cfg)      # fits: nothing raised
      >>> check_lm_params({"embed": jnp.zeros((4, 8))}, cfg)
      Traceback (most recent call last):
      ...
      ValueError: ...embed...
    """
    if not isinstance(params, dict):
        raise ValueError(f"LM params must be a dict, got {type(params).__name__}")
    want = {"embed", "blocks", "final_norm"} | (set() if cfg.tie_embeddings else {"lm_head"})
    problems = [f"missing {k}" for k in sorted(want - set(params))]
    problems += [f"unexpected {k}" for k in sorted(set(params) - want)]
    def shape_problem(name, value, expected):
        if not hasattr(value, "shape"):
            return f"{name}: expected an array of shape {expected}, got {type(value).__name__}"
        return None if tuple(value.shape) == expected else f"{name}: shape {tuple(value.shape)}, expected {expected}"

    table = (cfg.vocab_size, cfg.dim)
    if "embed" in params:
        problems.append(shape_problem("embed", params["embed"], table))
    if "lm_head" in params and "lm_head" in want:
        problems.append(shape_problem("lm_head", params["lm_head"], table))
    if "final_norm" in params:
        norm = params["final_norm"]
        if not isinstance(norm, dict) or "scale" not in norm:
            problems.append(f"final_norm: expected {{'scale': ({cfg.dim},)}}, got "
                            f"{sorted(norm) if isinstance(norm, dict) else type(norm).__name__}")
        else:
            problems.append(shape_problem("final_norm/scale", norm["scale"], (cfg.dim,)))
    problems = [p for p in problems if p]
    if problems:
        raise ValueError("LM params do not match the config:\n  " + "\n  ".join(problems))
    check_block_params(params["blocks"], cfg.block, leading=(cfg.depth,), where="blocks")


def _check_ids(ids: jax.Array, vocab: int, what: str) -> None:
    """Refuse concrete ids outside ``[0, vocab)`` (traced ids cannot be read:
    under jit an out-of-range id gives NaN rows, which the train step's
    non-finite checks catch)."""
    if isinstance(ids, jax.core.Tracer) or ids.size == 0:
        return
    values = np.asarray(ids)
    low, top = int(values.min()), int(values.max())
    if low < 0 or top >= vocab:
        bad = values[(values < 0) | (values >= vocab)]
        why = " (a negative id would silently wrap around to the end of the vocabulary)" if low < 0 else ""
        raise ValueError(f"{what} must lie in [0, {vocab}), got {sorted(set(bad.tolist()))[:8]}{why}")


def embed(table: jax.Array, tokens: jax.Array, dtype: Optional[Any] = None) -> jax.Array:
    """Look up ``tokens`` (int, ``(batch, seq)``) in ``table`` ``(V, D)`` -> ``(batch, seq, D)``.

    Raises:
      TypeError: non-integer ids.
      ValueError: concrete ids outside ``[0, V)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.models import embed
      >>> table = jnp.arange(6.0).reshape(3, 2)
      >>> embed(table, jnp.array([[2, 0]])).tolist()
      [[[4.0, 5.0], [0.0, 1.0]]]
    """
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"token ids must be integers, got dtype {tokens.dtype}")
    _check_ids(tokens, table.shape[0], "token ids")
    out = jnp.take(table, tokens, axis=0)
    return out if dtype is None else out.astype(dtype)


def head(final_norm: dict, table: jax.Array, x: jax.Array, eps: float) -> jax.Array:
    """Final RMSNorm then ``x @ table.T``; logits in float32 ``(batch, seq, V)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.models import head
      >>> table = jnp.eye(3, 2)                                    # V=3 tokens, D=2
      >>> logits = head({"scale": jnp.ones(2)}, table, jnp.array([[[3.0, 4.0]]]), eps=0.0)
      >>> logits.dtype, [round(v, 4) for v in logits[0, 0].tolist()]    # RMSNorm: (3, 4) / rms 3.5355
      (dtype('float32'), [0.8485, 1.1314, 0.0])
    """
    h = rms_norm(final_norm, x, eps)
    return linear(h, table.astype(h.dtype)).astype(jnp.float32)


def _head_table(params: dict, cfg: LMConfig) -> jax.Array:
    return params["embed"] if cfg.tie_embeddings else params["lm_head"]


def lm_apply(params: dict, tokens: jax.Array, cfg: LMConfig, remat_policy: Any = "none") -> jax.Array:
    """Plain forward: float32 logits ``(batch, seq, V)`` for int tokens ``(batch, seq)``.

    Raises:
      ValueError: params that do not fit ``cfg`` (`check_lm_params`), or
        concrete token ids outside ``[0, V)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm, lm_apply
      >>> cfg = LMConfig(vocab_size=16, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16))
      >>> logits = lm_apply(init_lm(jax.random.key(0), cfg), jnp.zeros((2, 5), jnp.int32), cfg)
      >>> logits.shape, logits.dtype
      ((2, 5, 16), dtype('float32'))
    """
    check_lm_params(params, cfg)
    x = embed(params["embed"], tokens, cfg.block.compute_dtype)
    x = plain_stack(decoder_block(cfg.block), params["blocks"], x, remat_policy)
    return head(params["final_norm"], _head_table(params, cfg), x, cfg.block.norm_eps)


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: Optional[jax.Array] = None) -> jax.Array:
    """Mean token cross-entropy in float32 (``mask`` selects the counted tokens).

    Targets where ``mask`` is 0 may hold anything (an ignore index such as
    -100, a pad id ``>= V``): they are never read into the loss.

    Raises:
      ValueError: concrete targets outside ``[0, V)`` where they count.

    Example:
      >>> import math, jax.numpy as jnp
      >>> from eae_jax.models import cross_entropy
      >>> logits = jnp.zeros((1, 3, 4))                            # uniform over V=4
      >>> round(float(cross_entropy(logits, jnp.array([[0, 1, 3]]))), 6) == round(math.log(4), 6)
      True
      >>> float(cross_entropy(logits, jnp.array([[0, -100, 3]]), mask=jnp.array([[1, 0, 1]])))  # ignored target
      1.3862943649291992
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if mask is None:
        _check_ids(targets, vocab, "targets")
    elif not isinstance(mask, jax.core.Tracer) and not isinstance(targets, jax.core.Tracer):
        _check_ids(targets[np.asarray(mask).astype(bool)], vocab, "unmasked targets")
    logz = jax.nn.logsumexp(logits, axis=-1)
    counted = None if mask is None else mask.astype(bool)
    # Masked-out targets may be out of range (take_along_axis reads NaN there, and NaN * 0 is NaN);
    # counted ones are left as they are, so a traced out-of-range target still shows as NaN.
    safe = targets if counted is None else jnp.where(counted, targets, 0)
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    nll = logz - picked
    if counted is None:
        return jnp.mean(nll)
    return jnp.sum(jnp.where(counted, nll, 0.0)) / jnp.maximum(jnp.sum(counted.astype(jnp.float32)), 1.0)


def lm_stack(cfg: LMConfig, block_fn=None, **reconstruct_kwargs):
    """The LM as a reconstruct stack: ``[embedding, Scan(blocks), head]``.

    Args:
      cfg: the model.
      block_fn: block function to scan (default ``decoder_block(cfg.block)``;
        pass one with fp8 seams, for instance).
      **reconstruct_kwargs: forwarded to `eae_jax.reconstruct` (passes,
        boundary_dtype, policy, offload, stats).

    Returns:
      A `Reconstructed` whose params are ``split_params(params, cfg)`` and
      whose output is float32 logits.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.models import LMConfig, init_lm, lm_apply, lm_stack, split_params
      >>> from eae_jax.blocks import BlockConfig
      >>> cfg, tokens = LMConfig(16, 2, BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16)), jnp.array([[1, 2, 3]])
      >>> params = init_lm(jax.random.key(0), cfg)
      >>> logits = lm_stack(cfg)(split_params(params, cfg), tokens)     # [embedding, Scan(blocks), head]
      >>> bool(jnp.allclose(logits, lm_apply(params, tokens, cfg), atol=1e-5))
      True
    """
    dtype = cfg.block.compute_dtype
    eps = cfg.block.norm_eps

    def embedding(table, tokens):
        return embed(table, tokens, dtype)

    def lm_head(p, x):
        return head(p["final_norm"], p["table"], x, eps)

    return reconstruct(
        [embedding, Scan(block_fn or decoder_block(cfg.block), "decoder_block"), lm_head],
        **reconstruct_kwargs,
    )


def split_params(params: dict, cfg: LMConfig) -> list:
    """Dict params -> the segment list `lm_stack` takes.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm, split_params
      >>> tied = LMConfig(16, 1, BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16), tie_embeddings=True)
      >>> params = init_lm(jax.random.key(0), tied)
      >>> embedding, blocks, head = split_params(params, tied)
      >>> sorted(head), head["table"] is embedding is params["embed"]     # the tied head reads the embedding
      (['final_norm', 'table'], True)
    """
    return [params["embed"], params["blocks"], {"final_norm": params["final_norm"], "table": _head_table(params, cfg)}]


def merge_grads(grads: list, cfg: LMConfig) -> dict:
    """Segment-list gradients -> the dict layout (tied tables summed).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, cross_entropy, init_lm, lm_stack, merge_grads, split_params
      >>> cfg = LMConfig(16, 1, BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16), tie_embeddings=True)
      >>> tokens = jnp.array([[1, 2, 3]])
      >>> loss = lambda segments: cross_entropy(lm_stack(cfg)(segments, tokens[:, :-1]), tokens[:, 1:])
      >>> grads = jax.grad(loss)(split_params(init_lm(jax.random.key(0), cfg), cfg))
      >>> sorted(merge_grads(grads, cfg))                            # the tied head's gradient joins "embed"
      ['blocks', 'embed', 'final_norm']
    """
    g_embed, g_blocks, g_head = grads
    out = {"embed": g_embed, "blocks": g_blocks, "final_norm": g_head["final_norm"]}
    if cfg.tie_embeddings:
        out["embed"] = g_embed + g_head["table"]
    else:
        out["lm_head"] = g_head["table"]
    return out
