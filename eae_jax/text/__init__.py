"""Text for language models: tokenizers and corpora.

* `load_text_corpus(paths, tokenizer)` -> ``(train_tokens, val_tokens,
  tokenizer)``: files and folders, or by default the Python standard
  library's own source and docs, split by document, tokenized and cached.
* Tokenizers with one interface (`Tokenizer`): `ByteTokenizer` (the default,
  no file and no library), byte-level BPE trained with the ``tokenizers``
  library (`train_bpe`, saved as ``tokenizer.json``), an existing
  ``tokenizer.json`` (`HFTokenizer`) or llama2.c ``tokenizer.bin``
  (`Llama2cTokenizer`); `load_tokenizer` reads a spec, `save_tokenizer` /
  `find_tokenizer` keep one in a run directory.
"""

from eae_jax.text.corpus import (
    Document,
    TextCorpus,
    default_cache_dir,
    load_text_corpus,
    read_documents,
    split_documents,
    stdlib_documents,
    tokenize_documents,
)
from eae_jax.text.llama2c_tokenizer import Llama2cTokenizer
from eae_jax.text.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    find_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_bpe,
)

__all__ = [
    "ByteTokenizer", "Document", "HFTokenizer", "Llama2cTokenizer", "TextCorpus", "Tokenizer", "default_cache_dir",
    "find_tokenizer", "load_text_corpus", "load_tokenizer", "read_documents", "save_tokenizer", "split_documents",
    "stdlib_documents", "tokenize_documents", "train_bpe",
]
