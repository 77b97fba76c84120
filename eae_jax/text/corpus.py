"""Real text for training: documents from files and folders, a held-out split, token arrays.

The default corpus needs no download: the Python standard library's own
source and text files that ship with the interpreter
(``sysconfig.get_paths()["stdlib"]``; ``pydoc_data`` holds the language
reference topics, the interpreter's own docs). Its test suites, caches,
``site-packages`` and compiled parts are left out (`STDLIB_SKIP_DIRS`).

Documents are read in sorted order. Each goes to the validation split when a
hash of its name falls below ``val_fraction`` (so adding a file moves no
other file between splits); a corpus of a single document is split at a line
boundary instead. Documents are tokenized without special tokens and each is
followed by the tokenizer's EOS id; the splits are flat uint16 arrays
(uint32 past 65536 ids), cached by content (`load_text_corpus`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from eae_jax.text.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, train_bpe

#: Directory names under the standard library that `stdlib_documents` skips.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                              "lib-dynload", "turtledemo"})
#: File suffixes `stdlib_documents` reads.
STDLIB_SUFFIXES = (".py", ".txt", ".rst")
#: Bumped when the cache layout or the tokenization rules change.
CACHE_VERSION = 1


class Document(NamedTuple):
    """One document: a stable ``name`` (its path relative to the root given) and its text.

    Example:
      >>> from eae_jax.text.corpus import Document
      >>> Document("pkg/a.py", "x = 1\\n").name
      'pkg/a.py'
    """

    name: str
    text: str


class TextCorpus(NamedTuple):
    """What `load_text_corpus` returns: ``(train, val, tokenizer)``.

    Example:
      >>> import numpy as np
      >>> from eae_jax.text import ByteTokenizer
      >>> from eae_jax.text.corpus import TextCorpus
      >>> train, val, tok = TextCorpus(np.zeros(4, np.uint16), np.zeros(2, np.uint16), ByteTokenizer())
      >>> train.size, val.size, tok.vocab_size
      (4, 2, 257)
    """

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer


def _read_text(path: str) -> Optional[str]:
    """The UTF-8 text of a file, or None for a binary one (a NUL byte, or not UTF-8)."""
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _walk(root: str, suffixes: Optional[Tuple[str, ...]], skip_dirs=frozenset()) -> List[str]:
    """Files under ``root`` (hidden entries and ``skip_dirs`` left out), as sorted relative posix paths."""
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip_dirs and not d.startswith("config-")]
        for name in files:
            if name.startswith(".") or (suffixes is not None and not name.endswith(suffixes)):
                continue
            found.append(os.path.relpath(os.path.join(here, name), root).replace(os.sep, "/"))
    return sorted(found)


def stdlib_documents() -> List[Document]:
    """The standard library's source and text files, sorted by path.

    Example:
      >>> from eae_jax.text.corpus import stdlib_documents
      >>> docs = stdlib_documents()
      >>> any(d.name == "json/decoder.py" for d in docs), any(d.name.startswith("test/") for d in docs)
      (True, False)
    """
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for rel in _walk(root, STDLIB_SUFFIXES, STDLIB_SKIP_DIRS):
        text = _read_text(os.path.join(root, rel))
        if text:
            docs.append(Document(rel, text))
    if not docs:
        raise FileNotFoundError(f"no standard-library text found under {root}")
    return docs


def read_documents(paths: Optional[Union[str, Sequence[str]]] = None) -> List[Document]:
    """Documents from files and folders (None: `stdlib_documents`).

    A file is one document (named by its base name). A folder gives every
    UTF-8 text file under it (hidden files and folders skipped, binary files
    skipped), named by their path relative to the folder under the folder's
    own name. Documents come sorted by name; empty ones are dropped.

    Raises:
      FileNotFoundError: a path that does not exist.
      ValueError: a file that is not UTF-8 text, two documents with one name,
        or no text at all.

    Example:
      >>> import os, tempfile
      >>> from eae_jax.text.corpus import read_documents
      >>> root = tempfile.mkdtemp()
      >>> os.makedirs(os.path.join(root, "notes", "sub"))
      >>> for rel, text in [("notes/b.txt", "bee"), ("notes/sub/a.md", "ay"), ("notes/img.bin", "\\0\\1")]:
      ...     with open(os.path.join(root, rel), "w") as f:
      ...         _ = f.write(text)
      >>> [d.name for d in read_documents(os.path.join(root, "notes"))]     # the binary file is skipped
      ['notes/b.txt', 'notes/sub/a.md']
    """
    if paths is None:
        return stdlib_documents()
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    docs: List[Document] = []
    for path in paths:
        path = os.fspath(path)
        if os.path.isdir(path):
            base = os.path.basename(os.path.normpath(os.path.abspath(path)))
            for rel in _walk(path, None):
                text = _read_text(os.path.join(path, rel))
                if text:
                    docs.append(Document(f"{base}/{rel}", text))
        elif os.path.isfile(path):
            text = _read_text(path)
            if text is None:
                raise ValueError(f"{path} is not UTF-8 text (a NUL byte or an invalid sequence)")
            if text:
                docs.append(Document(os.path.basename(path), text))
        else:
            raise FileNotFoundError(f"text path {path} does not exist")
    docs.sort(key=lambda d: d.name)
    names = [d.name for d in docs]
    twice = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
    if twice:
        raise ValueError(f"two documents are named {twice[:4]}: give folders or files with distinct names")
    if not docs:
        raise ValueError(f"no text found in {list(paths)}")
    return docs


def _hash_unit(name: str) -> float:
    """A name's position in [0, 1), from sha256."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def split_documents(docs: Sequence[Document], val_fraction: float = 0.05) -> Tuple[List[Document], List[Document]]:
    """``(train, val)``: a document is held out when the hash of its name is below ``val_fraction``.

    At least one document lands on each side: with none held out, the one of
    lowest hash is; with all held out, the one of highest hash is not. A
    single document is cut at the line boundary nearest ``1 - val_fraction``
    of its length (the tail held out).

    Raises:
      ValueError: ``val_fraction`` outside (0, 0.5], no documents, or a single
        document with too little text to split.

    Example:
      >>> from eae_jax.text.corpus import Document, split_documents
      >>> docs = [Document(f"doc{i}.txt", "text") for i in range(100)]
      >>> train, val = split_documents(docs, 0.1)
      >>> len(train) + len(val), 0 < len(val) < 25, {d.name for d in train} & {d.name for d in val}
      (100, True, set())
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be a number in (0, 0.5], got {val_fraction!r}")
    if not docs:
        raise ValueError("no documents to split")
    if len(docs) == 1:
        doc = docs[0]
        cut = int(len(doc.text) * (1 - val_fraction))
        newline = doc.text.rfind("\n", 0, cut)
        cut = newline + 1 if newline > 0 else cut
        if cut <= 0 or cut >= len(doc.text):
            raise ValueError(f"{doc.name} ({len(doc.text)} characters) is too short to hold a validation part")
        return [Document(doc.name, doc.text[:cut])], [Document(doc.name + "#val", doc.text[cut:])]
    ranked = sorted(docs, key=lambda d: _hash_unit(d.name))
    held = {d.name for d in ranked if _hash_unit(d.name) < val_fraction}
    if not held:
        held = {ranked[0].name}
    if len(held) == len(docs):
        held.discard(ranked[-1].name)
    return [d for d in docs if d.name not in held], [d for d in docs if d.name in held]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32.

    Example:
      >>> from eae_jax.text.corpus import token_dtype
      >>> token_dtype(65536).name, token_dtype(65537).name
      ('uint16', 'uint32')
    """
    return np.dtype(np.uint16 if vocab_size <= 2 ** 16 else np.uint32)


