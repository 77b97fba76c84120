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


# ----------------------------------------------------------------------------- properties
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_VALUES = st.one_of(st.sampled_from(["0", "1", "-1", "0.5", "1e-3", "nan", "inf", "-inf", "true", "no", "e5m2",
                                     "delayed", "skip", "bf16", "fp32", "x", "", "1.5", "1e400", "10"]),
                    st.text("abc=(),. 01", max_size=4))
_KEYS = st.sampled_from(["max_norm", "ratio", "error_feedback", "std", "strength", "policy", "format", "scaling",
                         "history_len", "margin", "hidden_dim", "lr", "warmup_steps", "use_synthetic", "dtype", "bogus"])


@st.composite
def spec_items(draw):
    name = draw(st.one_of(st.sampled_from(sorted(PASSES)), st.sampled_from(["int4", "", "Clip", "clip "])))
    form = draw(st.sampled_from(["bare", "eq", "call"]))
    if form == "bare":
        return name
    if form == "eq":
        return f"{name}={draw(_VALUES)}"
    args = draw(st.lists(st.one_of(_VALUES, st.tuples(_KEYS, _VALUES).map("=".join)), max_size=3))
    return f"{name}({', '.join(args)})"


@settings(max_examples=300, deadline=None)
@given(items=st.lists(spec_items(), max_size=3), junk=st.sampled_from(["", ",", "(", ")", ",,"]))
def test_any_spec_builds_a_chain_or_raises_one_line_value_error(items, junk):
    spec = ",".join(items) + junk
    try:
        chain = parse_passes(spec)
    except ValueError as err:
        assert str(err) and "\n" not in str(err), spec
        return
    assert chain is None or isinstance(chain, P.AdjointTransformation)


_ARGS = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True, allow_infinity=True),
                  st.sampled_from(["e4m3", "e5m2", "current", "delayed", "zero", "raise", "bf16", "fp16", "int8", ""]),
                  st.lists(st.integers(), max_size=2))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted({e.factory.__name__ for e in PASSES.values()})),
       args=st.dictionaries(st.sampled_from(["max_norm", "ratio", "error_feedback", "std", "strength", "policy",
                                             "format", "scaling", "history_len", "margin", "hidden_dim", "lr",
                                             "warmup_steps", "use_synthetic", "dtype"]), _ARGS, max_size=3))
def test_any_factory_arguments_build_a_pass_or_raise_a_named_error(name, args):
    """Every factory refuses a bad hyper-parameter with a TypeError/ValueError naming it,
    and whatever it accepts initialises on a small adjoint."""
    import jax

    factory = next(e.factory for e in PASSES.values() if e.factory.__name__ == name)
    params = set(inspect.signature(factory).parameters)
    args = {k: v for k, v in args.items() if k in params}
    try:
        pass_ = factory(**args)
    except (TypeError, ValueError) as err:
        assert str(err) and "\n" not in str(err), (name, args)
        return
    state = pass_.init(jax.ShapeDtypeStruct((2, 3), jax.numpy.float32), jax.random.key(0))
    assert jax.tree_util.tree_structure(state) is not None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(st.sampled_from(["clip=0.5", "int8", "fp16", "bf16", "fp8(e5m2, delayed)", "decay=0.1",
                                       "noise=0.01", "stats", "topk=0.5", "topk(0.5, false)", "guard=skip",
                                       "synthetic(hidden_dim=2, use_synthetic=true)", "capture", "identity"]),
                      min_size=1, max_size=4))
def test_any_accepted_chain_runs_jitted_and_keeps_its_state_donatable(items):
    import jax
    import jax.numpy as jnp

    from eae_jax.buffers import aliased_leaves

    chain = parse_passes(",".join(items))
    g = jax.random.normal(jax.random.key(0), (2, 3, 4))
    state = chain.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(1))
    ctx = P.PassContext(jnp.int32(0), jnp.int32(0), jnp.int32(0), 2)
    out, state = jax.jit(lambda a, s: chain.update(a, s, ctx), donate_argnums=(1,))(g, state)
    assert out.shape == g.shape and aliased_leaves(state) == []
