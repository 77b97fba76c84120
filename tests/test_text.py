"""eae_jax.text: tokenizers (byte, BPE, tokenizer.json, llama2.c tokenizer.bin) and the text corpus."""

import os
import struct

import numpy as np
import pytest

from eae_jax.text import (ByteTokenizer, Document, HFTokenizer, Llama2cTokenizer, find_tokenizer, load_text_corpus,
                          load_tokenizer, read_documents, save_tokenizer, split_documents, stdlib_documents,
                          train_bpe)
from eae_jax.text.corpus import token_dtype, tokenize_documents


# ----------------------------------------------------------------------------- byte-level
def test_bytes_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "naïve 🐍 code\n\tx = 1"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text
    assert tok.decode([65, 300, -1, 66]) == "A\ufffd\ufffdB"
    assert tok.decode(ids[:-1] + [0xF0]) == text[:-1] + "\ufffd"     # a cut multi-byte character


def test_saved_tokenizers_are_found_again(tmp_path):
    path = save_tokenizer(ByteTokenizer(), str(tmp_path))
    assert os.path.basename(path) == "tokenizer_bytes.json"
    assert isinstance(find_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(load_tokenizer(path), ByteTokenizer)
    (tmp_path / "tokenizer.bin").write_bytes(_llama2c_file([b"a"], [0.0]))
    with pytest.raises(ValueError, match="several tokenizer files"):
        find_tokenizer(str(tmp_path))
    save_tokenizer(ByteTokenizer(), str(tmp_path))                    # replaces the others
    assert sorted(os.listdir(tmp_path)) == ["tokenizer_bytes.json"]


@pytest.mark.parametrize("spec,error,match", [
    ("bpe:512", ValueError, "trained on a corpus"),
    ("no/such/tokenizer.json", FileNotFoundError, "no such file"),
    (3, TypeError, "spec"),
])
def test_bad_tokenizer_specs(spec, error, match):
    with pytest.raises(error, match=match):
        load_tokenizer(spec)


def test_a_directory_without_a_tokenizer_and_a_bad_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="tokenizers library"):
        load_tokenizer(str(bad))


# ----------------------------------------------------------------------------- llama2.c tokenizer.bin
def _llama2c_file(pieces, scores, max_len=None):
    """Written as llama2.c's tokenizer.py export does: uint32 max length, then (float32, uint32, bytes) per token."""
    max_len = max(len(p) for p in pieces) if max_len is None else max_len
    out = struct.pack("I", max_len)
    for piece, score in zip(pieces, scores):
        out += struct.pack("fI", score, len(piece)) + piece
    return out


def _toy_llama2c():
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)]
    words = [b" ", b"a", b"b", b"c", b"\xc3\xa9", b"ab", b"bc", b" a", b"abc", b" ab", b"ca", b"cab", b"bb", b"aa",
             b" \xc3\xa9"]
    pieces += words
    rng = np.random.default_rng(0)
    scores = [0.0] * 259 + [float(s) for s in np.round(rng.normal(size=len(words)), 1)]   # rounding makes ties
    scores[pieces.index(b"ab")] = scores[pieces.index(b"bc")] = 0.5                      # an explicit tie
    return pieces, scores


def _run_c_encode(pieces, scores, text):
    """llama2.c run.c's encode (no BOS/EOS), ported literally: rescan every pair after every merge."""
    lookup = {p: i for i, p in enumerate(pieces)}
    ids = [lookup[b" "]] if text else []
    for ch in text:
        raw = ch.encode("utf-8")
        ids += [lookup[raw]] if raw in lookup else [b + 3 for b in raw]
    while True:
        best, best_id, best_idx = -1e10, -1, -1
        for i in range(len(ids) - 1):
            merged = lookup.get(pieces[ids[i]] + pieces[ids[i + 1]])
            if merged is not None and scores[merged] > best:
                best, best_id, best_idx = scores[merged], merged, i
        if best_idx == -1:
            return ids
        ids[best_idx:best_idx + 2] = [best_id]


