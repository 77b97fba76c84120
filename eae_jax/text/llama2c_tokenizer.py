"""llama2.c's ``tokenizer.bin``: reading it, and encoding and decoding as its ``run.c`` does.

The file (written by llama2.c's ``tokenizer.py``): a little-endian uint32
``max_token_length``, then for every token a float32 score, a uint32 byte
length and the token's bytes. The number of tokens is not stored: the file
ends after the last one. Ids 0, 1, 2 are ``<unk>``, BOS and EOS; ids 3..258
are the byte-fallback tokens ``<0x00>``..``<0xFF>`` (sentencepiece's layout).

Encoding follows ``run.c``: a leading space (the dummy prefix), one token per
UTF-8 character found in the vocabulary (else one byte-fallback token per
byte), then repeated merges of the adjacent pair whose concatenation is the
best-scoring token (the leftmost on ties). Here the merges run from a heap,
in O(n log n) rather than run.c's O(n^2) rescans, with the same result.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import re
import struct
from typing import Dict, List, Optional, Sequence

from eae_jax.fileio import atomic_write_bytes
from eae_jax.text.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")
#: run.c only merges pairs whose score beats this.
_NO_SCORE = -1e10


def parse_llama2c_tokenizer(data: bytes, where: str = "tokenizer.bin") -> tuple:
    """``(pieces, scores, max_token_length)`` from the bytes of a ``tokenizer.bin``.

    Raises:
      ValueError: a file that is too short, ends inside a token, or holds a
        token longer than its own ``max_token_length``.

    Example:
      >>> import struct
      >>> from eae_jax.text.llama2c_tokenizer import parse_llama2c_tokenizer
      >>> data = struct.pack("<I", 2) + struct.pack("<fI", 0.0, 1) + b"a" + struct.pack("<fI", -1.5, 2) + b"ab"
      >>> parse_llama2c_tokenizer(data)
      ([b'a', b'ab'], [0.0, -1.5], 2)
    """
    if len(data) < 4:
        raise ValueError(f"{where}: {len(data)} bytes is too short for a llama2.c tokenizer (4-byte header)")
    (max_len,) = struct.unpack_from("<I", data, 0)
    pieces, scores, offset = [], [], 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise ValueError(f"{where}: truncated: token {len(pieces)} starts at byte {offset} but only "
                             f"{len(data) - offset} bytes are left (need 8 for its score and length)")
        score, length = struct.unpack_from("<fI", data, offset)
        offset += 8
        if length > max_len or offset + length > len(data):
            why = (f"longer than max_token_length {max_len}" if length > max_len
                   else f"past the end of the file ({len(data)} bytes)")
            raise ValueError(f"{where}: token {len(pieces)} has length {length}, {why}: not a llama2.c tokenizer")
        pieces.append(bytes(data[offset:offset + length]))
        scores.append(float(score))
        offset += length
    if not pieces:
        raise ValueError(f"{where}: a llama2.c tokenizer with no tokens")
    return pieces, scores, int(max_len)


class Llama2cTokenizer(Tokenizer):
    """A llama2.c ``tokenizer.bin`` (sentencepiece BPE pieces with scores).

    BOS is id 1 and EOS id 2 (llama2.c's convention); `decode` drops them and,
    as ``run.c``, the leading space of the piece right after BOS.

    Example:
      >>> import struct
      >>> from eae_jax.text.llama2c_tokenizer import Llama2cTokenizer
      >>> pieces = [b"<unk>", b"\\n<s>\\n", b"\\n</s>\\n"] + [b"<0x%02X>" % i for i in range(256)]
      >>> pieces += [b" ", b"h", b"i", b"hi", b" hi"]
      >>> scores = [0.0] * 259 + [-1.0, -1.0, -1.0, -2.0, -3.0]
      >>> data = struct.pack("<I", 6) + b"".join(struct.pack("<fI", s, len(p)) + p for s, p in zip(scores, pieces))
      >>> tok = Llama2cTokenizer(data)
      >>> tok.vocab_size, tok.encode("hi"), tok.encode("hi!")      # "!" is not a piece: byte fallback 33 + 3
      (264, [263], [263, 36])
      >>> tok.decode([1, 263, 36])
      'hi!'
    """

    kind = "llama2c"
    filename = "tokenizer.bin"

    def __init__(self, data: bytes, where: str = "tokenizer.bin"):
        self._data = bytes(data)
        self.pieces, self.scores, self.max_token_length = parse_llama2c_tokenizer(self._data, where)
        self.vocab_size = len(self.pieces)
        self.bos_id = 1 if self.vocab_size > 1 else None
        self.eos_id = 2 if self.vocab_size > 2 else None
        self._ids: Dict[bytes, int] = {}
        for i, piece in enumerate(self.pieces):
            self._ids.setdefault(piece, i)  # run.c's binary search finds one of equal pieces; real files have none
        self._piece_bytes: List[bytes] = []
        for i, piece in enumerate(self.pieces):
            m = _BYTE_PIECE.match(piece)
            self._piece_bytes.append(bytes([int(m.group(1), 16)]) if m else piece)

    @classmethod
    def from_file(cls, path: str) -> "Llama2cTokenizer":
        """Read a ``tokenizer.bin``.

        Example:
          >>> import os, struct, tempfile
          >>> from eae_jax.text.llama2c_tokenizer import Llama2cTokenizer
          >>> path = os.path.join(tempfile.mkdtemp(), "tokenizer.bin")
          >>> with open(path, "wb") as f:
          ...     _ = f.write(struct.pack("<I", 1) + struct.pack("<fI", 0.0, 1) + b"x")
          >>> Llama2cTokenizer.from_file(path).pieces
          [b'x']
        """
        with open(path, "rb") as f:
            return cls(f.read(), where=path)

    def fingerprint(self) -> str:
        return "llama2c:" + hashlib.sha256(self._data).hexdigest()

    def save(self, directory: str) -> str:
        path = os.path.join(directory, self.filename)
        atomic_write_bytes(path, self._data)
        return path

    def _byte_fallback(self, raw: bytes) -> List[int]:
        out = []
        for b in raw:
            out.append(b + 3)
        bad = [i for i in out if i >= self.vocab_size]
        if bad:
            raise ValueError(f"byte-fallback id {bad[0]} is outside this tokenizer's {self.vocab_size} ids: it has "
                             "no <0x..> byte pieces at 3..258 to encode text it has no piece for")
        return out

    def encode(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        if not text:
            return []
        ids: List[int] = []
        space = self._ids.get(b" ")
        ids += [space] if space is not None else self._byte_fallback(b" ")  # run.c's dummy prefix
        for ch in text:
            raw = ch.encode("utf-8", errors="surrogatepass")
            found = self._ids.get(raw)
            ids += [found] if found is not None else self._byte_fallback(raw)
        return self._merge(ids)

    def _merge(self, ids: List[int]) -> List[int]:
        """run.c's merge loop: repeatedly merge the best-scoring adjacent pair (leftmost on ties)."""
        n = len(ids)
        token = list(ids)
        nxt = list(range(1, n)) + [-1]
        prv = [-1] + list(range(n - 1))
        alive = [True] * n
        heap: list = []

        def push(i):
            j = nxt[i]
            if j < 0:
                return
            merged = self._ids.get(self.pieces[token[i]] + self.pieces[token[j]])
            if merged is not None and self.scores[merged] > _NO_SCORE:
                # Position i orders ties as run.c's left-to-right scan: surviving positions keep their order.
                heapq.heappush(heap, (-self.scores[merged], i, token[i], j, token[j], merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, ti, j, tj, merged = heapq.heappop(heap)
            # An entry is stale once either side was merged into something else.
            if not (alive[i] and alive[j]) or nxt[i] != j or token[i] != ti or token[j] != tj:
                continue
            token[i] = merged
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        return [token[i] for i in range(n) if alive[i]]

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes ``ids`` stand for (BOS and EOS dropped; unknown ids as U+FFFD's bytes).

        Example:
          >>> import struct
          >>> from eae_jax.text.llama2c_tokenizer import Llama2cTokenizer
          >>> pieces = [b"<unk>", b"\\n<s>\\n", b"\\n</s>\\n", b" a", b"<0xE2>", b"<0x82>", b"<0xAC>"]
          >>> data = struct.pack("<I", 6) + b"".join(struct.pack("<fI", 0.0, len(p)) + p for p in pieces)
          >>> Llama2cTokenizer(data).decode_bytes([1, 3, 3, 4, 5, 6, 2])    # after BOS the space is dropped
          b'a a\\xe2\\x82\\xac'
        """
        out, prev = [], None
        for t in ids:
            t = int(t)
            if t in (self.bos_id, self.eos_id):
                prev = t
                continue
            if not 0 <= t < self.vocab_size:
                out.append("\ufffd".encode())
            else:
                piece = self._piece_bytes[t]
                if prev == self.bos_id and piece.startswith(b" "):
                    piece = piece[1:]
                out.append(piece)
            prev = t
        return b"".join(out)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def id_piece(self, token: int) -> Optional[bytes]:
        """The stored piece of ``token`` (None outside the vocabulary).

        Example:
          >>> import struct
          >>> from eae_jax.text.llama2c_tokenizer import Llama2cTokenizer
          >>> tok = Llama2cTokenizer(struct.pack("<I", 2) + struct.pack("<fI", 0.0, 2) + b"ab")
          >>> tok.id_piece(0), tok.id_piece(5)
          (b'ab', None)
        """
        return self.pieces[token] if 0 <= token < self.vocab_size else None
