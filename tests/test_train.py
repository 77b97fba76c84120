"""The training loop: learning, microbatching, checkpoints, resume, data parallelism; config
checks, token files, and what a resumed run refuses (the run directory: test_train_rundir)."""

import dataclasses
import json
import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_TRAIN, compiling_fast, quiet
from eae_jax.models.llama import lm_stack
from eae_jax.train import CheckpointError, TrainConfig, init_state, lr_schedule, make_optimizer, make_train_step, train
from eae_jax.train.checkpoint import CheckpointStore
from eae_jax.train.data import TokenFile


def test_tiny_run_learns_and_resumes_bit_exactly(tmp_path, fast_compiles):
    base = dict(preset="tiny", steps=40, log_every=10, checkpoint_every=20, warmup=5, lr=3e-3)
    full = train(TrainConfig(out=str(tmp_path / "full"), **base), log_fn=quiet)
    assert full["final_loss"] < 0.7 * full["first_loss"], full

    # Interrupt at step 20 (the run stops there), then resume to 40.
    part = str(tmp_path / "part")
    train(TrainConfig(out=part, **base), log_fn=quiet, until=20)
    resumed = train(TrainConfig(out=part, **base), log_fn=quiet)
    assert resumed["resumed_from"].endswith("ckpt_00000020")
    a = _restore_latest(str(tmp_path / "full" / "checkpoints"), _template(base))
    b = _restore_latest(os.path.join(part, "checkpoints"), _template(base))
    chex.assert_trees_all_equal(a.params, b.params)
    lines = [json.loads(l) for l in open(os.path.join(part, "log.jsonl"))]
    assert lines[-1]["step"] == 40 and len(lines[-1]["adjoint_norm"]) == 4 + 3


def _restore_latest(directory, template):
    store = CheckpointStore(directory)
    try:
        return store.restore(store.latest(), template)[0]
    finally:
        store.close()


def _template(base):
    cfg = TrainConfig(**base)
    model = cfg.model()
    stack = lm_stack(model)
    return init_state(cfg, model, stack, make_optimizer(cfg))


def test_microbatching_matches_one_big_batch(fast_compiles):
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
    chex.assert_trees_all_close(p4, p1, rtol=1e-4, atol=1e-6)
    # bf16 accumulation: close to fp32, but not identical (it really rounds)
    assert abs(float(gb) - float(g1)) / float(g1) < 2e-2
    assert float(gb) != float(g1)


def test_cli_train_subcommand(tmp_path, capsys, fast_compiles):
    from eae_jax.cli import main

    code = main(["train", "--synthetic", "--steps", "3", "--out", str(tmp_path), "--log-every", "1", "--batch", "4",
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


def test_fp8_run_counts_every_seam_call_and_tracks_bf16(tmp_path, fast_compiles):
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


def test_delayed_grad_scaling_gives_up_when_scales_stay_unobserved(tmp_path, monkeypatch, fast_compiles):
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
def test_step_fallback_reruns_failed_steps_in_high_precision(tmp_path, monkeypatch, fast_compiles):
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


# ----------------------------------------------------------------------------- config, data, resume checks
def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]


@pytest.mark.parametrize("kw, match", [
    (dict(batch=0), "batch must be >= 1, got 0"),  # was silently the preset's batch
    (dict(seq_len=-3), "seq_len must be >= 1, got -3"),
    (dict(lr=0.0), "lr must be a finite number > 0"),
    (dict(lr=-1e-3), "lr must be a finite number > 0"),
    (dict(lr=float("nan")), "lr must be a finite number > 0"),
    (dict(checkpoint_every=0), "checkpoint_every must be >= 1"),  # was ZeroDivisionError mid-run
    (dict(log_every=0), "log_every must be >= 1"),
    (dict(microbatches=0), "microbatches must be >= 1"),
    (dict(warmup=-1), "warmup must be >= 0"),
    (dict(keep=-1), "keep must be >= 0"),
    (dict(grad_clip=-1.0), "grad_clip must be"),
    (dict(weight_decay=-0.1), "weight_decay must be"),
    (dict(devices=0), "devices must be >= 1"),
    (dict(grad_accum_dtype="int8"), "grad_accum_dtype: unknown dtype 'int8'"),
])
def test_bad_config_values_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{**TINY_TRAIN, **kw})


