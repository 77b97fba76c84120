"""interop.llama2c's readers and writer against an independent oracle.

The files are written in the test with ``struct`` in llama2.c's documented
order (tests/conftest.py `llama2c_bin_bytes`, after export.py and run.c),
every tensor holding values no other tensor holds; the reader's params are
compared tensor by tensor with numpy arrays, and the writer must give the
same bytes back. A file with two tensors swapped must fail the comparison.
The ``.pt`` reader gets a checkpoint written with ``torch.save`` from the
same tensors under llama2.c's state-dict names.
"""

import hashlib

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
    assert (cfg.block.rope_style, cfg.block.rope_theta, cfg.block.norm_eps) == ("interleaved", 10000.0, 1e-5)
    dim, hidden, layers, heads, kv, vocab, seq = header
    assert model.meta["model_args"] == {"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv,
                                        "vocab_size": vocab, "hidden_dim": hidden, "max_seq_len": seq,
                                        "norm_eps": 1e-5}
    assert model.meta["source"] == str(path)
    assert model.meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
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


def test_the_bin_loader_names_a_file_of_another_format(tmp_path):
    import torch

    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(1)}, str(path))
    with pytest.raises(interop.errors.UnknownFormatError) as err:
        interop.load_llama2c_bin(str(path))
    assert str(err.value) == f"{path}: not a llama2.c .bin file (detected torch_pickle)"


@pytest.mark.parametrize("version", [0, 1])
def test_writer_stores_float32_whatever_the_dtype_of_params_and_tables(tmp_path, version):
    """bfloat16 params and float64 RoPE tables are written as the float32 the format holds."""
    import ml_dtypes

    header, tensors = llama2c_spec_tensors(**SHAPE)
    tables = ("freq_cis_real", "freq_cis_imag")
    # the weights rounded to bfloat16 (the oracle writes them back as float32), the tables kept
    rounded = {k: v if k in tables else v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in tensors.items()}
    params, cfg = params_from_tensors(header, {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()})
    out = tmp_path / "bf16.bin"
    interop.save_llama2c_bin(str(out), params, cfg, version=version,
                             rope_tables=tuple(tensors[k].astype(np.float64) for k in tables))
    assert out.read_bytes() == llama2c_bin_bytes(header, rounded, version)


@pytest.mark.parametrize("extra", [-4, 4])
def test_a_version_1_body_of_the_wrong_size_is_named(tmp_path, extra):
    """The version-1 header passes detect_format on its own; the reader checks the body's size."""
    header, tensors = llama2c_spec_tensors(**SHAPE)
    data = llama2c_bin_bytes(header, tensors, 1)
    path = tmp_path / "v1.bin"
    path.write_bytes(data[:extra] if extra < 0 else data + b"\0" * extra)
    with pytest.raises(interop.errors.CorruptCheckpointError) as err:
        interop.load_llama2c_bin(str(path))
    kind = "is truncated" if extra < 0 else "has trailing bytes"
    assert str(err.value) == f"{path}: header says {len(data)} bytes, the file has {len(data) + extra}: it {kind}"


@pytest.mark.parametrize("err", [1e-5, float(np.nextafter(1e-5, 1.0))])
def test_rope_tables_off_by_the_limit_are_kept_and_beyond_it_refused(tmp_path, monkeypatch, err):
    """The RoPE check's limit (1e-5) met exactly passes; one float64 ulp beyond it is refused by name.

    No float32 table lands exactly on the limit, so the distance is stood in for."""
    header, tensors = llama2c_spec_tensors(**SHAPE)
    path = tmp_path / "m.bin"
    path.write_bytes(llama2c_bin_bytes(header, tensors, 0))
    seen = []
    monkeypatch.setattr(interop.llama2c, "rope_tables_error", lambda cos, sin, head_dim: seen.append(
        (cos, sin, head_dim)) or err)
    if err == 1e-5:
        assert interop.load_llama2c_bin(str(path)).meta["rope_tables_max_abs_diff"] == err
    else:
        with pytest.raises(UnsupportedConfigError) as info:
            interop.load_llama2c_bin(str(path))
        assert str(info.value) == (f"{path}: its RoPE tables differ from base-10000 tables by up to 1e-05; only "
                                   "llama2.c's standard RoPE is supported")
    (cos, sin, head_dim), = seen
    assert head_dim == SHAPE["dim"] // SHAPE["heads"]
    np.testing.assert_array_equal(cos, tensors["freq_cis_real"])
    np.testing.assert_array_equal(sin, tensors["freq_cis_imag"])


