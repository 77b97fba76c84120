"""What the importers return."""

from __future__ import annotations

from typing import Any, Dict, NamedTuple


class ImportedBlocks(NamedTuple):
    """A block stack brought over from torch.

    Attributes:
      params: stacked eae_jax block params (leading depth axis), dtypes as
        stored unless a conversion was asked for.
      config: the `eae_jax.blocks.BlockConfig` read from the source.
      depth: number of blocks.
      meta: provenance (``format``, ``source``, dtypes seen ...).

    Example:
      >>> import torch
      >>> from eae_runtime.contrib import PreNormTransformerBlock
      >>> from interop import import_seed_blocks
      >>> imported = import_seed_blocks(torch.nn.ModuleList([PreNormTransformerBlock(16, 2, max_seq_len=8)]))
      >>> imported.depth, imported.config.dim, imported.params["attn"]["wq"].shape, imported.meta["format"]
      (1, 16, (1, 16, 16), 'eae_runtime_blocks')
    """

    params: dict
    config: Any
    depth: int
    meta: Dict[str, Any]


class ImportedModel(NamedTuple):
    """A whole language model brought over from torch.

    Attributes:
      params: eae_jax LM params (``embed``, ``blocks``, ``final_norm`` and,
        when untied, ``lm_head``), see `eae_jax.models.llama`.
      config: its `eae_jax.models.LMConfig`.
      meta: provenance and what an exporter needs to write the source back
        bit for bit (the original config dict, llama2.c's stored RoPE
        tables ...).

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop import load_llama2c, save_llama2c_bin
      >>> from interop.llama2c import lm_config_from_model_args
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> path = os.path.join(tempfile.mkdtemp(), "tiny.bin")
      >>> save_llama2c_bin(path, init_lm(jax.random.key(0), cfg), cfg)
      >>> model = load_llama2c(path)
      >>> sorted(model.params), model.config.vocab_size, model.meta["format"]
      (['blocks', 'embed', 'final_norm'], 32, 'llama2c_bin_v0')
    """

    params: dict
    config: Any
    meta: Dict[str, Any]
