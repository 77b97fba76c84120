"""The training loop: learning, microbatching, checkpoints, resume, data parallelism."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax.train import CheckpointError, TrainConfig, init_state, make_optimizer, make_train_step, train
from eae_jax.train import checkpoint as ckpt
from eae_jax.models.llama import lm_stack


def quiet(*args, **kwargs):
    pass


def test_tiny_run_learns_and_resumes_bit_exactly(tmp_path):
    base = dict(preset="tiny", steps=40, log_every=10, checkpoint_every=20, warmup=5, lr=3e-3)
    full = train(TrainConfig(out=str(tmp_path / "full"), **base), log_fn=quiet)
    assert full["final_loss"] < 0.7 * full["first_loss"], full

    # Interrupt at step 20 (the run stops there), then resume to 40.
    part = str(tmp_path / "part")
    train(TrainConfig(out=part, **base), log_fn=quiet, until=20)
    resumed = train(TrainConfig(out=part, **base), log_fn=quiet)
    assert resumed["resumed_from"].endswith("ckpt_00000020.npz")
    a, _ = ckpt.restore(ckpt.latest(str(tmp_path / "full" / "checkpoints")), _template(base))
    b, _ = ckpt.restore(ckpt.latest(os.path.join(part, "checkpoints")), _template(base))
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    lines = [json.loads(l) for l in open(os.path.join(part, "log.jsonl"))]
    assert lines[-1]["step"] == 40 and len(lines[-1]["adjoint_norm"]) == 4 + 3


def _template(base):
    cfg = TrainConfig(**base)
    model = cfg.model()
    stack = lm_stack(model)
    return init_state(cfg, model, stack, make_optimizer(cfg))


def test_microbatching_matches_one_big_batch():
    results = {}
    for micro, accum in [(1, "fp32"), (4, "fp32"), (4, "bf16")]:
        cfg = TrainConfig(preset="tiny", batch=8, microbatches=micro, grad_accum_dtype=accum, lr=1e-2, grad_clip=None)
        model = cfg.model()
        stack = lm_stack(model)
        tx = make_optimizer(cfg)
        state = init_state(cfg, model, stack, tx)
        tokens = jax.random.randint(jax.random.key(5), (8, cfg.seq_len + 1), 0, model.vocab_size)
        step = jax.jit(make_train_step(cfg, stack, tx, model))
        new_state, metrics = step(state, tokens.reshape(micro, 8 // micro, -1))
        results[(micro, accum)] = (metrics["grad_norm"], new_state.params)
    g1, p1 = results[(1, "fp32")]
    g4, p4 = results[(4, "fp32")]
    gb, pb = results[(4, "bf16")]
    np.testing.assert_allclose(float(g4), float(g1), rtol=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(p4), jax.tree_util.tree_leaves(p1)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
    # bf16 accumulation: close to fp32, but not identical (it really rounds)
    assert abs(float(gb) - float(g1)) / float(g1) < 2e-2
    assert float(gb) != float(g1)


def test_checkpoint_is_atomic_and_errors_name_the_problem(tmp_path):
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": {"c": jnp.ones((4,), jnp.int32)}, "k": jax.random.key(3)}
    path = ckpt.save(str(tmp_path), 7, tree, metadata={"note": "x"})
    assert os.path.basename(path) == "ckpt_00000007.npz"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ckpt_tmp_")]
    back, meta = ckpt.restore(path, tree)
    assert meta["note"] == "x" and meta["step"] == 7
    np.testing.assert_array_equal(np.asarray(back["a"]), np.asarray(tree["a"]))
    assert jnp.array_equal(jax.random.key_data(back["k"]), jax.random.key_data(tree["k"]))

    with pytest.raises(CheckpointError, match=r"missing \['b'\]\['d'\]"):
        ckpt.restore(path, {"a": tree["a"], "b": {"c": tree["b"]["c"], "d": jnp.zeros(2)}, "k": tree["k"]})
    with pytest.raises(CheckpointError, match=r"\['a'\]: shape \(2, 3\), expected \(3, 2\)"):
        ckpt.restore(path, {"a": jnp.zeros((3, 2)), "b": tree["b"], "k": tree["k"]})
    with pytest.raises(CheckpointError, match=r"unexpected \['k'\]"):
        ckpt.restore(path, {"a": tree["a"], "b": tree["b"]})
    truncated = tmp_path / "ckpt_00000008.npz"
    truncated.write_bytes(open(path, "rb").read()[:100])
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        ckpt.restore(str(truncated), tree)

    # keep=2 drops the oldest only after the new file is in place
    for s in (8, 9, 10):
        ckpt.save(str(tmp_path), s, tree, keep=2)
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))] == ["ckpt_00000009.npz",
                                                                                    "ckpt_00000010.npz"]


def test_cli_train_subcommand(tmp_path, capsys):
    from eae_jax.cli import main

    code = main(["train", "--steps", "3", "--out", str(tmp_path), "--log-every", "1", "--batch", "4",
                 "--passes", "int8,clip=0.001", "--boundary-dtype", "bf16"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and np.isfinite(summary["final_loss"])
    records = [json.loads(l) for l in open(tmp_path / "log.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3]
    # the int8 + clip chain really acted on every float boundary's adjoint
    before, after = np.array(records[-1]["adjoint_norm"]), np.array(records[-1]["adjoint_norm_after_passes"])
    assert before[-1] > 0.01  # the loss gradient at the logits, before the passes
    np.testing.assert_allclose(after[-1], 0.001, rtol=1e-3)  # clipped
    assert np.all(after[1:] <= 0.001 * (1 + 1e-3)) and before[0] == 0.0  # token ids take no adjoint


def test_fp8_run_counts_every_seam_call_and_tracks_bf16(tmp_path):
    base = dict(preset="tiny", steps=12, log_every=12, checkpoint_every=100, warmup=3)
    bf16 = train(TrainConfig(dtype="bf16", out=str(tmp_path / "bf16"), **base), log_fn=quiet)
    f8 = train(TrainConfig(dtype="fp8_e4m3", out=str(tmp_path / "fp8"), **base), log_fn=quiet)
    depth = TrainConfig(**base).model().depth
    # qkv, o and ffn seams of every layer, once per step: the backward's recomputation is not counted
    assert f8["fp8"]["calls"] == 12 * depth * 3
    assert f8["fp8"]["fp8_calls"] + f8["fp8"]["fallbacks"] == f8["fp8"]["calls"]
    assert f8["fp8"]["gate_worst_cos"] >= 0.999
    assert f8["final_loss"] != bf16["final_loss"]  # the fp8 path really ran
    assert abs(f8["final_loss"] - bf16["final_loss"]) / bf16["final_loss"] < 0.05
    # The default: the step guard with delayed gradient scaling.
    assert (TrainConfig().fp8_fallback, TrainConfig().fp8_grad_scaling) == ("step", "delayed")
    assert f8["fp8"]["grad_scaling"] == "delayed" and f8["fp8"]["grad_clipped"] == 0
    assert f8["fp8"]["weight_scaling"] == ["delayed"]
    # Falling back per block call with current gradient scaling counts the
    # same calls and trains like it.
    cur = train(TrainConfig(dtype="fp8_e4m3", fp8_fallback="block", fp8_grad_scaling="current",
                            out=str(tmp_path / "fp8c"), **base), log_fn=quiet)
    assert cur["fp8"]["calls"] == f8["fp8"]["calls"] and cur["fp8"]["grad_scaling"] == "current"
    assert cur["fp8"]["weight_scaling"] == ["delayed"]
    assert cur["final_loss"] != f8["final_loss"]  # the gradient scales really differ
    assert abs(cur["final_loss"] - f8["final_loss"]) / f8["final_loss"] < 0.02
    # Delayed gradient scaling with the block guard and per-channel weight
    # scales: the first step observes gradients (current scaling), then the
    # previous step's scales are used; a resumed run starts delayed straight
    # away and trains like the step guard with delayed weight scales.
    said = []
    dcfg = dict(dtype="fp8_e4m3", fp8_fallback="block", fp8_weight_scaling="channel", out=str(tmp_path / "fp8d"))
    dl = train(TrainConfig(**dcfg, **{**base, "checkpoint_every": 6}), log_fn=said.append, until=6)
    assert "fp8: gradient scales observed; delayed gradient scaling from step 2" in said
    said.clear()
    dl = train(TrainConfig(**dcfg, **{**base, "checkpoint_every": 6}), log_fn=said.append)
    assert dl["resumed_from"] and not [m for m in said if "delayed gradient scaling from" in m]
    assert dl["fp8"]["calls"] == f8["fp8"]["calls"] and dl["fp8"]["grad_scaling"] == "delayed"
    assert dl["fp8"]["weight_scaling"] == ["channel"]
    assert dl["fp8"]["grad_clipped"] == 0
    assert dl["final_loss"] != f8["final_loss"]
    assert abs(dl["final_loss"] - f8["final_loss"]) / f8["final_loss"] < 0.02


def test_bad_config_errors():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        TrainConfig(preset="huge")
    with pytest.raises(ValueError, match="must split into microbatches=3"):
        TrainConfig(batch=16, microbatches=3)
    with pytest.raises(ValueError, match="unknown dtype 'fp7'; valid names are fp32, fp16, bf16, fp8_e4m3, fp8_e5m2"):
        TrainConfig(dtype="fp7")
    with pytest.raises(ValueError, match="fp8 seams compute their forward in float8_e4m3fn"):
        TrainConfig(dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="unknown fp8_scaling 'dynamic'"):
        TrainConfig(dtype="fp8_e4m3", fp8_scaling="dynamic")
    with pytest.raises(ValueError, match="unknown fp8_fallback 'layer'; valid: block, step"):
        TrainConfig(dtype="fp8_e4m3", fp8_fallback="layer")
    with pytest.raises(ValueError, match="unknown fp8_grad_scaling 'late'; valid: current, delayed"):
        TrainConfig(dtype="fp8_e4m3", fp8_grad_scaling="late")
    with pytest.raises(ValueError, match="unknown fp8_weight_scaling 'row'; valid: channel, delayed"):
        TrainConfig(dtype="fp8_e4m3", fp8_weight_scaling="row")
    with pytest.raises(ValueError, match="unknown pass 'int4'"):
        from eae_jax.train import parse_passes
        parse_passes("int8,int4")


DP_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np, json, sys
from eae_jax.train import TrainConfig, train
res = {}
for devices in (1, 8):
    out = sys.argv[1] + f"/dp{devices}"
    s = train(TrainConfig(preset="tiny", steps=6, batch=16, devices=devices, out=out, log_every=1,
                          checkpoint_every=100), log_fn=lambda *a: None)
    res[devices] = s["final_loss"]
print(json.dumps({"n": jax.device_count(), **{str(k): v for k, v in res.items()}}))
"""


