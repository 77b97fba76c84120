"""Token batches for training: a learnable synthetic task or a token file."""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.fileio import sniff


def synthetic_batch(key: jax.Array, batch: int, seq_len: int, vocab_size: int) -> jax.Array:
    """Int32 ``(batch, seq_len + 1)`` sequences ``t_i = (a + b*i) mod V``.

    ``a`` is uniform, the stride ``b`` is drawn from 1..8, so the next token is
    predictable from the two before it: loss can fall from ``log V`` towards 0
    and a working training loop shows it.

    Example:
      >>> import jax, numpy as np
      >>> from eae_jax.train.data import synthetic_batch
      >>> rows = np.asarray(synthetic_batch(jax.random.key(0), 2, 5, 16))
      >>> rows.shape, bool(np.all((np.diff(rows, axis=1) % 16) == (rows[:, 1:2] - rows[:, :1]) % 16))
      ((2, 6), True)
    """
    ka, kb = jax.random.split(key)
    start = jax.random.randint(ka, (batch, 1), 0, vocab_size)
    stride = jax.random.randint(kb, (batch, 1), 1, 9)
    pos = jnp.arange(seq_len + 1)[None, :]
    return ((start + stride * pos) % vocab_size).astype(jnp.int32)


def draw_starts(key: jax.Array, batch: int, high: int) -> np.ndarray:
    """``batch`` window offsets uniform in ``[0, high)``, as int64 numpy.

    Below 2**31 these are `jax.random.randint`'s int32 draws. Above, randint
    (int32 without x64) would clip ``high`` and never reach the file's tail:
    two 32-bit words per offset are combined and reduced modulo ``high``
    (bias at most ``high / 2**64``).

    Raises:
      ValueError: ``high`` is not positive.

    Example:
      >>> import jax
      >>> from eae_jax.train.data import draw_starts
      >>> starts = draw_starts(jax.random.key(0), 4, 2**40)
      >>> starts.dtype.name, bool(((starts >= 0) & (starts < 2**40)).all())
      ('int64', True)
    """
    if high <= 0:
        raise ValueError(f"no window offsets to draw from: high={high}")
    if high <= np.iinfo(np.int32).max:
        return np.asarray(jax.random.randint(key, (batch,), 0, high)).astype(np.int64)
    words = np.asarray(jax.random.bits(key, (batch, 2), jnp.uint32)).astype(np.uint64)
    return ((words[:, 0] << np.uint64(32) | words[:, 1]) % np.uint64(high)).astype(np.int64)


class TokenWindows:
    """Windows of ``seq_len + 1`` tokens from a flat array of token ids (in memory or mapped).

    ``name`` names the tokens in errors (a file, a text split). Ids are
    checked against ``vocab_size``: the first 2**20 when made, every window
    when drawn.

    Raises:
      ValueError: non-integer ids, too few for one window, ids outside the
        vocabulary.

    Example:
      >>> import jax, numpy as np
      >>> from eae_jax.train.data import TokenWindows
      >>> w = TokenWindows(np.arange(100) % 7, vocab_size=7, seq_len=8, name="demo")
      >>> w.batch(jax.random.key(0), 3).shape, w.spread(4)[:, 0].tolist()
      ((3, 9), [0, 2, 4, 0])
    """

    def __init__(self, tokens: np.ndarray, vocab_size: int, seq_len: int, name: str):
        self.name, self.vocab_size = name, vocab_size
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{name} holds {tokens.dtype} values; token ids must be integers")
        if tokens.ndim != 1:
            tokens = tokens.reshape(-1)
        if tokens.shape[0] < seq_len + 1:
            raise ValueError(f"{name} holds {tokens.shape[0]} tokens; one window needs {seq_len + 1}")
        self._check_ids(tokens[: min(tokens.shape[0], 1 << 20)], "")
        self.tokens, self.seq_len = tokens, seq_len

    def _check_ids(self, ids: np.ndarray, where: str) -> None:
        low, top = int(np.min(ids)), int(np.max(ids))
        if low < 0:
            raise ValueError(f"{self.name} has negative id {low}{where}")
        if top >= self.vocab_size:
            raise ValueError(f"{self.name} has id {top}{where} >= vocab_size {self.vocab_size}")

    def _rows(self, starts: np.ndarray) -> jax.Array:
        rows = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1]) for s in starts])
        # The constructor checks the first 2**20 ids only; ids past them are checked as they are drawn.
        self._check_ids(rows, f" in a window starting at one of the offsets {sorted(set(starts.tolist()))}")
        return jnp.asarray(rows.astype(np.int32))

    def batch(self, key: jax.Array, batch: int) -> jax.Array:
        """Int32 ``(batch, seq_len + 1)`` windows at positions drawn from ``key``."""
        # A window is seq_len + 1 tokens (inputs and shifted targets): starts 0 .. n - seq_len - 1 all fit.
        return self._rows(draw_starts(key, batch, self.tokens.shape[0] - self.seq_len))

    def spread(self, count: int) -> jax.Array:
        """Int32 ``(count, seq_len + 1)`` windows evenly spaced from the first token to the last
        (a fixed, key-free sample: the validation batches)."""
        last = self.tokens.shape[0] - self.seq_len - 1
        return self._rows(np.linspace(0, last, count).astype(np.int64))


