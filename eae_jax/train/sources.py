"""What a run trains on and from: text, token files or the synthetic task; the held-out
batches; the model of ``--init``. `prepare_run` resolves them into the run's final config.

* ``text`` (a list; ``[]`` is the Python standard library): documents read,
  split by `eae_jax.text.load_text_corpus` (held-out documents for
  validation), tokenized by ``tokenizer`` (bytes by default, or the
  ``--init`` model's own), cached beside the run directory. The vocabulary
  follows the tokenizer unless ``vocab_size`` is given, which may not be
  smaller.
* ``data``: a token file (`TokenFile`), validated on ``val_data`` when given.
* neither: the synthetic task (no validation: every batch is a fresh draw).
* ``init``: any model `eae_jax.model_files.load_model` reads (a run, a
  llama2.c ``.bin``/``.pt``, a Hugging Face directory); its shape replaces
  the preset's, and a shape flag that contradicts it is refused.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from eae_jax.train.config import TrainConfig
from eae_jax.train.data import TokenFile, TokenWindows
from eae_jax.train.shapes import conflicts, shape_of

class RunData(NamedTuple):
    """A run's resolved config and inputs (see `prepare_run`).

    Attributes:
      config: the TrainConfig with ``vocab_size`` and the shape of ``--init`` filled in.
      train: the training windows (None: the synthetic task).
      val: int32 ``(val_batches, micro_batch, seq_len + 1)`` held-out tokens, or None.
      tokenizer: a text run's `eae_jax.text.Tokenizer` (saved beside the checkpoints), else None.
      init_params: the ``--init`` model's params (float32), or None.
      source: what the run trains on, in words.

    Example:
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.sources import prepare_run
      >>> run = prepare_run(TrainConfig(preset="tiny", batch=2, seq_len=8))
      >>> run.train is None, run.val is None, run.source
      (True, True, 'the synthetic task')
    """

    config: TrainConfig
    train: Optional[TokenWindows]
    val: Optional[jax.Array]
    tokenizer: Any
    init_params: Optional[dict]
    source: str


def _init_model(cfg: TrainConfig, text_run: bool):
    """``(LoadedModel, shape fields)`` of ``cfg.init``; refuses shape flags that contradict it."""
    from eae_jax.model_files import load_model

    if not os.path.exists(cfg.init):
        raise FileNotFoundError(f"--init {cfg.init}: no such file or directory")
    # A text run without --tokenizer speaks the init model's language, when it has one.
    loaded = load_model(cfg.init, tokenizer=None if text_run and not cfg.tokenizer else "none")
    fields = shape_of(loaded.config)
    given = {k: getattr(cfg, k) for k in fields if k != "tie_embeddings"}
    problems = conflicts(given, fields)
    if problems:
        raise ValueError(f"--init {cfg.init}: the model shape comes from the checkpoint; " + "; ".join(problems)
                         + " (drop those flags)")
    return loaded, fields


def prepare_run(cfg: TrainConfig, log_fn=None) -> RunData:
    """Read the run's data and ``--init`` model and resolve its final config.

    ``log_fn`` gets a line about the text read (None: silent).

    Raises:
      FileNotFoundError / ValueError: a missing or unreadable text, token
        file or checkpoint; a vocabulary smaller than the tokenizer's; a
        shape flag that contradicts ``--init``; a split too short for one
        window.
      ImportError: an optional package the run asks for is missing (the
        message says which extra to install).

    Example:
      >>> import os, tempfile
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.sources import prepare_run
      >>> root = tempfile.mkdtemp()
      >>> for i in range(20):
      ...     with open(os.path.join(root, f"doc{i}.txt"), "w") as f:
      ...         _ = f.write(f"document {i} " * 20)
      >>> run = prepare_run(TrainConfig(text=[root], seq_len=16, batch=4, val_batches=2, out=root + "/run"))
      >>> run.config.vocab_size, run.tokenizer.kind, run.val.shape     # the byte tokenizer's 257 ids
      (257, 'bytes', (2, 4, 17))
    """
    if cfg.tensorboard:  # asked for explicitly: a missing writer is refused before anything is built
        from eae_jax.train.report import require_tensorboard

        require_tensorboard()
    init = fields = None
    text_run = cfg.text is not None
    if cfg.init:
        init, fields = _init_model(cfg, text_run)
        cfg = dataclasses.replace(cfg, **fields)
    tokenizer, val, micro = None, None, cfg.batch // cfg.microbatches
    if text_run:
        from eae_jax.text import default_cache_dir, find_tokenizer, load_text_corpus

        spec = cfg.tokenizer or (init.tokenizer if init is not None and init.tokenizer is not None else "bytes")
        saved = find_tokenizer(cfg.out) if os.path.isdir(os.path.join(cfg.out, "checkpoints")) else None
        if isinstance(spec, str) and spec.startswith("bpe:") and saved is not None and \
                os.listdir(os.path.join(cfg.out, "checkpoints")):
            spec = saved  # a resumed BPE run keeps the tokenizer it was trained with
        corpus = load_text_corpus(cfg.text or None, spec, val_fraction=cfg.val_fraction,
                                  cache_dir=default_cache_dir(cfg.out), log_fn=log_fn)
        tokenizer = corpus.tokenizer
        if cfg.vocab_size is None:
            cfg = dataclasses.replace(cfg, vocab_size=tokenizer.vocab_size)
        elif cfg.vocab_size < tokenizer.vocab_size:
            where = f"the --init model's vocabulary {cfg.vocab_size}" if init is not None else \
                f"--vocab-size {cfg.vocab_size}"
            raise ValueError(f"{where} is smaller than the tokenizer's {tokenizer.vocab_size} ids "
                             f"({tokenizer.kind}): every token id needs a row")
        vocab = cfg.shape["vocab_size"]
        where = "the standard library" if not cfg.text else ", ".join(cfg.text)
        train = TokenWindows(corpus.train, vocab, cfg.seq_len, f"the training split of {where}")
        held = TokenWindows(corpus.val, vocab, cfg.seq_len,
                            f"the validation split of {where} (raise --val-fraction or lower --seq-len)")
        val = held.spread(cfg.val_batches * micro).reshape(cfg.val_batches, micro, -1)
        source = f"text from {where} ({tokenizer.kind} tokenizer, vocabulary {vocab})"
    elif cfg.data:
        vocab = cfg.shape["vocab_size"]
        train = TokenFile(cfg.data, vocab, cfg.seq_len)
        if cfg.val_data:
            val = TokenFile(cfg.val_data, vocab, cfg.seq_len).spread(cfg.val_batches * micro)
            val = val.reshape(cfg.val_batches, micro, -1)
        source = f"token file {cfg.data}"
    else:
        train, source = None, "the synthetic task"
    params = None
    if init is not None:
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), init.params)
        source += f", from {init.meta.get('format', 'a checkpoint')} {cfg.init}"
    return RunData(cfg, train, val, tokenizer, params, source)
