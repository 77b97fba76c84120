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
    """

    params: dict
    config: Any
    meta: Dict[str, Any]
