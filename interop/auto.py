"""`load_checkpoint`: import any supported checkpoint, recognised by its content."""

from __future__ import annotations

import os
from typing import Any, Union

from interop.errors import UnknownFormatError
from interop.imported import ImportedBlocks, ImportedModel
from interop.safe_load import detect_format, load_torch_file


def load_checkpoint(path: str, *, dtype: Any = None, config: Any = None) -> Union[ImportedModel, ImportedBlocks]:
    """Import a checkpoint file or directory into eae_jax params.

    Recognised (by content, not extension):

    * Hugging Face LLaMA directory (config.json + safetensors / bin), or a
      weights file with config.json beside it -> `ImportedModel`;
    * llama2.c ``.bin`` (v0 legacy, v1) and ``.pt`` (``model_args`` + ``model``)
      -> `ImportedModel`;
    * ``.pt`` holding a ModuleList of PreNormTransformerBlock -> `ImportedBlocks`;
      holding its bare state dict -> `ImportedBlocks` (needs ``config``, a
      `BlockConfig`).

    Args:
      path: file or directory.
      dtype: convert every tensor to it; None keeps the stored dtypes.
      config: `BlockConfig` for a bare block-stack state dict.

    Raises:
      UnknownFormatError: none of the above; the message says what was found.
      And the format loaders' errors (CheckpointMismatchError,
      UnsafeCheckpointError, CorruptCheckpointError, UnsupportedConfigError).

    Example:
      >>> import os, tempfile, torch
      >>> from eae_runtime.contrib import PreNormTransformerBlock
      >>> from interop import load_checkpoint
      >>> path = os.path.join(tempfile.mkdtemp(), "blocks.pt")
      >>> torch.save(torch.nn.ModuleList(PreNormTransformerBlock(16, 2, max_seq_len=8) for _ in range(2)), path)
      >>> imported = load_checkpoint(path)
      >>> type(imported).__name__, imported.depth, imported.meta["source"] == path
      ('ImportedBlocks', 2, True)
    """
    fmt = detect_format(path)
    if fmt == "hf_dir" or fmt == "safetensors":
        from interop.hf_llama import load_hf

        return load_hf(path, dtype=dtype)
    if fmt.startswith("llama2c_bin"):
        from interop.llama2c import load_llama2c_bin

        return load_llama2c_bin(path, dtype=dtype)
    if fmt == "torch_pickle":
        obj = load_torch_file(path, allow_modules=True)
        if isinstance(obj, dict) and "model_args" in obj and "model" in obj:
            from interop.llama2c import import_llama2c_checkpoint

            imported = import_llama2c_checkpoint(obj, dtype=dtype, where=path)
            imported.meta["source"] = path
            return imported
        if isinstance(obj, dict) and any(str(k).startswith("model.layers.") for k in obj):
            directory = os.path.dirname(os.path.abspath(path))
            if os.path.isfile(os.path.join(directory, "config.json")):
                from interop.hf_llama import load_hf

                return load_hf(path, dtype=dtype)
            raise UnknownFormatError(f"{path}: a Hugging Face LLaMA state dict needs config.json in {directory}")
        from interop.torch_blocks import import_seed_blocks

        try:
            imported = import_seed_blocks(obj, config, dtype=dtype)
            imported.meta["source"] = path
            return imported
        except UnknownFormatError as err:
            raise UnknownFormatError(
                f"{path}: a torch pickle holding {type(obj).__name__} that is none of: a llama2.c checkpoint "
                f"(model_args + model), a Hugging Face LLaMA state dict, a PreNormTransformerBlock stack ({err})"
            ) from None
    raise UnknownFormatError(f"{path}: format {fmt} has no importer")