def tokenize_documents(docs: Sequence[Document], tokenizer: Tokenizer) -> np.ndarray:
    """One flat array: each document's ids followed by the EOS id (when the tokenizer has one).

    Example:
      >>> from eae_jax.text import ByteTokenizer
      >>> from eae_jax.text.corpus import Document, tokenize_documents
      >>> tokenize_documents([Document("a", "hi"), Document("b", "!")], ByteTokenizer()).tolist()
      [104, 105, 256, 33, 256]
    """
    dtype = token_dtype(tokenizer.vocab_size)
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    parts = [np.asarray(ids + eos, dtype) for ids in tokenizer.encode_batch([d.text for d in docs])]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def default_cache_dir(run_dir: str) -> str:
    """The token cache beside a run directory, shared by the runs next to it.

    Example:
      >>> from eae_jax.text.corpus import default_cache_dir
      >>> default_cache_dir("/tmp/runs/tiny")
      '/tmp/runs/.eae_text_cache'
    """
    return os.path.join(os.path.dirname(os.path.abspath(run_dir)), ".eae_text_cache")


def _corpus_key(docs: Sequence[Document], tokenizer_key: str, val_fraction: float) -> str:
    h = hashlib.sha256(f"eae_jax text corpus v{CACHE_VERSION}\0{tokenizer_key}\0{val_fraction!r}\0".encode())
    for d in docs:
        h.update(d.name.encode("utf-8") + b"\0" + hashlib.sha256(d.text.encode("utf-8")).digest())
    return h.hexdigest()[:24]


def _bpe_vocab(spec) -> Optional[int]:
    """The vocabulary size of a ``"bpe:<n>"`` spec, None for other specs."""
    if not isinstance(spec, str) or not spec.startswith("bpe:") or os.path.exists(spec):
        return None
    try:
        return int(spec[4:])
    except ValueError:
        raise ValueError(f"tokenizer spec {spec!r}: expected bpe:<vocab size>, e.g. bpe:4096") from None


