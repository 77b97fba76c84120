"""A run's model shape from flags or a config file over the presets (eae_jax.train.shapes,
TrainConfig, ``eae-jax train --config``)."""

import json

import pytest

from eae_jax.cli import main
from eae_jax.model_files import load_model
from eae_jax.train import PRESETS, TrainConfig
from eae_jax.train.cli import parse_args
from eae_jax.train.config import read_config_file
from eae_jax.train.metrics import flops_per_token
from eae_jax.train.shapes import resolve_shape


def test_flags_override_the_preset_and_the_rest_stays():
    lm = TrainConfig(preset="small", dim=128, depth=3, heads=4, kv_heads=1, seq_len=32).model()
    b = lm.block
    assert (lm.depth, b.dim, b.num_heads, b.num_kv_heads, lm.vocab_size) == (3, 128, 4, 1, 4096)
    assert b.ffn_hidden_dim == 352  # 8/3 * 128 = 341, rounded up to a multiple of 16
    assert TrainConfig(dim=512).model().block.ffn_hidden_dim == 1536  # 1365: a multiple of 256 from 256 on
    assert TrainConfig(preset="small", dim=128, ffn=200).model().block.ffn_hidden_dim == 200
    for name, preset in PRESETS.items():  # the presets' widths follow the same rule
        assert resolve_shape(name, dim=preset["dim"])["ffn_hidden_dim"] == preset["ffn_hidden_dim"], name
    half = TrainConfig(rope_style="half", rope_theta=500.0, norm_eps=1e-5, tie_embeddings=True).model()
    assert (half.block.rope_style, half.block.rope_theta, half.block.norm_eps, half.tie_embeddings) == \
        ("half", 500.0, 1e-5, True)


@pytest.mark.parametrize("kw, match", [
    (dict(dim=66), r"--dim 66 is not divisible by --heads 4 \(the preset's\)"),
    (dict(heads=3), r"--dim 64 \(the preset's\) is not divisible by --heads 3"),
    (dict(kv_heads=3), r"--heads 4 \(the preset's\) is not a multiple of --kv-heads 3"),
    (dict(dim=12, heads=4, kv_heads=1), "head width 3 .* must be even for RoPE"),
    (dict(depth=0), "--depth must be an int >= 1, got 0"),
    (dict(rope_style="rotary"), "--rope-style must be one of interleaved, half"),
    (dict(rope_theta=1.0), "--rope-theta must be a finite number > 1"),
    (dict(norm_eps=-1e-6), "--norm-eps must be a finite number >= 0"),
])
def test_bad_shapes_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


def test_a_config_file_and_flags_over_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\npreset = "tiny"\ndim = 32\ndepth = 2\nseq-len = 24\ntext = []\nlr = 1e-2\n')
    args = parse_args(["--config", str(path), "--depth", "3"])
    cfg = TrainConfig(**{k: getattr(args, k) for k in TrainConfig.__dataclass_fields__})
    assert (cfg.model().dim, cfg.model().depth, cfg.seq_len, cfg.lr, cfg.text) == (32, 3, 24, 1e-2, [])
    jpath = tmp_path / "run.json"
    jpath.write_text(json.dumps({"dim": 48, "heads": 4}))
    assert read_config_file(str(jpath)) == {"dim": 48, "heads": 4}


@pytest.mark.parametrize("name, content, match", [
    ("bad.json", "{", "is not valid JSON"),
    ("bad.toml", "dim = ", "is not valid TOML"),
    ("list.json", "[1, 2]", "must hold a table of settings, got a list"),
    ("typo.json", '{"dimm": 3, "depht": 2}', r"unknown settings \['depht', 'dimm'\]; valid: "),
    ("run.yaml", "dim: 3", "expected a .json or .toml file"),
    ("type.json", '{"dim": "wide"}', "type.json: dim must be None or int, got 'wide'"),
    ("text.json", '{"text": "notes"}', "text.json: text must be None or list of str, got 'notes'"),
])
def test_bad_config_files_exit_2_in_one_line(tmp_path, capsys, name, content, match):
    (tmp_path / name).write_text(content)
    code = main(["train", "--config", str(tmp_path / name), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("eae-jax train: error: "), err
    assert __import__("re").search(match, err), err
    code = main(["train", "--config", str(tmp_path / "missing.json"), "--out", str(tmp_path / "run")])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_a_run_of_a_custom_shape_reads_back_with_it(tmp_path, capsys, fast_compiles):
    (tmp_path / "run.json").write_text(json.dumps({"dim": 32, "depth": 2, "heads": 2, "kv-heads": 1, "ffn": 40}))
    out = str(tmp_path / "run")
    code = main(["train", "--config", str(tmp_path / "run.json"), "--synthetic", "--vocab-size", "300", "--steps",
                 "1", "--batch", "2", "--seq-len", "8", "--out", out, "--no-plot", "--no-tensorboard"])
    assert code == 0, capsys.readouterr().err
    lm = load_model(out).config
    assert (lm.vocab_size, lm.depth, lm.block.dim, lm.block.num_heads, lm.block.num_kv_heads,
            lm.block.ffn_hidden_dim) == (300, 2, 32, 2, 1, 40)


def test_model_flops_count_the_matmul_weights_of_the_params():
    """6 N + 6 L T D with N counted from the initialized params' matrices (not from the formula's terms)."""
    import jax

    from eae_jax.models import init_lm

    for cfg in (TrainConfig(preset="tiny"), TrainConfig(dim=32, heads=2, kv_heads=1, depth=3, ffn=40,
                                                        vocab_size=300, tie_embeddings=True)):
        lm = cfg.model()
        params = init_lm(jax.random.key(0), lm)
        blocks = sum(x.size // lm.depth for x in jax.tree_util.tree_leaves(params["blocks"]) if x.ndim == 3)
        head = lm.vocab_size * lm.dim  # the head matmul (tied or not); the embedding lookup is no matmul
        n = lm.depth * blocks + head
        for seq in (8, 64):
            assert flops_per_token(lm, seq) == 6 * n + 6 * lm.depth * seq * lm.dim