def _write(path, kind):
    if kind == "empty.bin":
        open(path, "wb").close()
    elif kind == "odd.bin":
        open(path, "wb").write(b"\x01" * 41)
    elif kind == "float.npy":
        np.save(path, np.arange(100, dtype=np.float32))
    elif kind == "negative.npy":
        np.save(path, -np.arange(100))
    elif kind == "garbage.npy":
        open(path, "wb").write(b"not an npy file" * 10)
    elif kind == "dir.npy":
        os.mkdir(path)


@pytest.mark.parametrize("kind, match", [
    ("empty.bin", "holds 0 tokens"),  # was numpy's "cannot mmap an empty file", no path
    ("odd.bin", "41 bytes is not a whole number of uint16 tokens"),
    ("float.npy", "holds float32 values; token ids must be integers"),  # was cast silently
    ("negative.npy", "has negative id -99"),  # was accepted
    ("garbage.npy", "cannot read token file"),
    ("dir.npy", "is not a regular file"),
])
def test_bad_token_files_name_the_file(tmp_path, kind, match):
    path = str(tmp_path / kind)
    _write(path, kind)
    with pytest.raises(ValueError, match=match) as err:
        TokenFile(path, vocab_size=256, seq_len=8)
    assert path in str(err.value)


@pytest.mark.parametrize("blocker", ["out", os.path.join("out", "checkpoints")])
def test_out_path_that_is_a_file_fails_before_training(tmp_path, blocker):
    os.makedirs(tmp_path / "out", exist_ok=True)
    if blocker == "out":
        os.rmdir(tmp_path / "out")
    (tmp_path / blocker).write_text("x")
    with pytest.raises(ValueError, match=f"{tmp_path / blocker} exists and is not a directory"):
        train(TrainConfig(out=str(tmp_path / "out"), steps=2, **TINY_TRAIN), log_fn=quiet)


def test_kill_between_checkpoints_resumes_with_one_record_per_step(tmp_path, fast_compiles):
    out = str(tmp_path / "run")
    cfg = dict(TINY_TRAIN, steps=8, checkpoint_every=3, log_every=5)
    # A run killed after step 5: checkpoints at 3 (and the one `until` wrote at 5,
    # removed as if the kill came first), records up to 5, then a torn line.
    # The resumed run used to log steps 4 and 5 twice and glue a record onto the torn line.
    train(TrainConfig(out=out, **{**cfg, "log_every": 1}), log_fn=quiet, until=5)
    # Killed while writing checkpoint 5: Orbax's temporary directory of it is all there is.
    ckpts = os.path.join(out, "checkpoints")
    os.rename(os.path.join(ckpts, "ckpt_00000005"), os.path.join(ckpts, "ckpt_00000005.orbax-checkpoint-tmp-1"))
    killed = records(out)
    with open(os.path.join(out, "log.jsonl"), "a") as f:
        f.write('{"loss": 1.0, "gr')
    resumed = train(TrainConfig(out=out, **{**cfg, "keep": 1}), log_fn=quiet)
    assert resumed["resumed_from"].endswith("ckpt_00000003")
    assert sorted(os.listdir(ckpts)) == ["ckpt_00000008"]  # keep=1; the dead write's temporary is cleaned up
    log = records(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 8]  # 4 (first after resume), 5 and 8 logged once each
    # The redone steps reproduce the killed run's losses bit for bit (same data order and state).
    assert [r["loss"] for r in log[3:5]] == [r["loss"] for r in killed[3:5]]
    # tokens/s of the last record (3 steps since step 5) counts those 3 steps, not log_every
    np.testing.assert_allclose(log[-1]["tokens_per_s"] * log[-1]["step_seconds"], 3 * 2 * 8, rtol=1e-6)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("finished") / "run")
    cfg = dict(TINY_TRAIN, steps=2, checkpoint_every=1)
    with compiling_fast():
        train(TrainConfig(out=out, **cfg), log_fn=quiet)
    return out, cfg


