"""Tokenizers: byte-level, BPE trained with the ``tokenizers`` library, existing files.

Every tokenizer has the same small interface (`Tokenizer`): ``encode(text)``
gives ids without special tokens, ``decode(ids)`` gives text with the
special tokens dropped (ids outside the vocabulary show as U+FFFD, so a
model with a larger vocabulary than its tokenizer never stops a stream),
``bos_id`` starts a prompt, ``eos_id`` ends a document, ``save(directory)``
writes one file that `find_tokenizer` reads back:

========================  =================================================
file                      tokenizer
========================  =================================================
``tokenizer_bytes.json``  `ByteTokenizer`: ids 0..255 are the UTF-8 bytes,
                          256 is ``<|endoftext|>`` (BOS and EOS); vocab 257
``tokenizer.json``        `HFTokenizer`, a Hugging Face ``tokenizers`` file
                          (`train_bpe` writes these: byte-level BPE)
``tokenizer.bin``         `eae_jax.text.llama2c_tokenizer.Llama2cTokenizer`
========================  =================================================

`load_tokenizer` turns a spec (``"bytes"``, a file or a directory) into one.
Only `HFTokenizer` and `train_bpe` need the ``tokenizers`` package
(``pip install 'eae-jax[text]'``).
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from typing import Iterable, List, Optional, Sequence

from eae_jax.fileio import atomic_write_bytes

#: The special token that separates documents (and starts prompts) in `ByteTokenizer` and `train_bpe` vocabularies.
ENDOFTEXT = "<|endoftext|>"
#: Names that `HFTokenizer` recognises as BOS / EOS in a tokenizer.json it did not train, in order.
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|endoftext|>", "<bos>")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
#: The file each kind saves to, in the order `find_tokenizer` looks for them.
TOKENIZER_FILES = ("tokenizer_bytes.json", "tokenizer.json", "tokenizer.bin")


class Tokenizer(abc.ABC):
    """The interface every tokenizer here has.

    Attributes:
      kind: ``'bytes'``, ``'hf'`` or ``'llama2c'``.
      vocab_size: number of ids; a model needs at least this many.
      bos_id: the id a prompt starts with (None: none).
      eos_id: the id that ends each document of a corpus (None: none).

    Example:
      >>> from eae_jax.text import ByteTokenizer, Tokenizer
      >>> tok = ByteTokenizer()
      >>> isinstance(tok, Tokenizer), tok.decode(tok.encode("héllo")) == "héllo"
      (True, True)
    """

    kind = "base"
    filename = ""
    vocab_size: int
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None

    @abc.abstractmethod
    def encode(self, text: str) -> List[int]:
        """Ids of ``text``, no special tokens added."""

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """`encode` of each text (faster where the library batches)."""
        return [self.encode(t) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens dropped, ids outside the vocabulary as U+FFFD."""

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A string that changes whenever the ids of some text would."""

    @abc.abstractmethod
    def save(self, directory: str) -> str:
        """Write the tokenizer's file into ``directory`` (atomically); returns its path."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus ``<|endoftext|>`` = 256 as BOS and EOS (vocab 257).

    Needs no file and no library: the default tokenizer.

    Example:
      >>> from eae_jax.text import ByteTokenizer
      >>> tok = ByteTokenizer()
      >>> tok.encode("hé"), tok.vocab_size, tok.bos_id
      ([104, 195, 169], 257, 256)
      >>> tok.decode([256, 104, 195, 169, 999])        # the special dropped, an unknown id as U+FFFD
      'hé\\ufffd'
    """

    kind = "bytes"
    filename = "tokenizer_bytes.json"

    def __init__(self):
        self.vocab_size = 257
        self.bos_id = self.eos_id = 256

    def encode(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return list(text.encode("utf-8", errors="surrogatepass"))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of ``ids`` (U+FFFD's bytes for an id outside 0..256)."""
        out = bytearray()
        for t in ids:
            t = int(t)
            if 0 <= t < 256:
                out.append(t)
            elif t != 256:
                out += "\ufffd".encode()
        return bytes(out)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "bytes:v1"

    def save(self, directory: str) -> str:
        path = os.path.join(directory, self.filename)
        spec = {"type": "bytes", "vocab_size": self.vocab_size, "endoftext_id": 256, "endoftext": ENDOFTEXT}
        atomic_write_bytes(path, (json.dumps(spec, indent=2) + "\n").encode())
        return path


