"""Greedy decoding with the JAX model and with a torch reference, for checkpoint parity.

The JAX side runs the whole generation as one jitted `jax.lax.fori_loop`
over a fixed-length token buffer: each step applies `eae_jax.models.lm_apply`
to the full buffer and reads the logits at the current position. Causal
attention makes the not-yet-written tail irrelevant, so every step has the
same shapes and nothing recompiles.

The torch side is the plain loop: run the model on the tokens so far, take
the argmax of the last position, append.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.models import lm_apply


class Generation(NamedTuple):
    """Result of a greedy run.

    Attributes:
      tokens: int32 ``(len(prompt) + steps,)``, the prompt then the generated ids.
      logits: float32 ``(steps, V)``, the logits each generated id was chosen from.

    Example:
      >>> import numpy as np
      >>> from interop.generate import Generation
      >>> run = Generation(tokens=np.array([1, 7, 3], np.int32), logits=np.zeros((2, 16), np.float32))
      >>> run.tokens[1:].tolist(), run.logits.shape                  # the prompt [1], then two ids
      ([7, 3], (2, 16))
    """

    tokens: np.ndarray
    logits: np.ndarray


def greedy_generate_jax(params: dict, cfg: Any, prompt: Sequence[int], steps: int) -> Generation:
    """Greedy decoding with the eae_jax LM.

    Args:
      params, cfg: eae_jax LM params and `LMConfig`.
      prompt: at least one token id (e.g. ``[1]``, BOS).
      steps: number of tokens to generate.

    Returns:
      `Generation`; ties in the argmax go to the lowest id (as torch.argmax).

    Raises:
      ValueError: empty prompt, steps < 1, ids out of range, or a total length
        beyond ``cfg.block.max_seq_len``.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from interop.generate import greedy_generate_jax
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=16))
      >>> run = greedy_generate_jax(init_lm(jax.random.key(0), cfg), cfg, prompt=[1, 2], steps=5)
      >>> run.tokens.shape, run.logits.shape, run.tokens[:2].tolist()
      ((7,), (5, 32), [1, 2])
      >>> bool((run.tokens[2:] == run.logits.argmax(-1)).all())     # each id is its row's argmax
      True
    """
    prompt = [int(t) for t in prompt]
    if not prompt or steps < 1:
        raise ValueError(f"need a non-empty prompt and steps >= 1, got prompt={prompt}, steps={steps}")
    if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
        raise ValueError(f"prompt ids must be in [0, {cfg.vocab_size}), got {prompt}")
    total = len(prompt) + steps
    if total > cfg.block.max_seq_len:
        raise ValueError(f"prompt + steps = {total} exceeds the model's max_seq_len {cfg.block.max_seq_len}")
    start = len(prompt)
    buf = jnp.zeros((total,), jnp.int32).at[:start].set(jnp.asarray(prompt, jnp.int32))
    tokens, logits = _greedy_loop(params, buf, cfg=cfg, start=start, steps=steps)
    return Generation(np.asarray(tokens), np.asarray(logits))


@functools.partial(jax.jit, static_argnames=("cfg", "start", "steps"))
def _greedy_loop(params, buf, *, cfg, start, steps):
    """``steps`` greedy steps over the fixed buffer; jit caches one executable per (cfg, start, steps)."""

    def body(i, carry):
        buf, out = carry
        pos = start + i
        logits = lm_apply(params, buf[None], cfg)[0]
        row = jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=0, keepdims=False)
        nxt = jnp.argmax(row).astype(buf.dtype)
        return buf.at[pos].set(nxt), out.at[i].set(row)

    out = jnp.zeros((steps, cfg.vocab_size), jnp.float32)
    return jax.lax.fori_loop(0, steps, body, (buf, out))


def greedy_generate_torch(model: Any, prompt: Sequence[int], steps: int, threads: Optional[int] = 1) -> Generation:
    """Greedy decoding with a torch LM ``model(tokens (1, T)) -> logits (1, T, V)``.

    Accepts `interop.reference.SeedBlockLM` and ``transformers`` causal LMs
    (their output's ``.logits`` is used).

    Args:
      threads: torch intra-op threads while decoding (restored afterwards).
        The default 1 suits small models: each step is a handful of tiny ops,
        and on a busy machine extra threads mostly wait for each other. None
        leaves the setting alone.

    Example:
      >>> import jax, numpy as np
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from interop.generate import greedy_generate_jax, greedy_generate_torch
      >>> from interop.reference import seed_lm_from_params
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=16))
      >>> params = init_lm(jax.random.key(0), cfg)
      >>> torch_run = greedy_generate_torch(seed_lm_from_params(params, cfg), prompt=[1], steps=4)
      >>> torch_run.tokens.shape, torch_run.logits.dtype.name
      ((5,), 'float32')
      >>> np.array_equal(torch_run.tokens, greedy_generate_jax(params, cfg, prompt=[1], steps=4).tokens)
      True
    """
    import torch

    tokens = [int(t) for t in prompt]
    rows = []
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for _ in range(steps):
                out = model(torch.tensor([tokens], dtype=torch.long))
                logits = getattr(out, "logits", out)[0, -1].float()
                rows.append(logits.numpy().copy())
                tokens.append(int(torch.argmax(logits)))
    finally:
        torch.set_num_threads(previous)
    return Generation(np.asarray(tokens, np.int32), np.stack(rows).astype(np.float32))
