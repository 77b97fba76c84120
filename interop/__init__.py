"""PyTorch interop for eae_jax: import/export torch checkpoints, parity against the torch reference.

Needs the torch extra (``pip install 'eae-jax[torch]'``); ``eae_jax`` itself
never imports torch. Formats:

* eae_runtime ``PreNormTransformerBlock`` stacks: `import_seed_blocks`,
  `export_seed_blocks`, `save_seed_blocks`, `seed_state_dict`;
* Hugging Face LLaMA (safetensors / bin + config.json): `load_hf`,
  `import_hf_model`, `import_hf_state_dict`, `save_hf`, `hf_state_dict`,
  `to_transformers`;
* llama2.c (``.pt`` training checkpoints, ``.bin`` v0/v1 exports):
  `load_llama2c`, `import_llama2c_checkpoint`, `save_llama2c_pt`,
  `save_llama2c_bin`, `llama2c_state_dict`;
* any of them by content: `load_checkpoint`.

Parity (`interop.parity`) and greedy generation (`interop.generate`) are
submodules; the CLI is ``eae-jax parity`` / ``python -m interop.cli parity``.
"""

from interop.auto import load_checkpoint
from interop.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    Float64CheckpointError,
    InteropError,
    UnknownFormatError,
    UnsafeCheckpointError,
    UnsupportedConfigError,
)
from interop.hf_llama import (
    hf_config_from_lm,
    hf_state_dict,
    import_hf_model,
    import_hf_state_dict,
    lm_config_from_hf,
    load_hf,
    save_hf,
    to_transformers,
)
from interop.imported import ImportedBlocks, ImportedModel
from interop.llama2c import (
    import_llama2c_checkpoint,
    llama2c_state_dict,
    load_llama2c,
    load_llama2c_bin,
    load_llama2c_pt,
    save_llama2c_bin,
    save_llama2c_pt,
)
from interop.safe_load import detect_format, load_safetensors_file, load_torch_file
from interop.tensors import numpy_to_torch, torch_to_numpy
from interop.torch_blocks import export_seed_blocks, import_seed_blocks, save_seed_blocks, seed_state_dict

__all__ = [
    "CheckpointMismatchError", "CorruptCheckpointError", "Float64CheckpointError", "ImportedBlocks", "ImportedModel", "InteropError",
    "UnknownFormatError", "UnsafeCheckpointError", "UnsupportedConfigError", "detect_format", "export_seed_blocks",
    "hf_config_from_lm", "hf_state_dict", "import_hf_model", "import_hf_state_dict", "import_llama2c_checkpoint",
    "import_seed_blocks", "llama2c_state_dict", "lm_config_from_hf", "load_checkpoint", "load_hf", "load_llama2c",
    "load_llama2c_bin", "load_llama2c_pt", "load_safetensors_file", "load_torch_file", "numpy_to_torch",
    "save_hf", "save_llama2c_bin", "save_llama2c_pt", "save_seed_blocks", "seed_state_dict", "to_transformers",
    "torch_to_numpy",
]