#: run.c's name -> llama2.c's state-dict name (``{i}``: the layer of a stacked tensor).
SD_NAME = {"token_embedding_table": "tok_embeddings.weight", "rms_final_weight": "norm.weight",
           "wcls": "output.weight", "rms_att_weight": "layers.{i}.attention_norm.weight",
           "rms_ffn_weight": "layers.{i}.ffn_norm.weight", "wq": "layers.{i}.attention.wq.weight",
           "wk": "layers.{i}.attention.wk.weight", "wv": "layers.{i}.attention.wv.weight",
           "wo": "layers.{i}.attention.wo.weight", "w1": "layers.{i}.feed_forward.w1.weight",
           "w2": "layers.{i}.feed_forward.w2.weight", "w3": "layers.{i}.feed_forward.w3.weight"}


def write_llama2c_pt(path, header, tensors, **extra_model_entries):
    """Write ``tensors`` as llama2.c's train.py saves a checkpoint (``torch.save``, tied head stored twice);
    returns its ``model_args``."""
    import torch

    dim, hidden, layers, heads, kv, vocab, seq = header
    model = {}
    for name, key in SD_NAME.items():
        if name in tensors:
            for i in range(layers if "{i}" in key else 1):
                model[key.format(i=i)] = torch.from_numpy(tensors[name][i] if "{i}" in key else tensors[name])
    model.setdefault("output.weight", model["tok_embeddings.weight"])
    args = {"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv, "vocab_size": vocab,
            "multiple_of": 32, "norm_eps": 1e-5, "max_seq_len": seq, "dropout": 0.0, "hidden_dim": hidden}
    torch.save({"model_args": args, "model": {**model, **extra_model_entries}, "iter_num": 3}, str(path))
    return args


@pytest.mark.parametrize("kind", ["pt", "bin"])
def test_load_llama2c_reads_either_kind_in_the_dtype_asked_for(tmp_path, kind):
    import ml_dtypes

    header, tensors = llama2c_spec_tensors(**SHAPE)
    path = tmp_path / f"m.{kind}"
    if kind == "pt":
        write_llama2c_pt(path, header, tensors)
    else:
        path.write_bytes(llama2c_bin_bytes(header, tensors, 1))
    model = interop.load_llama2c(str(path), dtype="bfloat16")
    assert model.meta["format"] == {"pt": "llama2c_pt", "bin": "llama2c_bin_v1"}[kind]
    assert model.meta["source"] == str(path) and model.config.tie_embeddings
    for param_path, name in PARAM_OF.items():
        assert _get(model.params, param_path).dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(_get(model.params, param_path), tensors[name].astype(ml_dtypes.bfloat16))