class TokenFile(TokenWindows):
    """Random windows from a flat file of token ids.

    Accepts a ``.npy`` array file (any integer dtype) or a raw file of uint16
    ids (llama2.c's pretokenized ``.bin`` shards), told apart by content (the
    ``.npy`` header), never by the name's case. A file with another format's
    magic number (zip/.npz/.pt, pickle, safetensors, gzip, llama2.c
    checkpoint) or named ``.npy`` without the header is refused.

    Raises:
      FileNotFoundError / ValueError: missing or unreadable file, non-integer
        ids, too short for one window, or ids outside the vocabulary (the
        first 2**20 ids when opened, every window when drawn).

    Example:
      >>> import os, tempfile, jax, numpy as np
      >>> from eae_jax.train.data import TokenFile
      >>> path = os.path.join(tempfile.mkdtemp(), "tokens.bin")
      >>> np.arange(50, dtype=np.uint16).tofile(path)              # raw uint16 ids, llama2.c style
      >>> TokenFile(path, vocab_size=64, seq_len=8).batch(jax.random.key(0), 3).shape
      (3, 9)
    """

    def __init__(self, path: str, vocab_size: int, seq_len: int):
        if not os.path.exists(path):
            raise FileNotFoundError(f"token file {path} does not exist")
        if not os.path.isfile(path):
            raise ValueError(f"token file {path} is not a regular file")
        try:
            kind = sniff(path)  # by content: a tokens.NPY is an array file, not raw ids
            if kind == "npy":
                tokens = np.load(path, mmap_mode="r", allow_pickle=False)
            elif path.lower().endswith(".npy"):
                raise ValueError("named .npy but it is not a numpy array file (no .npy header)")
            elif kind != "unknown":
                raise ValueError(f"it is a {kind} file, not token ids")
            elif os.path.getsize(path) % 2:
                raise ValueError(f"{os.path.getsize(path)} bytes is not a whole number of uint16 tokens")
            elif os.path.getsize(path) == 0:
                tokens = np.zeros(0, np.uint16)  # np.memmap refuses empty files
            else:
                tokens = np.memmap(path, dtype=np.uint16, mode="r")
        except (ValueError, OSError, EOFError) as err:
            raise ValueError(f"cannot read token file {path} (.npy, or raw uint16 .bin): {err}") from err
        super().__init__(tokens, vocab_size, seq_len, f"token file {path}")
        self.path = path


def make_batches(key: jax.Array, source: Optional[TokenWindows], steps_batch: int, seq_len: int, vocab: int):
    """One step's tokens from ``source`` (None: synthetic).

    Example:
      >>> import jax
      >>> from eae_jax.train.data import make_batches
      >>> make_batches(jax.random.key(0), None, 4, 8, 256).shape
      (4, 9)
    """
    if source is None:
        return synthetic_batch(key, steps_batch, seq_len, vocab)
    return source.batch(key, steps_batch)