@pytest.mark.parametrize("change, error, match", [
    (dict(lr=1e-2), CheckpointError, r"different config[\s\S]*lr: 0.003 in the checkpoint, 0.01 now"),
    (dict(preset="small"), CheckpointError, r"preset: 'tiny' in the checkpoint, 'small' now"),
    (dict(microbatches=2), CheckpointError, r"microbatches: 1 in the checkpoint, 2 now"),
    (dict(steps=1), ValueError, r"ckpt_00000002 is at step 2, past steps=1"),  # was a silent no-op
    # a fresh run into an old run's directory would mix (and with keep=, delete) checkpoints
    (dict(resume=False), ValueError, r"resume is off but .* already holds checkpoints"),
])
def test_resume_refuses_what_would_not_continue_the_run(finished_run, change, error, match):
    out, cfg = finished_run
    with pytest.raises(error, match=match):
        train(TrainConfig(out=out, **{**cfg, **change}), log_fn=quiet)


def test_resuming_a_finished_run_reports_its_logged_losses(finished_run):
    # Nothing to run: the summary's losses were None.
    out, cfg = finished_run
    summary = train(TrainConfig(out=out, **cfg), log_fn=quiet)
    log = records(out)
    assert summary["steps_run"] == 0 and summary["steps"] == 2
    assert summary["final_loss"] == log[-1]["loss"] and summary["first_loss"] == log[0]["loss"]
    assert np.isfinite(summary["final_loss"])


def test_resume_with_more_steps_says_how_the_learning_rate_moves(finished_run, fast_compiles):
    # The cosine schedule is rebuilt for the new length: the rate at the
    # resumed step jumps, which used to happen without a word.
    out, cfg = finished_run
    said = []
    train(TrainConfig(out=out, **{**cfg, "steps": 10}), log_fn=said.append, until=2)
    (line,) = [m for m in said if "steps changed" in m]
    before = float(lr_schedule(TrainConfig(**{**cfg, "steps": 2}))(2))
    after = float(lr_schedule(TrainConfig(**{**cfg, "steps": 10}))(2))
    assert "from 2 to 10" in line and f"{before:.3e} to {after:.3e}" in line and before != after
    said.clear()
    train(TrainConfig(out=out, **cfg), log_fn=said.append)
    assert not [m for m in said if "steps changed" in m]


def test_nonfinite_state_is_never_checkpointed(tmp_path, fast_compiles):
    out = str(tmp_path / "run")
    # lr 1e30 blows the params up after a couple of steps; log_every is past them,
    # so only the checkpoint guard sees it (it used to save the NaN params).
    with pytest.raises(FloatingPointError,
                       match=r"non-finite .* at step 3; not checkpointed; last checkpoint kept: .*ckpt_00000002"):
        train(TrainConfig(out=out, **{**TINY_TRAIN, "lr": 1e30, "steps": 5, "checkpoint_every": 1, "log_every": 100}),
              log_fn=quiet)
    cfg = TrainConfig(**{**TINY_TRAIN, "lr": 1e30, "steps": 5})
    saved = _restore_latest(os.path.join(out, "checkpoints"), _template(dataclasses.asdict(cfg)))
    assert int(saved.step) == 2
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves((saved.params, saved.opt_state)))


@pytest.mark.parametrize("steps, warmup", [(1, 0), (1, 1), (2, 0), (1, 5)])
def test_short_schedules_build(steps, warmup):
    # steps=1 with warmup=0 raised "cosine_decay_schedule requires positive decay_steps"
    tx = make_optimizer(TrainConfig(**{**TINY_TRAIN, "steps": steps, "warmup": warmup}))
    params = {"w": jax.numpy.ones(3)}
    updates, _ = tx.update({"w": jax.numpy.ones(3)}, tx.init(params), params)
    assert np.all(np.isfinite(np.asarray(updates["w"])))


