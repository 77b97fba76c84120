"""interop.llama2c's ``.bin`` reader and writer against an independent oracle.

The files are written in the test with ``struct`` in llama2.c's documented
order (tests/conftest.py `llama2c_bin_bytes`, after export.py and run.c),
every tensor holding values no other tensor holds; the reader's params are
compared tensor by tensor with numpy arrays, and the writer must give the
same bytes back. A file with two tensors swapped must fail the comparison.
"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("eae_runtime")

import interop  # noqa: E402
from conftest import LLAMA2C_BIN_ORDER, llama2c_bin_bytes, llama2c_spec_tensors  # noqa: E402
from interop.errors import UnsupportedConfigError  # noqa: E402

#: eae_jax param path -> run.c's tensor name (stacked block tensors keep the layer axis outermost).
PARAM_OF = {
    ("embed",): "token_embedding_table",
    ("blocks", "attn_norm", "scale"): "rms_att_weight",
    ("blocks", "attn", "wq"): "wq",
    ("blocks", "attn", "wk"): "wk",
    ("blocks", "attn", "wv"): "wv",
    ("blocks", "attn", "wo"): "wo",
    ("blocks", "ffn_norm", "scale"): "rms_ffn_weight",
    ("blocks", "ffn", "w_gate"): "w1",
    ("blocks", "ffn", "w_down"): "w2",
    ("blocks", "ffn", "w_up"): "w3",
    ("final_norm", "scale"): "rms_final_weight",
}
#: Small and GQA (2 query heads per kv head), two layers so the layer axis is checked too.
SHAPE = dict(dim=8, hidden=12, layers=2, heads=4, kv=2, vocab=10, seq=6)


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return np.asarray(tree)


def mismatches(params, tensors):
    """run.c names whose tensor differs (in shape, dtype or any value) from the loaded param."""
    expect = dict(PARAM_OF)
    if "wcls" in tensors:
        expect[("lm_head",)] = "wcls"
    bad = [name for path, name in expect.items()
           if _get(params, path).dtype != np.float32 or _get(params, path).shape != tensors[name].shape
           or not np.array_equal(_get(params, path), tensors[name])]
    extra = sorted(set(params) - {p[0] for p in expect})
    return bad + extra


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("shared", [True, False])
def test_reader_matches_the_format_tensor_by_tensor(tmp_path, version, shared):
    header, tensors = llama2c_spec_tensors(**SHAPE, shared=shared)
    path = tmp_path / "m.bin"
    path.write_bytes(llama2c_bin_bytes(header, tensors, version))
    model = interop.load_llama2c_bin(str(path))
    assert mismatches(model.params, tensors) == []
    cfg = model.config
    assert (cfg.block.dim, cfg.block.ffn_hidden_dim, cfg.depth, cfg.block.num_heads, cfg.block.num_kv_heads,
            cfg.vocab_size, cfg.block.max_seq_len) == header
    assert cfg.tie_embeddings is shared
    assert model.meta["format"] == f"llama2c_bin_v{version}"
    assert (cfg.block.rope_style, cfg.block.rope_theta) == ("interleaved", 10000.0)
    if version == 0:
        cos, sin = model.meta["rope_tables"]
        np.testing.assert_array_equal(cos, tensors["freq_cis_real"])
        np.testing.assert_array_equal(sin, tensors["freq_cis_imag"])


def params_from_tensors(header, tensors):
    """``(params, LMConfig)`` built from the numpy tensors and header (not by interop's reader)."""
    from eae_jax.blocks import BlockConfig
    from eae_jax.models import LMConfig

    dim, hidden, layers, heads, kv, vocab, seq = header
    shared = "wcls" not in tensors
    cfg = LMConfig(vocab, layers, BlockConfig(dim, heads, kv, hidden, norm_eps=1e-5, max_seq_len=seq,
                                              rope_style="interleaved"), tie_embeddings=shared)
    params = {}
    for path, name in PARAM_OF.items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tensors[name]
    if not shared:
        params["lm_head"] = tensors["wcls"]
    return params, cfg


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("shared", [True, False])
def test_writer_gives_the_format_bytes(tmp_path, version, shared):
    """Params taken from the numpy tensors (not from the reader) are written to exactly the oracle's bytes."""
    header, tensors = llama2c_spec_tensors(**SHAPE, shared=shared)
    out = tmp_path / "w.bin"
    interop.save_llama2c_bin(str(out), *params_from_tensors(header, tensors), version=version)
    assert out.read_bytes() == llama2c_bin_bytes(header, tensors, version)


def test_writer_defaults_to_the_legacy_version_and_names_a_bad_one(tmp_path):
    header, tensors = llama2c_spec_tensors(**SHAPE)
    params, cfg = params_from_tensors(header, tensors)
    interop.save_llama2c_bin(str(tmp_path / "d.bin"), params, cfg)
    assert (tmp_path / "d.bin").read_bytes() == llama2c_bin_bytes(header, tensors, 0)
    for version in (-1, 2):
        with pytest.raises(UnsupportedConfigError, match=f"version {version} is not supported"):
            interop.save_llama2c_bin(str(tmp_path / "bad.bin"), params, cfg, version=version)
    assert not (tmp_path / "bad.bin").exists()


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("pair", [("wk", "wv"), ("w1", "w3"), ("rms_att_weight", "rms_ffn_weight")])
def test_a_swapped_pair_in_the_file_fails_the_comparison(tmp_path, version, pair):
    """The oracle sees a reader that would read two same-shape tensors in each other's place."""
    header, tensors = llama2c_spec_tensors(**SHAPE)
    order = list(LLAMA2C_BIN_ORDER[version])
    i, j = order.index(pair[0]), order.index(pair[1])
    order[i], order[j] = order[j], order[i]
    path = tmp_path / "swapped.bin"
    path.write_bytes(llama2c_bin_bytes(header, tensors, version, order=order))
    assert sorted(mismatches(interop.load_llama2c_bin(str(path)).params, tensors)) == sorted(pair)


def test_writer_keeps_the_rope_tables_it_is_given(tmp_path):
    """Tables passed in (an import's, for a byte-exact round trip) are written, not recomputed."""
    header, tensors = llama2c_spec_tensors(**SHAPE)
    up = {k: np.nextafter(tensors[k], np.float32(2)) for k in ("freq_cis_real", "freq_cis_imag")}  # one ulp off
    out = tmp_path / "t.bin"
    interop.save_llama2c_bin(str(out), *params_from_tensors(header, tensors),
                             rope_tables=(up["freq_cis_real"], up["freq_cis_imag"]))
    assert out.read_bytes() == llama2c_bin_bytes(header, {**tensors, **up}, 0)
    assert out.read_bytes() != llama2c_bin_bytes(header, tensors, 0)


def test_writer_names_every_misshaped_table_and_writes_nothing(tmp_path):
    header, tensors = llama2c_spec_tensors(**SHAPE)
    short = np.zeros((3, 1), np.float32)  # seq_len is 6
    out = tmp_path / "bad.bin"
    with pytest.raises(ValueError) as err:
        interop.save_llama2c_bin(str(out), *params_from_tensors(header, tensors), rope_tables=(short, short))
    assert str(err.value) == (f"{out}: nothing written: freq_cis_real: shape (3, 1), the .bin layout needs (6, 1); "
                              "freq_cis_imag: shape (3, 1), the .bin layout needs (6, 1)")
    assert not out.exists()


@pytest.mark.parametrize("version", [0, 1])
def test_a_one_token_vocabulary_is_still_tied(tmp_path, version):
    """vocab_size 1 (the smallest positive) flags a tied classifier: no wcls follows."""
    header, tensors = llama2c_spec_tensors(**{**SHAPE, "vocab": 1})
    path = tmp_path / "v1.bin"
    path.write_bytes(llama2c_bin_bytes(header, tensors, version))
    model = interop.load_llama2c_bin(str(path))
    assert model.config.tie_embeddings and mismatches(model.params, tensors) == []


def test_a_version_2_file_is_refused_by_name(tmp_path):
    import struct

    path = tmp_path / "q8.bin"
    path.write_bytes(struct.pack("<Ii", 0x616B3432, 2) + b"\0" * 248)
    with pytest.raises(interop.errors.UnknownFormatError) as err:
        interop.load_llama2c_bin(str(path))
    assert str(err.value) == (f"{path}: llama2.c version-2 (Q8_0 int8-quantized) .bin files are not supported; "
                              "export version 0 or 1 (float32)")
