"""Pass chains from text (`eae_jax.passes.spec`): every built-in pass by name with all its
hyper-parameters, and one-line errors for everything else."""

import inspect

import pytest

from eae_jax import passes as P
from eae_jax.passes.spec import PASSES, describe, parse_passes


@pytest.mark.parametrize("spec, name", [
    ("int8,clip=1.0", "chain(int8_fake_quant, clip_by_norm(1))"),
    ("clip", "chain(clip_by_norm(1))"),  # the command line's default bound
    ("clip_by_norm(max_norm=0.25)", "chain(clip_by_norm(0.25))"),
    ("topk(0.9, error_feedback=false)", "chain(topk_compress(0.9))"),
    ("topk=0.9", "chain(topk_compress(0.9, ef))"),
    ("fp8(e5m2, scaling=delayed, history_len=4, margin=1)", "chain(fp8_quant(e5m2, delayed))"),
    ("fp16, bf16 ,cast=fp16", "chain(cast_roundtrip(fp16), cast_roundtrip(bf16), cast_roundtrip(fp16))"),
    ("noise(std=0.5),decay=0.1,stats,guard=skip,capture,identity",
     "chain(gaussian_noise(0.5), decay(0.1), statistics, nonfinite_guard(skip), capture, identity)"),
    ("synthetic(hidden_dim=8, lr=0.01, warmup_steps=3, use_synthetic=yes)", "chain(synthetic_gradient)"),
    ("", None), ("  ", None),
])
def test_specs_build_the_named_chains(spec, name):
    chain = parse_passes(spec)
    assert (chain.name if chain is not None else None) == name


def test_hyperparameters_reach_the_factory():
    (syn,) = parse_passes("synthetic(hidden_dim=8, use_synthetic=true, warmup_steps=3)").members
    import jax

    state = syn.init(jax.ShapeDtypeStruct((2, 5), jax.numpy.float32), jax.random.key(0))
    assert state.params["fc1"]["w"].shape == (8, 5)
    (fp8,) = parse_passes("fp8(scaling=delayed, history_len=4)").members
    assert fp8.init(jax.ShapeDtypeStruct((3,), jax.numpy.float32), None).amax_history.shape == (4,)


@pytest.mark.parametrize("spec, match", [
    ("int8=5", "pass 'int8' in 'int8=5': int8 takes no value"),  # was dropped silently
    ("stats(1)", "stats takes no value"),
    ("fp16=bf16", "fp16 takes no value"),
    ("decay", "decay needs strength"),  # was a NoneType message
    ("noise", "noise needs std"),
    ("topk", "topk needs ratio"),
    ("cast", "cast needs dtype"),
    ("int4", "unknown pass 'int4'.*valid: .*synthetic_gradient"),
    ("clip(1, 2)", "2 values for 1 parameter"),
    ("clip(foo=1)", "no parameter 'foo'; clip takes max_norm"),
    ("clip(1, max_norm=2)", "max_norm given twice"),
    ("clip(max_norm=1, 2)", "a value without a name after a named one"),
    ("clip=", "'=' without a value"),
    ("clip=abc", "max_norm must be a number, got 'abc'"),
    ("clip=-1", "max_norm must be > 0"),
    ("clip=nan", "must not be NaN"),
    ("decay=inf", "strength must be finite"),
    ("synthetic(hidden_dim=1.5)", "hidden_dim must be an int"),
    ("synthetic(use_synthetic=maybe)", "use_synthetic must be true or false"),
    ("topk=1", "ratio must be < 1.0"),
    ("guard=boom", "policy must be one of"),
    ("fp8=e3m4", "format must be one of"),
    ("cast=int8", "unknown dtype 'int8'"),
    ("int8,,clip", "empty item"),
    ("clip((1)", "unbalanced '\\('"),
    ("clip=1)", "unbalanced '\\)'"),
    ("clip(1)x", "text after the closing"),
])
def test_bad_specs_are_refused_with_one_line(spec, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_passes(spec)
    assert "\n" not in str(err.value)


def test_every_hyperparameter_of_every_factory_is_in_the_table():
    """The table is read from the signatures: every argument but the initial weights."""
    for entry in PASSES.values():
        sig = set(inspect.signature(entry.factory).parameters) - set(entry.fixed) - {"predictor_params"}
        assert {p.name for p in entry.params} == sig, entry.name


def test_help_lists_every_pass_with_its_parameters():
    text = describe()
    for name in PASSES:
        assert name in text
    assert "warmup_steps: int=0" in text and "error_feedback: bool=true" in text and "strength: float\n" in text
    assert P.synthetic_gradient.__name__ in text