def _require_tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError("BPE tokenizers and tokenizer.json files need the 'tokenizers' package: "
                          "pip install 'eae-jax[text]'") from err
    return tokenizers


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (a ``tokenizer.json``).

    BOS / EOS: ``<|endoftext|>`` for the ones `train_bpe` makes; otherwise
    the first of `BOS_NAMES` / `EOS_NAMES` the vocabulary has.

    Example:
      >>> from eae_jax.text import train_bpe
      >>> tok = train_bpe(["the cat sat on the mat"] * 20, vocab_size=270)
      >>> type(tok).__name__, 257 < tok.vocab_size <= 270, tok.decode(tok.encode("the mat")) == "the mat"
      ('HFTokenizer', True, True)
    """

    kind = "hf"
    filename = "tokenizer.json"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._first(BOS_NAMES)
        self.eos_id = self._first(EOS_NAMES)

    def _first(self, names) -> Optional[int]:
        for name in names:
            found = self.tokenizer.token_to_id(name)
            if found is not None:
                return int(found)
        return None

    @classmethod
    def from_file(cls, path: str) -> "HFTokenizer":
        """Read a ``tokenizer.json``.

        Raises:
          ValueError: a file the ``tokenizers`` library cannot read.

        Example:
          >>> import os, tempfile
          >>> from eae_jax.text import HFTokenizer, train_bpe
          >>> path = train_bpe(["abab abab"] * 10, vocab_size=260).save(tempfile.mkdtemp())
          >>> HFTokenizer.from_file(path).encode("abab") == train_bpe(["abab abab"] * 10, vocab_size=260).encode("abab")
          True
        """
        tokenizers = _require_tokenizers()
        try:
            return cls(tokenizers.Tokenizer.from_file(path))
        except Exception as err:  # the library raises its own Exception subclass for a bad file
            raise ValueError(f"{path}: not a tokenizer.json the tokenizers library reads: {err}") from err

    def encode(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        parts, run = [], []
        for t in ids:
            t = int(t)
            if 0 <= t < self.vocab_size:
                run.append(t)
                continue
            parts.append(self.tokenizer.decode(run, skip_special_tokens=True) if run else "")
            parts.append("\ufffd")
            run = []
        parts.append(self.tokenizer.decode(run, skip_special_tokens=True) if run else "")
        return "".join(parts)

    def fingerprint(self) -> str:
        return "hf:" + hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()

    def save(self, directory: str) -> str:
        path = os.path.join(directory, self.filename)
        atomic_write_bytes(path, self.tokenizer.to_str(pretty=True).encode())
        return path


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> HFTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style) on ``texts``.

    The vocabulary: ``<|endoftext|>`` (id 0, BOS and EOS), the 256 byte
    symbols, then merges up to ``vocab_size`` (fewer when the texts run out
    of pairs seen ``min_frequency`` times).

    Raises:
      ValueError: ``vocab_size`` below 257 or above 2**31 - 1.
      ImportError: no ``tokenizers`` package.

    Example:
      >>> from eae_jax.text import train_bpe
      >>> tok = train_bpe(["hello world"] * 50, vocab_size=300)
      >>> tok.bos_id, tok.eos_id, len(tok.encode("hello world")) < len("hello world")
      (0, 0, True)
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 257 <= vocab_size < 2**31:
        raise ValueError(f"a byte-level BPE vocabulary needs 257 ids at least (256 bytes + {ENDOFTEXT}), "
                         f"got vocab_size={vocab_size!r}")
    tokenizers = _require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[ENDOFTEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok)


def _read_file(path: str) -> Tokenizer:
    """A tokenizer from one file, recognised by content."""
    from eae_jax.text.llama2c_tokenizer import Llama2cTokenizer

    with open(path, "rb") as f:
        data = f.read()
    if data.lstrip()[:1] == b"{":
        try:
            spec = json.loads(data.decode("utf-8"))
        except ValueError as err:
            raise ValueError(f"{path}: starts like JSON but is not valid JSON: {err}") from err
        if isinstance(spec, dict) and spec.get("type") == "bytes":
            if spec.get("vocab_size") != 257 or spec.get("endoftext_id") != 256:
                raise ValueError(f"{path}: a byte tokenizer file must say vocab_size 257 and endoftext_id 256, "
                                 f"got {spec}")
            return ByteTokenizer()
        return HFTokenizer.from_file(path)
    return Llama2cTokenizer(data, where=path)


def find_tokenizer(directory: str) -> Optional[Tokenizer]:
    """The tokenizer saved in ``directory`` (one of `TOKENIZER_FILES`), or None.

    Raises:
      ValueError: more than one tokenizer file (which one is meant is
        ambiguous), or an unreadable one.

    Example:
      >>> import tempfile
      >>> from eae_jax.text import ByteTokenizer, find_tokenizer
      >>> folder = tempfile.mkdtemp()
      >>> find_tokenizer(folder) is None
      True
      >>> _ = ByteTokenizer().save(folder)
      >>> find_tokenizer(folder).kind
      'bytes'
    """
    found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]
    if len(found) > 1:
        raise ValueError(f"{directory} holds several tokenizer files {found}: which one belongs to the model is "
                         "ambiguous; remove the others or pass one with --tokenizer")
    return _read_file(os.path.join(directory, found[0])) if found else None


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> str:
    """Save ``tokenizer`` into ``directory`` (a run directory, say); returns the file written.

    Other tokenizer files there are removed first, so `find_tokenizer` finds
    exactly this one.

    Example:
      >>> import os, tempfile
      >>> from eae_jax.text import ByteTokenizer, save_tokenizer
      >>> folder = tempfile.mkdtemp()
      >>> os.path.basename(save_tokenizer(ByteTokenizer(), folder))
      'tokenizer_bytes.json'
    """
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"expected a Tokenizer, got {type(tokenizer).__name__}")
    path = tokenizer.save(directory)
    for name in TOKENIZER_FILES:
        other = os.path.join(directory, name)
        if name != os.path.basename(path) and os.path.isfile(other):
            os.unlink(other)
    return path


def load_tokenizer(spec) -> Tokenizer:
    """A tokenizer from a spec.

    Args:
      spec: a `Tokenizer` (returned as is); ``None`` or ``"bytes"`` (the
        `ByteTokenizer`); a file (``tokenizer.json``, llama2.c
        ``tokenizer.bin``, ``tokenizer_bytes.json``, recognised by content);
        or a directory holding one (`find_tokenizer`). A BPE tokenizer to
        train (``"bpe:4096"``) needs a corpus: see
        `eae_jax.text.load_text_corpus` or `train_bpe`.

    Raises:
      FileNotFoundError: a path that does not exist, or a directory without a
        tokenizer file.
      ValueError: an unknown spec or an unreadable file.

    Example:
      >>> from eae_jax.text import load_tokenizer
      >>> load_tokenizer("bytes").vocab_size
      257
      >>> load_tokenizer("bpe:512")
      Traceback (most recent call last):
      ...
      ValueError: 'bpe:512' is trained on a corpus: pass it to load_text_corpus (or call train_bpe)
    """
    if isinstance(spec, Tokenizer):
        return spec
    if spec is None or spec == "bytes":
        return ByteTokenizer()
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"a tokenizer spec is a str, a path or a Tokenizer, got {type(spec).__name__}")
    spec = os.fspath(spec)
    if spec.startswith("bpe:") and not os.path.exists(spec):
        raise ValueError(f"{spec!r} is trained on a corpus: pass it to load_text_corpus (or call train_bpe)")
    if os.path.isdir(spec):
        found = find_tokenizer(spec)
        if found is None:
            raise FileNotFoundError(f"{spec} holds no tokenizer file (one of {', '.join(TOKENIZER_FILES)})")
        return found
    if os.path.isfile(spec):
        return _read_file(spec)
    raise FileNotFoundError(f"tokenizer {spec!r}: no such file or directory (specs: 'bytes', 'bpe:<vocab size>', "
                            "a tokenizer.json, a llama2.c tokenizer.bin, or a directory holding one)")