def load_text_corpus(paths: Optional[Union[str, Sequence[str]]] = None, tokenizer="bytes", *,
                     val_fraction: float = 0.05, cache_dir: Optional[str] = None,
                     log_fn: Optional[Callable[[str], None]] = None) -> TextCorpus:
    """Read, split and tokenize a text corpus: ``(train_tokens, val_tokens, tokenizer)``.

    Args:
      paths: files and folders (`read_documents`); None: the standard
        library (`stdlib_documents`).
      tokenizer: ``"bytes"`` (default), ``"bpe:<vocab size>"`` (a byte-level
        BPE trained here on the training split, `train_bpe`), a tokenizer
        file or directory, or a `Tokenizer` (`load_tokenizer`).
      val_fraction: the share of documents held out (`split_documents`).
      cache_dir: where to keep the token arrays (and a trained tokenizer),
        keyed by the documents' names and contents, the tokenizer and the
        split; None: no cache. `default_cache_dir` gives the one beside a run
        directory. Entries are written to a temporary folder and renamed.
      log_fn: receives one line about what was read (None: silent).

    Returns:
      `TextCorpus`: flat uint16 (uint32 past 65536 ids) token arrays, each
      document followed by EOS, and the tokenizer (save it with the run:
      `eae_jax.text.save_tokenizer`).

    Raises:
      FileNotFoundError, ValueError: bad paths, spec or split; ImportError: a
      BPE spec without the ``tokenizers`` package.

    Example:
      >>> import os, tempfile
      >>> from eae_jax.text import load_text_corpus
      >>> root = tempfile.mkdtemp()
      >>> for i in range(30):
      ...     with open(os.path.join(root, f"doc{i:02d}.txt"), "w") as f:
      ...         _ = f.write(f"document number {i}\\n")
      >>> train, val, tok = load_text_corpus([root], "bytes", val_fraction=0.2)
      >>> train.dtype.name, tok.vocab_size, int(train[-1]) == tok.eos_id, 0 < val.size < train.size
      ('uint16', 257, True, True)
    """
    bpe_vocab = _bpe_vocab(tokenizer)
    tok = None if bpe_vocab is not None else load_tokenizer(tokenizer)
    if bpe_vocab is not None and not 257 <= bpe_vocab < 2 ** 31:
        raise ValueError(f"tokenizer spec {tokenizer!r}: a byte-level BPE needs a vocab size >= 257")
    docs = read_documents(paths)
    train_docs, val_docs = split_documents(docs, val_fraction)
    source = "the Python standard library" if paths is None else ", ".join(
        [paths] if isinstance(paths, str) else [os.fspath(p) for p in paths])
    key = _corpus_key(docs, f"bpe:{bpe_vocab}" if tok is None else tok.fingerprint(), val_fraction)
    entry = os.path.join(cache_dir, key) if cache_dir else None
    cached = entry is not None and os.path.isfile(os.path.join(entry, "info.json"))
    if cached:
        train = np.load(os.path.join(entry, "train.npy"), mmap_mode="r")
        val = np.load(os.path.join(entry, "val.npy"), mmap_mode="r")
        if tok is None:
            tok = HFTokenizer.from_file(os.path.join(entry, HFTokenizer.filename))
    else:
        if tok is None:
            tok = train_bpe((d.text for d in train_docs), bpe_vocab)
        train, val = tokenize_documents(train_docs, tok), tokenize_documents(val_docs, tok)
        if entry is not None:
            _write_entry(entry, train, val, tok if bpe_vocab is not None else None,
                         {"source": source, "documents": [len(train_docs), len(val_docs)],
                          "tokens": [int(train.size), int(val.size)], "tokenizer": tok.fingerprint()})
    if log_fn is not None:
        n_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
        log_fn(f"text: {len(docs)} documents ({n_bytes / 1e6:.1f} MB) from {source}: {len(train_docs)} train / "
               f"{len(val_docs)} validation documents, {train.size:,} / {val.size:,} tokens "
               f"({tok.kind} tokenizer, vocab {tok.vocab_size})" + (f"; cache {entry}" if entry else "")
               + (" (hit)" if cached else ""))
    return TextCorpus(train, val, tok)


def _write_entry(entry: str, train: np.ndarray, val: np.ndarray, tokenizer: Optional[Tokenizer], info: dict) -> None:
    """Write a cache entry into a temporary folder, then rename it into place (a concurrent writer's
    identical entry may win the rename: then this one is dropped)."""
    parent = os.path.dirname(entry)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp_" + os.path.basename(entry) + "_", dir=parent)
    try:
        np.save(os.path.join(tmp, "train.npy"), train)
        np.save(os.path.join(tmp, "val.npy"), val)
        if tokenizer is not None:
            tokenizer.save(tmp)
        with open(os.path.join(tmp, "info.json"), "w") as f:
            json.dump(info, f, indent=2)
        os.chmod(tmp, 0o777 & ~_umask())
        try:
            os.rename(tmp, entry)
        except OSError:
            if not os.path.isfile(os.path.join(entry, "info.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
