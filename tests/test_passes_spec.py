"""Pass chains from text (`eae_jax.passes.spec`): every built-in pass by name with all its
hyper-parameters, and one-line errors for everything else."""

import inspect
import typing

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


# ----------------------------------------------------------------------------- the parser, piece by piece
from eae_jax.passes.spec import Param, PassEntry, _parse_item, _split_top, _text_kind  # noqa: E402

REQUIRED = inspect.Parameter.empty  # a parameter without a default

#: The command line's names (`eae-jax train --help`, docs/training.md):
#: name -> (factory, the arguments the name fixes, the command line's defaults).
_TABLE = {
    "clip_by_norm": (P.clip_by_norm, {}, {"max_norm": 1.0}), "clip": (P.clip_by_norm, {}, {"max_norm": 1.0}),
    "int8_fake_quant": (P.int8_fake_quant, {}, {}), "int8": (P.int8_fake_quant, {}, {}),
    "cast_roundtrip": (P.cast_roundtrip, {}, {}), "cast": (P.cast_roundtrip, {}, {}),
    "fp16": (P.cast_roundtrip, {"dtype": "fp16"}, {}), "bf16": (P.cast_roundtrip, {"dtype": "bf16"}, {}),
    "fp8_quant": (P.fp8_quant, {}, {}), "fp8": (P.fp8_quant, {}, {}),
    "decay": (P.decay, {}, {}),
    "gaussian_noise": (P.gaussian_noise, {}, {}), "noise": (P.gaussian_noise, {}, {}),
    "statistics": (P.statistics, {}, {}), "stats": (P.statistics, {}, {}),
    "topk_compress": (P.topk_compress, {}, {}), "topk": (P.topk_compress, {}, {}),
    "nonfinite_guard": (P.nonfinite_guard, {}, {}), "guard": (P.nonfinite_guard, {}, {}),
    "synthetic_gradient": (P.synthetic_gradient, {}, {}), "synthetic": (P.synthetic_gradient, {}, {}),
    "capture": (P.capture, {}, {}), "identity": (P.identity, {}, {}),
}


def test_the_table_holds_every_name_with_its_factory_and_fixed_arguments():
    assert set(PASSES) == set(_TABLE)
    for name, (factory, fixed, defaults) in _TABLE.items():
        entry = PASSES[name]
        assert (entry.name, entry.factory, dict(entry.fixed), dict(entry.defaults)) == (name, factory, fixed, defaults)


def test_help_is_one_aligned_line_per_factory_and_fixed_arguments():
    lines = describe().split("\n")
    assert len(lines) == 14
    assert lines[0] == "  clip_by_norm | clip" + " " * 17 + " max_norm: float=1.0"
    assert lines[3] == "  fp16" + " " * 32 + " (no value)"
    assert lines[9] == "  topk_compress | topk" + " " * 16 + " ratio: float, error_feedback: bool=true"
    assert "  decay" + " " * 31 + " strength: float" in lines
    for line in lines:
        assert line.startswith("  ") and line[38] == " " and line[39] != " ", line


@pytest.mark.parametrize("kind, text, value", [
    (bool, " Off ", False), (bool, "TRUE", True), (bool, "1", True), (bool, "0", False), (bool, "yes", True),
    (bool, "no", False), (bool, "on", True), (bool, "off", False),
    (int, " 7 ", 7), (int, "-3", -3), (float, "5", 5.0), (float, " 1e-3 ", 1e-3), (float, "-inf", float("-inf")),
    (str, "  e5m2 ", "e5m2"), (str, "Skip", "Skip"),
])
def test_a_value_is_parsed_to_its_kind(kind, text, value):
    got = Param("x", kind, REQUIRED).parse(text)
    assert got == value and type(got) is kind


@pytest.mark.parametrize("kind, text, message", [
    (bool, "", "flag must be true or false, got ''"),
    (bool, "2", "flag must be true or false, got '2'"),
    (int, "1.0", "flag must be an int, got '1.0'"),
    (int, "", "flag must be an int, got ''"),
    (float, "x", "flag must be a number, got 'x'"),
    (str, "   ", "flag must not be empty"),
])
def test_a_bad_value_is_refused_naming_the_parameter(kind, text, message):
    with pytest.raises(ValueError) as err:
        Param("flag", kind, REQUIRED).parse(text)
    assert str(err.value) == message