def test_llama2c_reader_and_encoder_follow_run_c(tmp_path):
    pieces, scores = _toy_llama2c()
    path = tmp_path / "tokenizer.bin"
    path.write_bytes(_llama2c_file(pieces, scores))
    tok = load_tokenizer(str(path))
    assert isinstance(tok, Llama2cTokenizer) and tok.vocab_size == len(pieces)
    assert tok.pieces == pieces and tok.scores == [float(np.float32(s)) for s in scores]
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    rng = np.random.default_rng(1)
    alphabet = list("abcé d!")
    f32 = [float(np.float32(s)) for s in scores]
    for n in list(range(0, 12)) + [30] * 40 + [200]:
        text = "".join(rng.choice(alphabet, size=n))
        assert tok.encode(text) == _run_c_encode(pieces, f32, text), text
    text = "ab abc é!"
    assert tok.decode([1] + tok.encode(text)) == text                  # run.c drops the dummy space after BOS
    assert tok.decode([1, 2, 99999]) == "\ufffd"


@pytest.mark.parametrize("data,match", [
    (b"\x01\x00", "too short"),
    (struct.pack("I", 4) + struct.pack("fI", 0.0, 3) + b"ab", "past the end"),
    (struct.pack("I", 2) + struct.pack("fI", 0.0, 3) + b"abc", "longer than max_token_length"),
    (struct.pack("I", 4) + struct.pack("fI", 0.0, 1) + b"a" + b"\x00\x00", "truncated"),
])
def test_broken_tokenizer_bin_is_refused(tmp_path, data, match):
    path = tmp_path / "tokenizer.bin"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        load_tokenizer(str(path))


# ----------------------------------------------------------------------------- BPE (tokenizers library)
CORPUS = ["def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x):\n        self.x = x\n",
          "for i in range(10):\n    print(i)  # héllo\n"] * 20


def test_bpe_is_deterministic_and_saved_as_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    tok, again = train_bpe(CORPUS, vocab_size=300), train_bpe(CORPUS, vocab_size=300)
    assert tok.fingerprint() == again.fingerprint()
    assert tok.vocab_size == 300 and tok.bos_id == tok.eos_id == 0
    text = "def mul(a, b):\n    return a * b  # é\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode())
    path = save_tokenizer(tok, str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    assert isinstance(loaded, HFTokenizer) and loaded.encode(text) == ids
    assert loaded.decode([0] + ids + [10 ** 6]) == text + "\ufffd"
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=path)    # an independent reader of the file
    assert fast.encode(text, add_special_tokens=False) == ids


def test_bpe_vocab_size_is_checked():
    with pytest.raises(ValueError, match="257"):
        train_bpe(CORPUS, vocab_size=256)


# ----------------------------------------------------------------------------- documents and splits
def _write(root, files):
    for rel, content in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())


def test_read_documents_sorted_skipping_binary_and_hidden(tmp_path):
    _write(tmp_path, {"src/b.py": "b", "src/a/z.txt": "z", "src/.git/obj": "x", "src/.hidden": "h",
                      "src/pic.png": b"\x89PNG\0\0", "src/empty.txt": "", "one.md": "single"})
    docs = read_documents([str(tmp_path / "src"), str(tmp_path / "one.md")])
    assert [d.name for d in docs] == ["one.md", "src/a/z.txt", "src/b.py"]
    assert [d.text for d in docs] == ["single", "z", "b"]


