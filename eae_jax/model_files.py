"""Language models from files: training runs, llama2.c and Hugging Face checkpoints.

`load_model` is what ``eae-jax generate`` and ``eae-jax export`` read:

* a training run (``eae-jax train --out DIR``): the run directory, its
  ``checkpoints`` folder (the newest checkpoint is taken) or one
  ``ckpt_<step>`` (an older run's ``ckpt_*.npz`` too). `read_run_checkpoint`
  is the one place that reads the training checkpoint format
  (`eae_jax.train.checkpoint`);
* anything `interop.load_checkpoint` imports: a llama2.c ``.bin`` (no torch
  needed), a llama2.c ``.pt``, a Hugging Face directory (these need the
  torch extra: `TorchRequired` says so before any work).

The tokenizer comes from ``tokenizer=`` when given, else from the run
directory or the checkpoint's folder (`eae_jax.text.find_tokenizer`), else
there is none and the model speaks in ids.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

from eae_jax.models.llama import LMConfig
from eae_jax.text.tokenizer import Tokenizer, find_tokenizer, load_tokenizer

#: interop formats that need torch to be read (safetensors are read through safetensors.torch).
TORCH_FORMATS = ("torch_pickle", "safetensors", "hf_dir")


class TorchRequired(ImportError):
    """A checkpoint format that needs the torch extra, which is not installed.

    Example:
      >>> from eae_jax.model_files import TORCH_FORMATS, TorchRequired
      >>> issubclass(TorchRequired, ImportError), "hf_dir" in TORCH_FORMATS
      (True, True)
    """


class LoadedModel(NamedTuple):
    """A language model ready to run.

    Attributes:
      params: `eae_jax.models` LM params.
      config: its `LMConfig`.
      tokenizer: a `eae_jax.text.Tokenizer`, or None (ids only).
      meta: ``format`` (``'eae_run'``, ``'llama2c_bin_v0'``, ``'hf_llama'``
        ...), ``source`` (the file read), ``bos_id`` (the id prompts start
        with, or None), and for runs ``step`` and ``run_dir``.

    Example:
      >>> from eae_jax.model_files import LoadedModel
      >>> LoadedModel({}, None, None, {"format": "eae_run"}).meta["format"]
      'eae_run'
    """

    params: dict
    config: LMConfig
    tokenizer: Optional[Tokenizer]
    meta: dict


def find_run_checkpoint(path: str) -> Optional[str]:
    """The newest training checkpoint ``path`` designates (a run directory, its
    ``checkpoints`` folder, one checkpoint ``ckpt_<step>`` or an older run's
    ``ckpt_*.npz``), or None when it is none of these.

    Example:
      >>> import tempfile
      >>> from eae_jax.model_files import find_run_checkpoint
      >>> find_run_checkpoint(tempfile.mkdtemp()) is None
      True
    """
    from eae_jax.train import checkpoint as ckpt

    if ckpt.is_checkpoint(path) and os.path.exists(path):
        return path
    if not os.path.isdir(path):
        return None
    for directory in (os.path.join(path, "checkpoints"), path):
        newest = ckpt.latest(directory)
        if newest:
            return newest
    return None


def _state_template(train_cfg):
    """The structure and shapes of a run's saved training state, without computing it where possible."""
    import jax
    import numpy as np

    from eae_jax.train import loop

    if train_cfg.fp8:  # the fp8 seams calibrate on concrete values: build the state for real
        return loop.build(train_cfg)[4]
    template = jax.eval_shape(lambda: loop.build(train_cfg)[4])

    def concrete_key(leaf):  # the checkpoint reader rebuilds typed keys from a real key's impl
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            count = int(np.prod(leaf.shape))
            return jax.random.split(jax.random.key(0), count).reshape(leaf.shape) if leaf.shape else jax.random.key(0)
        return leaf

    return jax.tree_util.tree_map(concrete_key, template)


def read_run_checkpoint(path: str) -> tuple:
    """``(params, LMConfig, meta)`` of a training checkpoint file.

    The one call site of the training checkpoint reader: the run's
    `eae_jax.train.TrainConfig` (stored in the checkpoint) gives the model
    and the state's structure, and the params are taken from the state.

    Raises:
      eae_jax.train.CheckpointError: an unreadable checkpoint, or one whose
        stored config this version cannot rebuild.

    Example (a step-0 checkpoint, saved as the training loop saves them):
      >>> import tempfile
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.checkpoint import CheckpointStore
      >>> from eae_jax.train.loop import build
      >>> from eae_jax.model_files import find_run_checkpoint, read_run_checkpoint
      >>> cfg = TrainConfig(preset="tiny", steps=1, batch=2, seq_len=8, out=tempfile.mkdtemp())
      >>> state = build(cfg)[4]
      >>> store = CheckpointStore(cfg.out + "/checkpoints")
      >>> _ = store.save(0, state, metadata={"config": cfg.to_dict()})
      >>> store.close()
      >>> params, model, meta = read_run_checkpoint(find_run_checkpoint(cfg.out))
      >>> params["embed"].shape, model.depth, meta["step"]
      ((256, 64), 4, 0)
    """
    from eae_jax.train import checkpoint as ckpt
    from eae_jax.train.config import TrainConfig
    from eae_jax.train.errors import CheckpointError

    meta = ckpt.read_metadata(path)
    stored = meta.get("config")
    if not isinstance(stored, dict):
        raise CheckpointError(f"{path}: no training config in its metadata; not a checkpoint of eae-jax train")
    try:
        train_cfg = TrainConfig(**stored)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: its training config cannot be rebuilt by this version: {err}") from err
    state, meta = ckpt.restore(path, _state_template(train_cfg))
    return state.params, train_cfg.model(), dict(meta, train_config=stored)