@pytest.mark.parametrize("param, text", [
    (Param("error_feedback", bool, False), "error_feedback: bool=false"),
    (Param("error_feedback", bool, True), "error_feedback: bool=true"),
    (Param("ratio", float, REQUIRED), "ratio: float"),
    (Param("hidden_dim", int, 64), "hidden_dim: int=64"),
    (Param("format", str, "e4m3"), "format: str=e4m3"),
    (Param("policy", str, "Zero"), "policy: str=Zero"),  # only a bool's default is lower-cased
    (Param("lr", float, 1e-3), "lr: float=0.001"),
])
def test_a_parameter_describes_itself(param, text):
    assert param.describe() == text


@pytest.mark.parametrize("hint, kind", [
    (bool, bool), (int, int), (float, float), (str, str), (typing.Any, str),
    (typing.Optional[int], int), (typing.Union[str, float], float), (typing.Union[float, typing.Callable], float),
    (int | None, int), (typing.Union[bool, int], bool), (typing.Callable, str),
])
def test_a_hint_gives_the_kind_its_text_is_parsed_as(hint, kind):
    assert _text_kind(hint) is kind


def _record(a: int, b: typing.Optional[float] = None, flag: bool = True, predictor_params=None, name="x"):
    """A factory that returns what it was called with."""
    return dict(a=a, b=b, flag=flag, predictor_params=predictor_params, name=name)


def test_an_entry_reads_its_parameters_and_calls_the_factory_with_typed_values():
    entry = PassEntry("rec", _record, fixed={"name": "fixed"}, defaults={"b": 0.5})
    assert entry.params == (Param("a", int, REQUIRED), Param("b", float, 0.5), Param("flag", bool, True))
    got = entry.build(["3"], {"flag": " off "}, "rec")
    assert got == dict(a=3, b=0.5, flag=False, predictor_params=None, name="fixed")
    assert [type(got[k]) for k in ("a", "b", "flag")] == [int, float, bool]
    got = entry.build(["3", "2", "yes"], {}, "rec")  # as many values as parameters
    assert got == dict(a=3, b=2.0, flag=True, predictor_params=None, name="fixed") and type(got["b"]) is float


@pytest.mark.parametrize("spec, message", [
    ("stats(1)", "pass 'stats' in 'stats(1)': stats takes no value"),
    ("stats(x=1)", "pass 'stats' in 'stats(x=1)': stats takes no value"),
    ("clip(1, 2)", "pass 'clip' in 'clip(1, 2)': 2 values for 1 parameter(s) (max_norm)"),
    ("synthetic(8, 0.1, 2, true, 5)", "pass 'synthetic' in 'synthetic(8, 0.1, 2, true, 5)': 5 values for 4 "
                                      "parameter(s) (hidden_dim, lr, warmup_steps, use_synthetic)"),
    ("fp8(bogus=1)", "pass 'fp8' in 'fp8(bogus=1)': no parameter 'bogus'; fp8 takes format, scaling, "
                     "history_len, margin"),
    ("topk(0.5, ratio=0.5)", "pass 'topk' in 'topk(0.5, ratio=0.5)': ratio given twice"),
    ("decay", "pass 'decay' in 'decay': decay needs strength (float), e.g. decay=<strength> or "
              "decay(strength=...)"),
    ("topk(error_feedback=no)", "pass 'topk' in 'topk(error_feedback=no)': topk needs ratio (float), e.g. "
                                "topk=<ratio> or topk(ratio=...)"),
    ("clip=abc", "bad value for pass 'clip' in 'clip=abc': max_norm must be a number, got 'abc'"),
    ("int8,,clip", "empty item in the pass list 'int8,,clip'"),
    ("int8,", "empty item in the pass list 'int8,'"),
    ("int8,clip(1)(2)", "'clip(1)(2)': text after the closing ')'"),  # was "unbalanced ')' in '1)(2'"
    ("int8, int4", "unknown pass 'int4' in 'int8, int4'; valid: " + ", ".join(sorted(_TABLE))),
])
def test_a_bad_spec_gets_the_whole_message(spec, message):
    with pytest.raises(ValueError) as err:
        parse_passes(spec)
    assert str(err.value) == message