def test_data_parallel_over_8_cpu_devices_matches_one_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", DP_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["n"] == 8
    np.testing.assert_allclose(res["8"], res["1"], rtol=1e-4)


def test_delayed_grad_scaling_gives_up_when_scales_stay_unobserved(tmp_path, monkeypatch):
    """A seam that keeps falling back never observes its gradients: the run
    stays with current scaling after a few steps and says so."""
    from eae_jax.train import loop

    monkeypatch.setattr(loop, "_grad_scales_observed", lambda bound, state: False)
    monkeypatch.setattr(loop, "DELAYED_SWITCH_STEPS", 1)
    said = []
    summary = train(TrainConfig(preset="tiny", steps=2, log_every=10, checkpoint_every=100, dtype="fp8_e4m3",
                                fp8_grad_scaling="delayed", out=str(tmp_path)), log_fn=said.append)
    assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])
    assert [m for m in said if "staying with current gradient scaling" in m and "after 1 steps" in m]
    assert summary["fp8"]["grad_scaling"] == "current"  # what the steps used, not what was asked for
    assert not [m for m in said if "delayed gradient scaling from" in m]


@pytest.mark.filterwarnings("ignore::eae_jax.fp8.Fp8FallbackWarning")  # the forced fallbacks are said once per seam
def test_step_fallback_reruns_failed_steps_in_high_precision(tmp_path, monkeypatch):
    """fp8_fallback='step': a step whose checks fail is dropped and rerun
    without fp8 (forced here on every step: the run then equals the bf16
    run, and every seam call is counted as a fallback). With nothing failing
    it trains like the block fallback (test_fp8_run_counts_every_seam_call_and_tracks_bf16)."""
    base = dict(preset="tiny", steps=4, log_every=10, checkpoint_every=100, warmup=2)
    calls = base["steps"] * TrainConfig(**base).model().depth * 3  # qkv, o and ffn seams of every layer
    # Microbatches: one decision per step over all of them, every call counted.
    mb = train(TrainConfig(dtype="fp8_e4m3", fp8_fallback="step", microbatches=2, out=str(tmp_path / "mb"),
                           **{**base, "batch": 8}), log_fn=quiet)
    assert mb["fp8"]["calls"] == 2 * calls and mb["fp8"]["fallbacks"] == 0

    from eae_jax.fp8 import state as fp8_state

    monkeypatch.setattr(fp8_state, "own_fallbacks", lambda seen: jnp.ones_like(seen["counts"]["calls"]))
    said = []
    forced = train(TrainConfig(dtype="fp8_e4m3", fp8_fallback="step", out=str(tmp_path / "forced"), **base),
                   log_fn=said.append)
    bf16 = train(TrainConfig(dtype="bf16", out=str(tmp_path / "bf16"), **base), log_fn=quiet)
    assert len([m for m in said if "rerun in high precision" in m]) == 4
    assert forced["steps"] == 4 and forced["final_loss"] == pytest.approx(bf16["final_loss"], rel=1e-6)
    assert forced["fp8"]["fallbacks"] == forced["fp8"]["calls"] == calls


def test_save_removes_temporaries_of_killed_writers_only(tmp_path):
    # A writer killed between its temporary's creation and the rename left
    # '.ckpt_tmp_*' files forever; a live writer's must survive.
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    names = {"dead": f".ckpt_tmp_{dead_pid}_x1.npz", "live": f".ckpt_tmp_{os.getpid()}_x2.npz",
             "legacy_old": ".ckpt_tmp_ab3k9q.npz", "legacy_new": ".ckpt_tmp_zz81mm.npz"}
    for n in names.values():
        (tmp_path / n).write_bytes(b"partial")
    old = os.path.getmtime(tmp_path / names["legacy_old"]) - 2 * 24 * 3600
    os.utime(tmp_path / names["legacy_old"], (old, old))
    ckpt.save(str(tmp_path), 1, {"a": np.ones(3)})
    left = set(os.listdir(tmp_path))
    assert names["dead"] not in left and names["legacy_old"] not in left
    assert names["live"] in left and names["legacy_new"] in left and "ckpt_00000001.npz" in left
    np.testing.assert_array_equal(ckpt.restore(str(tmp_path / "ckpt_00000001.npz"), {"a": np.zeros(3)})[0]["a"],
                                  np.ones(3))