def test_load_llama2c_names_a_checkpoint_of_another_kind(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(interop.errors.UnknownFormatError) as err:
        interop.load_llama2c(str(tmp_path))
    assert str(err.value) == f"{tmp_path}: not a llama2.c checkpoint (detected hf_dir)"


def test_pt_reader_unties_on_request_and_names_the_file(tmp_path):
    header, tensors = llama2c_spec_tensors(**SHAPE)
    path = tmp_path / "ckpt.pt"
    args = write_llama2c_pt(path, header, tensors)
    model = interop.load_llama2c_pt(str(path), tie_embeddings=False)
    assert not model.config.tie_embeddings
    assert mismatches(model.params, {**tensors, "wcls": tensors["token_embedding_table"]}) == []
    assert model.meta == {"format": "llama2c_pt", "model_args": args, "other_entries": ["iter_num"],
                          "dtypes": ["float32"], "source": str(path)}
    write_llama2c_pt(path, header, tensors, note="not a tensor")
    with pytest.raises(interop.errors.UnknownFormatError) as err:
        interop.load_llama2c_pt(str(path))
    assert str(err.value).startswith(f"{path}: expected a state dict of tensors")
    del tensors["w2"]
    write_llama2c_pt(path, header, tensors)
    with pytest.raises(interop.errors.CheckpointMismatchError) as err:
        interop.load_llama2c_pt(str(path))
    assert str(err.value).startswith(f"{path}:") and "layers.1.feed_forward.w2.weight" in str(err.value)


@pytest.mark.parametrize("ckpt, got", [([1, 2], "list"), (["model_args", "model"], "list"),
                                       ({"model": {}}, "['model']"), ({"model_args": {}}, "['model_args']")])
def test_a_checkpoint_without_model_args_and_model_is_named(ckpt, got):
    with pytest.raises(interop.errors.UnknownFormatError) as err:
        interop.import_llama2c_checkpoint(ckpt)
    assert str(err.value) == ("llama2.c checkpoint: a llama2.c checkpoint is a dict with 'model_args' and 'model'; "
                              f"got {got}")


def test_model_args_name_every_field_and_refuse_what_llama2c_cannot_express():
    from eae_jax.blocks import BlockConfig
    from eae_jax.models import LMConfig

    block = BlockConfig(16, 4, 2, 20, norm_eps=1e-6, max_seq_len=7, rope_style="interleaved")
    assert interop.llama2c.model_args_from_config(LMConfig(11, 3, block)) == {
        "dim": 16, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 11, "norm_eps": 1e-6,
        "max_seq_len": 7, "hidden_dim": 20, "multiple_of": 256, "dropout": 0.0}
    for style, theta in (("half", 10000.0), ("interleaved", 500000.0)):
        cfg = LMConfig(11, 3, BlockConfig(16, 4, 2, 20, rope_style=style, rope_theta=theta))
        with pytest.raises(UnsupportedConfigError) as err:
            interop.llama2c.model_args_from_config(cfg)
        assert str(err.value) == ("llama2.c models use interleaved RoPE with base 10000; this model has "
                                  f"rope_style={style!r}, rope_theta={theta}")


@pytest.mark.parametrize("ulps, excess", [(4, 0.0), (6, 2.0)])
def test_rope_tables_error_allows_four_ulps_of_the_angle(ulps, excess):
    """Angles 0 and 1 (head_dim 2): at position 1 a float32 angle ulp is 2^-23; a cos off by
    exactly 4 of them counts nothing, 6 count the 2 beyond (float64 tables, so no rounding)."""
    cos = np.cos([[0.0], [1.0]]) + np.array([[0.0], [ulps * 2.0 ** -23]])
    sin = np.sin([[0.0], [1.0]])
    assert interop.llama2c.rope_tables_error(cos, sin, 2) == pytest.approx(excess * 2.0 ** -23, abs=1e-15)


@pytest.mark.parametrize("base, ffn, hidden", [
    ({"hidden_dim": None, "multiple_of": 32}, 64, None),   # llama2.c's rule gives 64: left to the rule
    ({"hidden_dim": None, "multiple_of": 32}, 20, 20),     # the rule would not give 20
    ({"hidden_dim": 100, "multiple_of": 32}, 64, 64),      # a stale number is replaced
    ({"multiple_of": 32}, 64, 64),                         # no hidden_dim in the base: written
    ({"hidden_dim": None}, 256, None),                     # multiple_of defaults to 256: the rule gives 256
])
def test_model_args_keep_a_none_hidden_dim_only_where_the_rule_gives_it(base, ffn, hidden):
    """llama2.c's rule for dim 16: int(2 * 4 * 16 / 3) = 42, rounded up to a multiple of
    multiple_of (64 for 32, 256 for 256)."""
    from eae_jax.blocks import BlockConfig
    from eae_jax.models import LMConfig

    cfg = LMConfig(11, 1, BlockConfig(16, 4, 2, ffn, rope_style="interleaved"))
    args = interop.llama2c.model_args_from_config(cfg, base)
    assert "hidden_dim" in args and args["hidden_dim"] == hidden
    assert args["multiple_of"] == base.get("multiple_of", 256) and args["dropout"] == 0.0


def test_model_args_missing_a_required_field_are_named():
    with pytest.raises(UnsupportedConfigError) as err:
        interop.llama2c.lm_config_from_model_args({"n_heads": 2, "dim": 8})
    assert str(err.value) == "llama2.c model_args lacks ['n_layers', 'vocab_size']; got keys ['dim', 'n_heads']"


def test_model_args_defaults_are_llama2c_s():
    """A tied head, and llama2.c's defaults for the fields its ModelArgs may leave out: multiple_of
    256 (hidden 256 for dim 16), as many kv heads as heads, norm_eps 1e-5, max_seq_len 2048."""
    import jax.numpy as jnp

    args = {"dim": 16, "n_layers": 1, "n_heads": 4, "vocab_size": 11}
    cfg = interop.llama2c.lm_config_from_model_args(args, compute_dtype=jnp.bfloat16)
    assert cfg.tie_embeddings is True  # llama2.c's Transformer ties its head; importers untie
    b = cfg.block
    assert (b.ffn_hidden_dim, b.num_kv_heads, b.norm_eps, b.max_seq_len) == (256, 4, 1e-5, 2048)
    assert (b.rope_style, b.rope_theta, b.compute_dtype) == ("interleaved", 10000.0, jnp.bfloat16)
    assert interop.llama2c.lm_config_from_model_args({**args, "norm_eps": 1e-6}).block.norm_eps == 1e-6