@pytest.mark.parametrize("spec", [1.0, b"clip", ["clip"]])
def test_a_spec_that_is_not_text_is_refused_by_type(spec):
    with pytest.raises(ValueError) as err:
        parse_passes(spec)
    assert str(err.value) == f"a pass spec is a string, got {type(spec).__name__}"


def test_every_value_reaches_its_factory_by_position_and_by_name():
    assert parse_passes(" topk ( 0.5 , false ) , clip (2)").name == "chain(topk_compress(0.5), clip_by_norm(2))"
    assert parse_passes("synthetic(8, 0.1, 2, true)").name == "chain(synthetic_gradient)"
    assert parse_passes("guard").name == "chain(nonfinite_guard(zero))" and parse_passes(None) is None


@pytest.mark.parametrize("text, sep, parts", [
    ("a(b,c),d", ",", ["a(b,c)", "d"]),
    ("a((b,c),d),e", ",", ["a((b,c),d)", "e"]),
    ("", ",", [""]), (",", ",", ["", ""]), ("a,,b", ",", ["a", "", "b"]),
    ("a=b(=)=c", "=", ["a", "b(=)", "c"]), ("a,b", "=", ["a,b"]),
])
def test_split_top_splits_outside_parentheses_only(text, sep, parts):
    assert _split_top(text, sep) == parts


@pytest.mark.parametrize("text, message", [
    ("a)(b", "unbalanced ')' in 'a)(b'"), ("(a))", "unbalanced ')' in '(a))'"),
    ("(a", "unbalanced '(' in '(a'"), ("((a)", "unbalanced '(' in '((a)'"),
])
def test_split_top_names_the_unbalanced_parenthesis(text, message):
    with pytest.raises(ValueError) as err:
        _split_top(text)
    assert str(err.value) == message


@pytest.mark.parametrize("item, parsed", [
    ("clip", ("clip", [], {})), ("clip=0.5", ("clip", ["0.5"], {})), ("clip=a=b", ("clip", ["a=b"], {})),
    ("clip()", ("clip", [], {})), ("clip( )", ("clip", [], {})), ("clip (1)", ("clip", ["1"], {})),
    ("topk( 0.9 , error_feedback = false )", ("topk", ["0.9"], {"error_feedback": "false"})),
    ("f((1,2), k=(3,4), j=x=y)", ("f", ["(1,2)"], {"k": "(3,4)", "j": "x=y"})),
])
def test_an_item_is_split_into_name_values_and_keywords(item, parsed):
    assert _parse_item(item) == parsed


@pytest.mark.parametrize("item, message", [
    ("clip(1,)", "'clip(1,)': empty argument"), ("clip(,1)", "'clip(,1)': empty argument"),
    ("f(a=1, a=2)", "'f(a=1, a=2)': a given twice"), ("f(a=1, a =2)", "'f(a=1, a =2)': a given twice"),
    ("f(a=1, 2)", "'f(a=1, 2)': a value without a name after a named one"),
    ("clip=", "'clip=': '=' without a value"), ("clip= ", "'clip= ': '=' without a value"),
    ("clip(1)x", "'clip(1)x': text after the closing ')'"),
    ("clip(1)(2)", "'clip(1)(2)': text after the closing ')'"),
    ("clip(1) (2)", "'clip(1) (2)': text after the closing ')'"),
    ("clip(1))", "'clip(1))': text after the closing ')'"),
    ("clip(", "'clip(': unbalanced '('"), ("clip((1)", "'clip((1)': unbalanced '('"),
])
def test_a_bad_item_gets_the_whole_message(item, message):
    with pytest.raises(ValueError) as err:
        _parse_item(item)
    assert str(err.value) == message


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