@pytest.mark.parametrize("args, match", [
    (["--lr", "-1"], "lr must be a finite number > 0"),
    (["--data", "missing.npy"], "token file .*missing.npy does not exist"),
])
def test_cli_bad_input_exits_2_with_the_message(tmp_path, capsys, args, match):
    # like `eae-jax parity`: usage errors exit 2 with one line on stderr, not a traceback
    from eae_jax.cli import main

    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eae-jax train: error: ") and "Traceback" not in err
    assert re.search(match, err), err


def test_fp8_calibration_batch_comes_from_the_token_file(tmp_path, monkeypatch):
    # README: fp8 seams are "calibrated and gated on a batch of the run's own data";
    # with --data the batch used to be synthetic anyway.
    from eae_jax import fp8
    from eae_jax.models.llama import embed
    from eae_jax.models.llama import init_lm
    from eae_jax.train import step as train_step

    np.save(tmp_path / "tok.npy", np.full(64, 7))  # every window is all 7s
    seen = []

    def stop(block, params, xs, *args, **kwargs):
        seen.append(xs[0])
        raise InterruptedError  # the calibration itself is not under test

    monkeypatch.setattr(fp8, "bind_block", stop)
    cfg = TrainConfig(**{**TINY_TRAIN, "dtype": "fp8_e4m3", "data": str(tmp_path / "tok.npy")})
    model = cfg.model()
    params = init_lm(jax.random.key(0), model)
    with pytest.raises(InterruptedError):
        train_step.bind_fp8(cfg, model, params, jax.random.key(1), TokenFile(cfg.data, model.vocab_size, cfg.seq_len))
    expected = embed(params["embed"], jax.numpy.full((2, 8), 7, jax.numpy.int32), model.block.compute_dtype)
    np.testing.assert_array_equal(np.asarray(seen[0]), np.asarray(expected))


def test_window_offsets_reach_past_int32_in_huge_token_files():
    # randint's int32 clipped the offsets of a file with more than 2**31
    # tokens: its tail was never sampled.
    from eae_jax.train.data import draw_starts

    high = 3 * 2**32 + 17
    starts = draw_starts(jax.random.key(0), 4096, high)
    assert starts.dtype == np.int64 and starts.min() >= 0 and starts.max() < high
    assert (starts > 2**32).mean() > 0.5  # uniform: about 2/3 of them lie past 2**32
    # Smaller files keep randint's draws (runs resume onto the same windows).
    small = draw_starts(jax.random.key(3), 64, 1000)
    np.testing.assert_array_equal(small, np.asarray(jax.random.randint(jax.random.key(3), (64,), 0, 1000)))
    with pytest.raises(ValueError, match="no window offsets"):
        draw_starts(jax.random.key(0), 2, 0)


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_every_window_of_a_token_file_is_drawn(tmp_path, extra):
    """A window is seq_len + 1 tokens; a file of exactly that length was
    refused and the last start offset was never drawn."""
    seq = 8
    path = str(tmp_path / "t.npy")
    np.save(path, np.arange(seq + 1 + extra, dtype=np.int32))
    source = TokenFile(path, vocab_size=64, seq_len=seq)
    firsts = set()
    for i in range(40):
        rows = np.asarray(source.batch(jax.random.key(i), 4))
        assert rows.shape == (4, seq + 1)
        np.testing.assert_array_equal(rows - rows[:, :1], np.broadcast_to(np.arange(seq + 1), rows.shape))
        firsts.update(rows[:, 0].tolist())
    assert firsts == set(range(extra + 1))
    np.save(path, np.arange(seq, dtype=np.int32))
    with pytest.raises(ValueError, match=f"holds {seq} tokens; one window needs {seq + 1}"):
        TokenFile(path, vocab_size=64, seq_len=seq)


def test_data_path_is_stored_absolute(tmp_path, monkeypatch):
    """A relative --data path was stored as given: resuming from another
    directory compared equal strings and read another file."""
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(data="tokens.npy", **TINY_TRAIN)
    assert os.path.isabs(cfg.data) and cfg.data == os.path.abspath("tokens.npy")
    assert TrainConfig(**TINY_TRAIN).data is None
