"""A torch reference language model built from the seed's blocks.

`SeedBlockLM` is token embedding -> ``eae_runtime.contrib.PreNormTransformerBlock``
stack -> the seed's ``RMSNorm`` -> output projection (tied or not). It is
the torch side of the whole-model parity checks for checkpoints whose
architecture the seed block implements (interleaved RoPE: llama2.c, the
seed's own stacks). Everything in it is the seed's torch code except the
embedding lookup and the final matmul, which are one torch op each.
"""

from __future__ import annotations

from typing import Any, Mapping

from interop.errors import UnsupportedConfigError
from interop.tensors import numpy_to_torch, require_torch
from interop.torch_blocks import export_seed_blocks

torch = require_torch()
nn = torch.nn


class SeedBlockLM(nn.Module):
    """Embedding, PreNormTransformerBlock stack, RMSNorm, head; ``forward(tokens) -> float32 logits``.

    Attributes:
      embed: ``nn.Embedding(V, D)``.
      blocks: ``nn.ModuleList`` of PreNormTransformerBlock.
      norm: the seed's RMSNorm with the model's eps.
      head: ``nn.Linear(D, V, bias=False)``, or None when tied to ``embed``.

    Example:
      >>> import torch
      >>> from eae_runtime.contrib import PreNormTransformerBlock, RMSNorm
      >>> from interop.reference import SeedBlockLM
      >>> blocks = torch.nn.ModuleList([PreNormTransformerBlock(8, 2, max_seq_len=16)])
      >>> lm = SeedBlockLM(torch.nn.Embedding(32, 8), blocks, RMSNorm(8))      # tied head
      >>> lm(torch.tensor([[1, 2, 3]])).shape
      torch.Size([1, 3, 32])
    """

    def __init__(self, embed, blocks, norm, head=None):
        super().__init__()
        self.embed = embed
        self.blocks = blocks
        self.norm = norm
        self.head = head

    def head_weight(self):
        return self.embed.weight if self.head is None else self.head.weight

    def logits(self, x):
        """Final norm and output projection of the last boundary ``x``: float32 ``(B, S, V)``."""
        h = self.norm(x)
        return torch.nn.functional.linear(h, self.head_weight().to(h.dtype)).float()

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.logits(x)


def seed_lm_from_params(params: Mapping[str, Any], cfg) -> SeedBlockLM:
    """Build a `SeedBlockLM` holding eae_jax LM params bit for bit.

    Args:
      params: eae_jax LM params.
      cfg: `eae_jax.models.LMConfig` (interleaved RoPE).

    Raises:
      UnsupportedConfigError: ``rope_style='half'`` (use the Hugging Face model instead).
      ValueError: params do not match ``cfg``.

    Example:
      >>> import jax, numpy as np, torch
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm, lm_apply
      >>> from interop.reference import seed_lm_from_params
      >>> cfg = LMConfig(vocab_size=32, depth=2, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=16))
      >>> params = init_lm(jax.random.key(0), cfg)
      >>> tokens = np.array([[1, 5, 7]])
      >>> with torch.no_grad():
      ...     torch_logits = seed_lm_from_params(params, cfg)(torch.from_numpy(tokens)).numpy()
      >>> bool(np.allclose(torch_logits, lm_apply(params, tokens, cfg), atol=1e-5))
      True
    """
    from eae_runtime.contrib import RMSNorm

    from eae_jax.models import check_lm_params

    if cfg.block.rope_style != "interleaved":
        raise UnsupportedConfigError("the seed reference blocks implement interleaved RoPE only")
    check_lm_params(params, cfg)
    blocks = export_seed_blocks(params["blocks"], cfg.block)
    embed = nn.Embedding(cfg.vocab_size, cfg.dim)
    embed.weight = nn.Parameter(numpy_to_torch(params["embed"]))
    norm = RMSNorm(cfg.dim, eps=cfg.block.norm_eps)
    norm.weight = nn.Parameter(numpy_to_torch(params["final_norm"]["scale"]))
    head = None
    if not cfg.tie_embeddings:
        head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head.weight = nn.Parameter(numpy_to_torch(params["lm_head"]))
    return SeedBlockLM(embed, blocks, norm, head).eval()