def require_torch(what: str, path: str) -> None:
    """Raise `TorchRequired` (naming ``what`` and ``path``) unless torch can be imported.

    Example:
      >>> from eae_jax.model_files import require_torch
      >>> require_torch("Hugging Face", "model_dir")      # torch is installed here: nothing happens
    """
    try:
        import torch  # noqa: F401
    except ImportError as err:
        raise TorchRequired(f"{path}: a {what} checkpoint needs PyTorch: pip install 'eae-jax[torch]' "
                            "(training runs and llama2.c .bin files do not)") from err


def _tokenizer_for(tokenizer: Any, folder: str) -> Optional[Tokenizer]:
    if tokenizer == "none":
        return None
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    return find_tokenizer(folder) if os.path.isdir(folder) else None


def load_model(path: str, tokenizer: Any = None) -> LoadedModel:
    """Load a language model and its tokenizer from any supported source.

    Args:
      path: a training run (directory, ``checkpoints`` folder or one
        ``ckpt_<step>``), a llama2.c ``.bin`` / ``.pt``, or a Hugging Face
        directory.
      tokenizer: a tokenizer spec (`eae_jax.text.load_tokenizer`); None:
        the one saved beside the model, if any; ``"none"``: ids only.

    Raises:
      FileNotFoundError: no such path.
      TorchRequired: a format that needs torch, without torch.
      ValueError: an unreadable or unsupported checkpoint (interop's errors,
        `eae_jax.train.CheckpointError`), a block stack rather than a
        language model, or a tokenizer with more ids than the model.

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import lm_config_from_model_args, save_llama2c_bin
      >>> from eae_jax.model_files import load_model
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> path = os.path.join(tempfile.mkdtemp(), "model.bin")
      >>> save_llama2c_bin(path, init_lm(jax.random.key(0), cfg), cfg)
      >>> model = load_model(path)
      >>> model.meta["format"], model.meta["bos_id"], model.tokenizer is None
      ('llama2c_bin_v0', 1, True)
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such model file or directory: {path}")
    run_ckpt = find_run_checkpoint(path)
    if run_ckpt is None and os.path.isdir(os.path.join(path, "checkpoints")):
        raise FileNotFoundError(f"{path} is a training run directory without a complete checkpoint yet "
                                f"(nothing in {os.path.join(path, 'checkpoints')})")
    if run_ckpt is not None:
        params, cfg, meta = read_run_checkpoint(run_ckpt)
        checkpoints_dir = os.path.dirname(os.path.abspath(run_ckpt))
        run_dir = os.path.dirname(checkpoints_dir) if os.path.basename(checkpoints_dir) == "checkpoints" \
            else checkpoints_dir
        tok = _tokenizer_for(tokenizer, run_dir)
        meta = {"format": "eae_run", "source": run_ckpt, "run_dir": run_dir, "step": meta.get("step"),
                "train_config": meta.get("train_config")}
    else:
        from interop.errors import UnknownFormatError
        from interop.safe_load import detect_format

        fmt = detect_format(path)
        if fmt in TORCH_FORMATS:
            require_torch(fmt, path)
        from interop.auto import load_checkpoint
        from interop.imported import ImportedModel

        imported = load_checkpoint(path)
        if not isinstance(imported, ImportedModel):
            raise UnknownFormatError(f"{path}: a stack of transformer blocks, not a whole language model "
                                     "(no embedding or head to generate with)")
        params, cfg = imported.params, imported.config
        meta = dict(imported.meta)
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        tok = _tokenizer_for(tokenizer, folder)
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model only {cfg.vocab_size}: they do not "
                         "belong together (pass the model's own tokenizer with --tokenizer, or --tokenizer none)")
    meta["bos_id"] = _bos_id(tok, meta)
    return LoadedModel(params, cfg, tok, meta)


def _bos_id(tok: Optional[Tokenizer], meta: dict) -> Optional[int]:
    """The id prompts start with: the tokenizer's, else the checkpoint's convention."""
    if tok is not None:
        return tok.bos_id
    fmt = str(meta.get("format", ""))
    if fmt.startswith("llama2c"):
        return 1  # llama2.c's sentencepiece vocabularies: <unk>, BOS, EOS first
    config = meta.get("config")
    if fmt == "hf_llama" and isinstance(config, dict) and isinstance(config.get("bos_token_id"), int):
        return int(config["bos_token_id"])
    return None
