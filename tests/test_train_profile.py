"""``--profile``: the trace jax.profiler's tooling reads, and a stage table measured from it
that accounts for the measured step time (eae_jax.train.profile)."""

import gzip
import json
import os

import pytest

from conftest import quiet
from eae_jax.train import TrainConfig, train
from eae_jax.train.profile import (IDLE, UNATTRIBUTED, _leaves, format_table, hlo_scopes, parse_profile_steps,
                                   read_trace, stage_of, stage_table)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A tiny synthetic run with an adjoint pass whose steps 3-5 are profiled."""
    out = str(tmp_path_factory.mktemp("prof") / "run")
    said = []
    summary = train(TrainConfig(preset="tiny", batch=8, seq_len=32, steps=5, passes="int8", profile="3:5",
                                out=out, log_every=100, checkpoint_every=100, tensorboard=False, plot=False),
                    log_fn=said.append)
    return out, summary, said


def test_the_trace_is_read_by_jax_profiler_and_perfetto_tools(profiled):
    out, summary, _ = profiled
    from jax.profiler import ProfileData

    trace = summary["profile"]
    assert trace.startswith(os.path.join(out, "profile")) and trace.endswith(".xplane.pb")
    planes = {p.name for p in ProfileData.from_file(trace).planes}
    assert "/host:CPU" in planes
    events = read_trace(trace)
    assert sorted(events["steps"]) == [3, 4, 5]  # one annotation per profiled step, none else
    assert {n for _, _, n in events["host"]} >= {"batch", "dispatch"}
    # the Perfetto / chrome trace beside it
    (chrome,) = [f for f in os.listdir(os.path.dirname(trace)) if f.endswith(".trace.json.gz")]
    with gzip.open(os.path.join(os.path.dirname(trace), chrome)) as f:
        assert "traceEvents" in json.load(f)


def test_stages_sum_to_the_measured_step_time(profiled):
    out, _, said = profiled
    result = json.load(open(os.path.join(out, "profile", "stages.json")))
    stages, measured = result["stages_s"], result["measured_step_s"]
    attributed = sum(v for k, v in stages.items() if k != UNATTRIBUTED)
    # The stages come from the trace, the step time from the host clock: they agree within 10%.
    assert 0.9 * measured <= attributed <= 1.02 * measured, (attributed, measured, stages)
    for stage in ("forward decoder_block", "backward decoder_block", "backward lm_head[2]", "loss", "passes",
                  "optimizer", "host: batch"):
        assert stages.get(stage, 0) > 0, (stage, stages)
    # the backward re-runs each block and takes its VJP: it outweighs the forward
    assert stages["backward decoder_block"] > stages["forward decoder_block"]
    (table,) = [m for m in said if m.startswith("profile of steps 3-5 (3 steps")]
    assert "sum of stages" in table and "measured step time" in table


def test_profile_steps_parse_and_refuse():
    assert parse_profile_steps("2") == (2, 2) and parse_profile_steps(" 4 : 9 ") == (4, 9)
    for bad, match in [("1", "start at step 2"), ("5:4", "comes before"), ("x", "expected STEP"),
                       ("3:", "expected STEP"), ("", "expected STEP")]:
        with pytest.raises(ValueError, match=match):
            parse_profile_steps(bad)
    with pytest.raises(ValueError, match="profile"):
        TrainConfig(profile="0:3")


def test_stage_names_come_from_the_innermost_scope():
    assert stage_of("jit(step)/while/body/transpose(jvp(backward.decoder_block))/while/body/passes/mul") == "passes"
    assert stage_of("jit(step)/transpose(jvp(loss))/log") == "loss"
    assert stage_of("jit(step)/jvp(forward.embedding[0])/gather") == "forward embedding[0]"
    assert stage_of("jit(step)/my_losses/add") == "other step ops"  # a word inside a name is no scope
    assert stage_of(None) == "other step ops"
    text = ('HloModule jit_step\n  %a.1 = f32[] add(%x, %y), metadata={op_name="jit(step)/optimizer/add"}\n'
            '  ROOT %t = (f32[]) tuple(%a.1)\n  %w.2 = f32[] while(%x), metadata={op_name="jit(step)/while" '
            'source_file="x.py"}\n')
    assert hlo_scopes(text) == {"a.1": "jit(step)/optimizer/add", "w.2": "jit(step)/while"}


def test_the_sweep_shares_overlaps_and_keeps_parents_out():
    # A while loop's event contains its body's: only the leaves count.
    assert _leaves([(0, 10, "m", "while"), (1, 3, "m", "a"), (4, 6, "m", "b"), (12, 13, "m", "c")]) == \
        [(1, 3, "m", "a"), (4, 6, "m", "b"), (12, 13, "m", "c")]
    scopes = {"f": "jit(step)/jvp(forward.blocks)/dot", "o": "jit(step)/optimizer/add"}
    trace = {"steps": {7: (100, 200)},
             "host": [(90, 120, "batch"), (110, 115, "dispatch"), (190, 205, "log")],
             # two ops of the step overlap for 10 ns (two threads), a validation op, an op of another program
             "device": [(120, 150, "jit_step", "f"), (140, 170, "jit_step", "o"), (172, 180, "jit_eval", "v"),
                        (182, 186, "jit_other", "x")]}
    got = stage_table(trace, scopes, "jit_step", "jit_eval", [7])
    ns = {k: round(v * 1e9, 6) for k, v in got.items()}
    assert ns == {"forward blocks": 25, "optimizer": 25, "validation": 8, "other programs": 4,
                  "host: batch": 15, "host: dispatch": 5, "host: log": 10, UNATTRIBUTED: 8}
    assert sum(ns.values()) == 100
    # a gap inside the step program's own activity is the device idling
    idle = stage_table({"steps": {1: (0, 10)}, "host": [(0, 10, "dispatch")],
                        "device": [(1, 3, "jit_step", "f"), (6, 8, "jit_step", "o")]}, scopes, "jit_step", None, [1])
    assert round(idle[IDLE] * 1e9) == 3 and round(idle["host: dispatch"] * 1e9) == 3
    with pytest.raises(ValueError, match="no annotation of step 8"):
        stage_table(trace, scopes, "jit_step", None, [8])


def test_format_table_shows_the_unattributed_rest():
    text = format_table({"optimizer": 0.004, UNATTRIBUTED: 0.001}, steps=1, measured_s=0.005)
    assert "optimizer" in text and "80.0" in text and text.splitlines()[-1].split()[-1] == "20.0"
