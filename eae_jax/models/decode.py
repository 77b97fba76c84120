"""Autoregressive generation with a KV cache: a prefill, then a fixed-shape decode step.

The cache holds every layer's rotated keys and values for a fixed number of
positions, preallocated (`init_cache`). `forward_cached` runs the model on
new tokens at a (traced) position: it writes their keys and values into the
cache and attends over the whole cache with a mask that hides the positions
not yet written, so the shapes never depend on how many tokens came before.
`decode_step` (one token) therefore compiles once for a model, a sampling
setting and a cache shape, and is reused for every token; `prefill` compiles
once per prompt length.

`stream` yields the ids one at a time as they are decoded (the next step is
dispatched before the current id is read, so the host and the device overlap);
`generate` collects them. With ``Sampling(temperature=0)`` the ids are the
greedy ones `interop.generate.greedy_generate_jax` computes by rerunning the
whole sequence every step.

The token drawn for position ``t`` uses the key ``jax.random.fold_in(key, t)``:
a seed fixes the whole run, whatever the prompt length or the number of steps.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.blocks.linear import linear
from eae_jax.blocks.norm import rms_norm
from eae_jax.blocks.rope import RopeTables, apply_rope
from eae_jax.blocks.swiglu import swiglu
from eae_jax.models.llama import LMConfig, check_lm_params, embed, head
from eae_jax.models.sampling import Sampling, sample_tokens

#: Greedy decoding (temperature 0).
GREEDY = Sampling(temperature=0.0)


class KVCache(NamedTuple):
    """Every layer's keys and values: ``k`` and ``v`` are ``(depth, batch, length, kv_heads, head_dim)``.

    Keys are stored rotated (RoPE applied), in the model's compute dtype.

    Example:
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig
      >>> from eae_jax.models.decode import init_cache
      >>> cfg = LMConfig(vocab_size=32, depth=2, block=BlockConfig(dim=8, num_heads=2, num_kv_heads=1, ffn_hidden_dim=16))
      >>> cache = init_cache(cfg, batch=1, length=10)
      >>> cache.k.shape, cache.length
      ((2, 1, 10, 1, 4), 10)
    """

    k: jax.Array
    v: jax.Array

    @property
    def length(self) -> int:
        """Number of positions the cache holds."""
        return int(self.k.shape[2])


class Generated(NamedTuple):
    """The result of `generate`.

    Attributes:
      tokens: int32 ``(len(prompt) + steps,)``: the prompt, then the generated ids.
      logits: float32 ``(steps, V)``, the logits each generated id was drawn
        from (before temperature and filtering), or None when not asked for.

    Example:
      >>> import numpy as np
      >>> from eae_jax.models.decode import Generated
      >>> Generated(np.array([1, 5, 6], np.int32), None).tokens[1:].tolist()
      [5, 6]
    """

    tokens: np.ndarray
    logits: Optional[np.ndarray]


def init_cache(cfg: LMConfig, batch: int, length: int, dtype: Any = None) -> KVCache:
    """A zeroed cache for ``batch`` sequences of up to ``length`` positions.

    Args:
      cfg: the model.
      batch, length: ``length`` at most ``cfg.block.max_seq_len`` (the RoPE table length).
      dtype: the stored dtype; default the compute dtype, else float32.

    Raises:
      ValueError: ``batch`` or ``length`` below 1, or ``length`` past ``max_seq_len``.

    Example:
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig
      >>> from eae_jax.models.decode import init_cache
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=16))
      >>> init_cache(cfg, batch=2, length=16).v.dtype.name
      'float32'
      >>> init_cache(cfg, batch=1, length=17)
      Traceback (most recent call last):
      ...
      ValueError: a cache of 17 positions is longer than the model's max_seq_len 16
    """
    b = cfg.block
    for name, value in (("batch", batch), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"cache {name} must be an int >= 1, got {value!r}")
    if length > b.max_seq_len:
        raise ValueError(f"a cache of {length} positions is longer than the model's max_seq_len {b.max_seq_len}")
    dtype = dtype or b.compute_dtype or jnp.float32
    shape = (cfg.depth, int(batch), int(length), b.num_kv_heads, b.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _cached_block(bcfg, params: dict, x: jax.Array, k_all: jax.Array, v_all: jax.Array, layer, pos: jax.Array,
                  tables: RopeTables, visible: jax.Array):
    """One decoder block (as `eae_jax.blocks.decoder_block`) on ``x`` at positions ``pos..pos+S-1``.

    Writes the new keys and values into layer ``layer`` of the whole cache
    (``k_all``, ``v_all``: ``(depth, batch, length, kv_heads, head_dim)``),
    which the layer scan carries: XLA updates the donated buffers in place.
    ``tables`` are the RoPE rows of these positions; ``visible`` (S, length)
    masks the positions not yet written.
    """
    if bcfg.compute_dtype is not None:
        x = x.astype(bcfg.compute_dtype)
        params = jax.tree_util.tree_map(
            lambda p: p.astype(bcfg.compute_dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = bcfg.num_heads, bcfg.num_kv_heads, bcfg.head_dim
    attn = params["attn"]
    h = rms_norm(params["attn_norm"], x, bcfg.norm_eps)
    q = linear(h, attn["wq"]).reshape(batch, seq, heads, head_dim)
    k = linear(h, attn["wk"]).reshape(batch, seq, kv_heads, head_dim)
    v = linear(h, attn["wv"]).reshape(batch, seq, kv_heads, head_dim)
    q = apply_rope(q, tables, bcfg.rope_style)
    k = apply_rope(k, tables, bcfg.rope_style)
    zero = jnp.zeros((), jnp.int32)
    k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), (layer, zero, pos, zero, zero))
    v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), (layer, zero, pos, zero, zero))
    k_layer = jax.lax.dynamic_index_in_dim(k_all, layer, 0, keepdims=False)
    v_layer = jax.lax.dynamic_index_in_dim(v_all, layer, 0, keepdims=False)
    out = jax.nn.dot_product_attention(q, k_layer.astype(q.dtype), v_layer.astype(q.dtype),
                                       mask=visible[None, None], implementation="xla")
    x = x + linear(out.reshape(batch, seq, heads * head_dim), attn["wo"]).astype(x.dtype)
    h = rms_norm(params["ffn_norm"], x, bcfg.norm_eps)
    return x + swiglu(params["ffn"], h).astype(x.dtype), k_all, v_all


def forward_cached(params: dict, tokens: jax.Array, cache: KVCache, pos: Any, cfg: LMConfig):
    """Run the model on ``tokens`` ``(batch, S)`` placed at positions ``pos..pos+S-1``.

    Their keys and values are written into ``cache``; each token attends to
    the cached positions before it and to itself. Not jitted (see `prefill`
    and `decode_step`); ``pos`` may be traced, but ``pos + S`` must not pass
    ``cache.length`` (checked here when ``pos`` is concrete).

    Returns:
      ``(logits, cache)``: float32 ``(batch, S, V)`` and the updated cache.

    Raises:
      ValueError: params that do not fit ``cfg``, a cache of another model or
        batch, or positions past the cache.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm, lm_apply
      >>> from eae_jax.models.decode import forward_cached, init_cache
      >>> cfg = LMConfig(vocab_size=32, depth=2, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=8))
      >>> params, tokens = init_lm(jax.random.key(0), cfg), jnp.array([[1, 4, 9, 2]])
      >>> cache = init_cache(cfg, batch=1, length=8)
      >>> first, cache = forward_cached(params, tokens[:, :3], cache, 0, cfg)   # a prompt of three
      >>> last, cache = forward_cached(params, tokens[:, 3:], cache, 3, cfg)    # then one more token
      >>> full = lm_apply(params, tokens, cfg)
      >>> bool(jnp.allclose(jnp.concatenate([first, last], axis=1), full, atol=1e-5))
      True
    """
    check_lm_params(params, cfg)
    b = cfg.block
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (batch, seq), got shape {tokens.shape}")
    want = (cfg.depth, tokens.shape[0], cache.length, b.num_kv_heads, b.head_dim)
    if tuple(cache.k.shape) != want or tuple(cache.v.shape) != want:
        raise ValueError(f"cache of shape {tuple(cache.k.shape)} does not fit this model and batch: expected "
                         f"(depth, batch, length, kv_heads, head_dim) = {want}")
    seq = tokens.shape[1]
    if not isinstance(pos, jax.core.Tracer) and not 0 <= int(pos) <= cache.length - seq:
        raise ValueError(f"{seq} token(s) at position {int(pos)} do not fit a cache of {cache.length} positions")
    pos = jnp.asarray(pos, jnp.int32)
    rope = b.rope(cache.length)
    x = embed(params["embed"], tokens, b.compute_dtype)
    tables = RopeTables(jax.lax.dynamic_slice_in_dim(rope.cos, pos, seq),
                        jax.lax.dynamic_slice_in_dim(rope.sin, pos, seq))
    # Query i (at pos + i) sees the keys at positions <= pos + i; the unwritten tail is masked out.
    visible = jnp.arange(cache.length)[None, :] <= (pos + jnp.arange(seq))[:, None]

    def layer(carry, inputs):
        x, k_all, v_all = carry
        p, index = inputs
        return _cached_block(b, p, x, k_all, v_all, index, pos, tables, visible), None

    layers = jnp.arange(cfg.depth, dtype=jnp.int32)
    (x, k, v), _ = jax.lax.scan(layer, (x, cache.k, cache.v), (params["blocks"], layers))
    table = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    return head(params["final_norm"], table, x, b.norm_eps), KVCache(k, v)


def _flag_nonfinite(ids: jax.Array, rows: jax.Array) -> jax.Array:
    """``ids`` with -1 where the logits they came from hold a NaN or an infinity (found with the id, no extra sync)."""
    return jnp.where(jnp.all(jnp.isfinite(rows), axis=-1), ids, -1)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def prefill(params: dict, tokens: jax.Array, cache: KVCache, key: jax.Array, *, cfg: LMConfig,
            sampling: Sampling):
    """Run the prompt ``tokens`` ``(batch, P)`` from position 0 and draw the next id.

    Jitted (one compilation per prompt length); ``cache`` is donated.
    ``sampling`` is a required keyword: jit keys its cache on the keywords
    passed, so a defaulted one would compile a second time.

    Returns:
      ``(next_ids (batch,), logits (batch, V), cache)``: the id drawn for
      position P (key ``fold_in(key, P)``; -1 where the logits are not
      finite) and the logits it was drawn from.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm, lm_apply
      >>> from eae_jax.models.decode import GREEDY, init_cache, prefill
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=8))
      >>> params, prompt = init_lm(jax.random.key(0), cfg), jnp.array([[1, 2, 3]])
      >>> nxt, logits, cache = prefill(params, prompt, init_cache(cfg, 1, 8), jax.random.key(0), cfg=cfg, sampling=GREEDY)
      >>> int(nxt[0]) == int(jnp.argmax(lm_apply(params, prompt, cfg)[0, -1]))
      True
    """
    logits, cache = forward_cached(params, tokens, cache, 0, cfg)
    row = logits[:, -1]
    position = tokens.shape[1]
    return _flag_nonfinite(sample_tokens(jax.random.fold_in(key, position), row, sampling), row), row, cache


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def decode_step(params: dict, ids: jax.Array, pos: jax.Array, cache: KVCache, key: jax.Array, *, cfg: LMConfig,
                sampling: Sampling):
    """Feed ``ids`` ``(batch,)`` at position ``pos`` and draw the ids for ``pos + 1``.

    Jitted with fixed shapes: ``pos`` is traced, so every token reuses one
    compilation (per ``cfg``, ``sampling`` and cache shape; ``sampling`` is
    a required keyword, as in `prefill`). ``cache`` is donated. ``pos + 1`` must not pass ``cache.length`` (callers check it:
    a traced position cannot be).

    Returns:
      ``(next_ids (batch,), logits (batch, V), cache)``; an id is -1 where
      its logits are not finite.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from eae_jax.models.decode import GREEDY, decode_step, init_cache, prefill
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=8))
      >>> params, key = init_lm(jax.random.key(0), cfg), jax.random.key(1)
      >>> ids, _, cache = prefill(params, jnp.array([[1]]), init_cache(cfg, 1, 8), key, cfg=cfg, sampling=GREEDY)
      >>> for pos in range(1, 4):
      ...     ids, logits, cache = decode_step(params, ids, pos, cache, key, cfg=cfg, sampling=GREEDY)
      >>> ids.shape, logits.shape
      ((1,), (1, 32))
    """
    logits, cache = forward_cached(params, ids[:, None], cache, pos, cfg)
    row = logits[:, 0]
    return _flag_nonfinite(sample_tokens(jax.random.fold_in(key, pos + 1), row, sampling), row), row, cache


def _check_request(cfg: LMConfig, prompt: Sequence[int], steps: int, sampling: Sampling, key: Any,
                   cache_len: Optional[int]) -> tuple:
    """Validate a generation request; returns ``(prompt ids, cache length)``."""
    if not isinstance(cfg, LMConfig):
        raise TypeError(f"cfg must be an LMConfig, got {type(cfg).__name__}")
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling, got {type(sampling).__name__}")
    array = np.asarray(prompt)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"the prompt must be a non-empty 1-D sequence of token ids, got {prompt!r}")
    if array.dtype.kind not in "iu":
        raise ValueError(f"prompt ids must be integers, got {array.dtype} values {array.tolist()[:8]}")
    ids = [int(t) for t in array]
    bad = sorted({t for t in ids if not 0 <= t < cfg.vocab_size})
    if bad:
        raise ValueError(f"prompt ids must lie in [0, {cfg.vocab_size}), got {bad[:8]}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    total = len(ids) + int(steps)
    if total > cfg.block.max_seq_len:
        raise ValueError(f"prompt ({len(ids)}) + steps ({steps}) = {total} exceeds the model's max_seq_len "
                         f"{cfg.block.max_seq_len}")
    length = total if cache_len is None else int(cache_len)
    if length < total:
        raise ValueError(f"cache_len {cache_len} is shorter than prompt + steps = {total}")
    if not sampling.greedy and key is None:
        raise ValueError("sampling at a temperature > 0 needs a PRNG key (e.g. jax.random.key(seed))")
    return ids, length


def stream(params: dict, cfg: LMConfig, prompt: Sequence[int], steps: int, *, sampling: Sampling = GREEDY,
           key: Optional[jax.Array] = None, cache_len: Optional[int] = None, logits_out: Optional[list] = None
           ) -> Iterator[int]:
    """Yield ``steps`` generated ids one by one, each as soon as it is decoded.

    Args:
      params, cfg: the model (`eae_jax.models` params and `LMConfig`).
      prompt: at least one id (e.g. ``[bos]``).
      steps: how many ids to generate; ``len(prompt) + steps`` may not pass
        ``cfg.block.max_seq_len``.
      sampling: `Sampling` settings (default greedy).
      key: PRNG key, needed unless greedy.
      cache_len: cache positions (default ``len(prompt) + steps``); a fixed
        value lets requests of other lengths share the compiled step.
      logits_out: a list that receives each step's logits row (a device
        array ``(V,)``), when given.

    Raises:
      ValueError: a bad prompt, steps, cache length, or no key for sampling
        (when called, before any work).
      FloatingPointError: the model gave non-finite logits (raised when that
        step's id is due; the ids before it were yielded).

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from eae_jax.models.decode import stream
      >>> from eae_jax.models.sampling import Sampling
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=16))
      >>> params = init_lm(jax.random.key(0), cfg)
      >>> ids = list(stream(params, cfg, [1, 2], 5, sampling=Sampling(temperature=1.0, top_p=0.9), key=jax.random.key(7)))
      >>> len(ids), all(0 <= i < 32 for i in ids)
      (5, True)
    """
    ids, length = _check_request(cfg, prompt, steps, sampling, key, cache_len)  # now, not at the first next()
    key = jax.random.key(0) if key is None else key  # unused when greedy
    return _decode_ids(params, cfg, ids, int(steps), sampling, key, length, logits_out)


def _decode_ids(params, cfg, ids, steps, sampling, key, length, logits_out) -> Iterator[int]:
    """The generator behind `stream`, on a checked request."""
    cache = init_cache(cfg, 1, length, params_dtype(params, cfg))
    current, row, cache = prefill(params, jnp.asarray([ids], jnp.int32), cache, key, cfg=cfg, sampling=sampling)
    pos = len(ids)
    for i in range(steps):
        if logits_out is not None:
            logits_out.append(row[0])
        if i + 1 < steps:  # dispatch the next step before reading this id: the device keeps working
            upcoming, row, cache = decode_step(params, current, pos, cache, key, cfg=cfg, sampling=sampling)
            pos += 1
        value = int(np.asarray(current)[0])
        if value < 0:
            raise FloatingPointError(f"the model's logits for position {len(ids) + i} are not finite (NaN or inf)")
        yield value
        if i + 1 < steps:
            current = upcoming


def params_dtype(params: dict, cfg: LMConfig):
    """The dtype activations (and so the cache) have: the compute dtype, else the embedding's.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from eae_jax.models.decode import params_dtype
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16))
      >>> params_dtype(init_lm(jax.random.key(0), cfg, jnp.bfloat16), cfg).name
      'bfloat16'
    """
    return jnp.dtype(cfg.block.compute_dtype or params["embed"].dtype)


def generate(params: dict, cfg: LMConfig, prompt: Sequence[int], steps: int, *, sampling: Sampling = GREEDY,
             key: Optional[jax.Array] = None, cache_len: Optional[int] = None,
             return_logits: bool = False) -> Generated:
    """Generate ``steps`` ids after ``prompt`` (see `stream`); returns a `Generated`.

    Example:
      >>> import jax, numpy as np
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from eae_jax.models.decode import generate
      >>> from interop.generate import greedy_generate_jax                 # recomputes every step
      >>> cfg = LMConfig(vocab_size=32, depth=2, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=32))
      >>> params = init_lm(jax.random.key(0), cfg)
      >>> run = generate(params, cfg, [1, 2], 20, return_logits=True)
      >>> run.tokens.shape, run.logits.shape
      ((22,), (20, 32))
      >>> np.array_equal(run.tokens, greedy_generate_jax(params, cfg, [1, 2], 20).tokens)
      True
    """
    rows: Optional[list] = [] if return_logits else None
    ids = list(stream(params, cfg, prompt, steps, sampling=sampling, key=key, cache_len=cache_len, logits_out=rows))
    tokens = np.asarray([int(t) for t in np.asarray(prompt).reshape(-1)] + ids, np.int32)
    logits = np.asarray(jnp.stack(rows), np.float32) if return_logits else None
    return Generated(tokens, logits)