def test_bad_text_paths(tmp_path):
    _write(tmp_path, {"bin.dat": b"\xff\xfe\x00", "a/x.txt": "1", "b/a/x.txt": "2", "pics/p.png": b"\0"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_documents([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="not UTF-8"):
        read_documents([str(tmp_path / "bin.dat")])
    with pytest.raises(ValueError, match="named"):
        read_documents([str(tmp_path / "a"), str(tmp_path / "b" / "a")])
    with pytest.raises(ValueError, match="no text"):
        read_documents([str(tmp_path / "pics")])


def test_split_is_by_document_and_stable():
    docs = [Document(f"d{i:03d}.py", f"text {i}\n") for i in range(400)]
    train, val = split_documents(docs, 0.1)
    assert 20 <= len(val) <= 60 and len(train) + len(val) == 400
    more_train, more_val = split_documents(docs + [Document("new.py", "x\n")], 0.1)
    assert {d.name for d in val} <= {d.name for d in more_val}       # adding a file moves no other file
    assert {d.name for d in train} <= {d.name for d in more_train}
    two = split_documents(docs[:2], 0.05)
    assert len(two[0]) == len(two[1]) == 1                              # one on each side at least
    assert split_documents(docs, 0.5)[1]
    for bad in (0, 0.5000001, -1, True):
        with pytest.raises(ValueError, match="val_fraction"):
            split_documents(docs, bad)


def test_a_single_document_is_cut_at_a_line():
    doc = Document("book.txt", "".join(f"line {i}\n" for i in range(100)))
    (train,), (val,) = split_documents([doc], 0.1)
    assert train.text + val.text == doc.text and train.text.endswith("\n")
    assert 0.05 < len(val.text) / len(doc.text) < 0.15
    with pytest.raises(ValueError, match="too short"):
        split_documents([Document("x", "a")], 0.1)


def test_stdlib_is_the_default_corpus():
    docs = stdlib_documents()
    names = {d.name for d in docs}
    assert "json/decoder.py" in names and "pydoc_data/topics.py" in names
    assert not [n for n in names if n.startswith(("test/", "site-packages/")) or "/__pycache__/" in n]
    assert [d.name for d in docs] == sorted(names)


# ----------------------------------------------------------------------------- load_text_corpus
def test_corpus_tokens_and_cache(tmp_path):
    _write(tmp_path, {f"corpus/doc{i:02d}.txt": f"document {i}: é\n" for i in range(40)})
    root, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    lines = []
    train, val, tok = load_text_corpus([root], "bytes", val_fraction=0.2, cache_dir=cache, log_fn=lines.append)
    train_docs, val_docs = split_documents(read_documents([root]), 0.2)
    want = lambda ds: [b for d in ds for b in list(d.text.encode()) + [256]]   # noqa: E731
    assert train.tolist() == want(train_docs) and val.tolist() == want(val_docs)
    assert train.dtype == np.uint16 and "(hit)" not in lines[-1]
    again = load_text_corpus([root], "bytes", val_fraction=0.2, cache_dir=cache, log_fn=lines.append)
    assert "(hit)" in lines[-1] and np.array_equal(again.train, train) and np.array_equal(again.val, val)
    _write(tmp_path, {"corpus/doc00.txt": "changed\n"})
    changed = load_text_corpus([root], "bytes", val_fraction=0.2, cache_dir=cache, log_fn=lines.append)
    assert "(hit)" not in lines[-1] and len(os.listdir(cache)) == 2
    assert not np.array_equal(np.concatenate([changed.train, changed.val]), np.concatenate([train, val]))


def test_corpus_with_a_trained_bpe_is_cached_with_its_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    _write(tmp_path, {f"corpus/f{i:02d}.py": CORPUS[i % 3].replace("10", str(i)) for i in range(30)})
    root, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    first = load_text_corpus([root], "bpe:280", cache_dir=cache, val_fraction=0.2)
    (entry,) = os.listdir(cache)
    assert sorted(os.listdir(os.path.join(cache, entry))) == ["info.json", "tokenizer.json", "train.npy", "val.npy"]
    second = load_text_corpus([root], "bpe:280", cache_dir=cache, val_fraction=0.2)
    assert second.tokenizer.fingerprint() == first.tokenizer.fingerprint()
    assert np.array_equal(second.train, first.train)
    train_docs, _ = split_documents(read_documents([root]), 0.2)
    np.testing.assert_array_equal(first.train, tokenize_documents(train_docs, first.tokenizer))
    assert first.tokenizer.decode(first.train) == "".join(d.text for d in train_docs)
    with pytest.raises(ValueError, match="bpe:<vocab size>"):
        load_text_corpus([root], "bpe:lots")


def test_token_dtype_boundary():
    assert token_dtype(2 ** 16) == np.uint16 and token_dtype(2 ** 16 + 1) == np.uint32
