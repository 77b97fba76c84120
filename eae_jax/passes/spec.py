"""Pass chains from text (``eae-jax train --passes``): the one table of the built-in passes.

A spec is a comma list of items, each a pass name alone, with one value
(its first hyper-parameter), or with arguments in parentheses::

    int8,clip=1.0
    topk(0.9, error_feedback=false),noise(std=1e-3),stats
    synthetic(hidden_dim=16, lr=1e-2, use_synthetic=true, warmup_steps=10)

Every built-in pass factory is in `PASSES` under its function name and a
short alias; its hyper-parameters, their types and defaults are read from
the factory's signature, so the table cannot drift from the library. Only
arguments that are not hyper-parameters (``predictor_params``: initial
weights) are left out. The combinators (`chain`, `at_layers`,
`every_n_steps`, `from_optax`) take passes or optax objects and stay
library-only; a spec's passes run at every boundary and step.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from eae_jax.passes.base import chain, identity
from eae_jax.passes.capture import capture
from eae_jax.passes.clip import clip_by_norm
from eae_jax.passes.fp8 import fp8_quant
from eae_jax.passes.guard import nonfinite_guard
from eae_jax.passes.quantize import cast_roundtrip, int8_fake_quant
from eae_jax.passes.regularize import decay, gaussian_noise
from eae_jax.passes.stats import statistics
from eae_jax.passes.synthetic import synthetic_gradient
from eae_jax.passes.topk import topk_compress

#: Arguments of the factories that are not hyper-parameters (never on a command line).
NOT_HYPERPARAMETERS = ("predictor_params",)

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_REQUIRED = inspect.Parameter.empty


@dataclasses.dataclass(frozen=True)
class Param:
    """One hyper-parameter: its name, Python type (float, int, bool or str) and default (``REQUIRED``: none).

    Example:
      >>> from eae_jax.passes.spec import Param
      >>> p = Param("error_feedback", bool, True)
      >>> p.parse(" Off "), p.describe()
      (False, 'error_feedback: bool=true')
    """

    name: str
    kind: type
    default: Any

    def parse(self, text: str) -> Any:
        """The value of ``text`` for this parameter (ValueError naming it otherwise)."""
        text = text.strip()
        if self.kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(f"{self.name} must be true or false, got {text!r}")
        if self.kind in (int, float):
            try:
                return self.kind(text)
            except ValueError:
                raise ValueError(f"{self.name} must be {'an int' if self.kind is int else 'a number'}, "
                                 f"got {text!r}") from None
        if not text:
            raise ValueError(f"{self.name} must not be empty")
        return text

    def describe(self) -> str:
        default = "" if self.default is _REQUIRED else f"={str(self.default).lower() if self.kind is bool else self.default}"
        return f"{self.name}: {self.kind.__name__}{default}"


def _text_kind(hint: Any) -> type:
    """The type a command-line value of a parameter annotated ``hint`` is
    parsed as: bool, int or float, else str (Any: a dtype name). A union
    takes its first of those (``ScalarOrSchedule``: a float; schedules are
    library-only)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return next((t for t in options if t in (bool, int, float)), str)


@dataclasses.dataclass(frozen=True)
class PassEntry:
    """A named pass: the factory, the arguments the name fixes (``fp16`` is
    ``cast_roundtrip(dtype='fp16')``) and defaults the command line adds
    (``clip`` alone is ``clip_by_norm(1.0)``).

    Example:
      >>> from eae_jax.passes.spec import PASSES
      >>> entry = PASSES["fp16"]
      >>> entry.fixed, [p.name for p in PASSES["topk"].params]
      ({'dtype': 'fp16'}, ['ratio', 'error_feedback'])
      >>> PASSES["clip"].build([], {}, "clip").name, PASSES["topk"].build(["0.9"], {}, "topk=0.9").name
      ('clip_by_norm(1)', 'topk_compress(0.9, ef)')
    """

    name: str
    factory: Callable
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def params(self) -> Tuple[Param, ...]:
        """The hyper-parameters, in the factory's order, from its signature."""
        hints = typing.get_type_hints(self.factory)
        out = []
        for p in inspect.signature(self.factory).parameters.values():
            if p.name in self.fixed or p.name in NOT_HYPERPARAMETERS:
                continue
            out.append(Param(p.name, _text_kind(hints.get(p.name, str)), self.defaults.get(p.name, p.default)))
        return tuple(out)

    def build(self, positional: List[str], keywords: Dict[str, str], item: str):
        """Call the factory with the parsed arguments of ``item`` (ValueError naming the problem)."""
        params = self.params
        where = f"pass {self.name!r} in {item!r}"
        if (positional or keywords) and not params:
            raise ValueError(f"{where}: {self.name} takes no value")
        if len(positional) > len(params):
            raise ValueError(f"{where}: {len(positional)} values for {len(params)} parameter(s) "
                             f"({', '.join(p.name for p in params)})")
        by_name = {p.name: p for p in params}
        values: Dict[str, Any] = dict(self.fixed)
        given = dict(zip([p.name for p in params], positional))
        for key, text in keywords.items():
            if key not in by_name:
                raise ValueError(f"{where}: no parameter {key!r}; {self.name} takes "
                                 f"{', '.join(p.name for p in params)}")
            if key in given:
                raise ValueError(f"{where}: {key} given twice")
            given[key] = text
        for p in params:
            if p.name in given:
                values[p.name] = p.parse(given[p.name])
            elif p.default is _REQUIRED:
                raise ValueError(f"{where}: {self.name} needs {p.name} ({p.kind.__name__}), e.g. "
                                 f"{self.name}=<{p.name}> or {self.name}({p.name}=...)")
            else:
                values[p.name] = p.default
        return self.factory(**values)


def _entries() -> Dict[str, PassEntry]:
    # (names, factory, what the names fix or default); each name's entry is named by it.
    table = [
        (("clip_by_norm", "clip"), clip_by_norm, dict(defaults={"max_norm": 1.0})),
        (("int8_fake_quant", "int8"), int8_fake_quant, {}),
        (("cast_roundtrip", "cast"), cast_roundtrip, {}),
        (("fp16",), cast_roundtrip, dict(fixed={"dtype": "fp16"})),
        (("bf16",), cast_roundtrip, dict(fixed={"dtype": "bf16"})),
        (("fp8_quant", "fp8"), fp8_quant, {}),
        (("decay",), decay, {}),
        (("gaussian_noise", "noise"), gaussian_noise, {}),
        (("statistics", "stats"), statistics, {}),
        (("topk_compress", "topk"), topk_compress, {}),
        (("nonfinite_guard", "guard"), nonfinite_guard, {}),
        (("synthetic_gradient", "synthetic"), synthetic_gradient, {}),
        (("capture",), capture, {}),
        (("identity",), identity, {}),
    ]
    return {n: PassEntry(n, factory, **options) for names, factory, options in table for n in names}


#: Every name a spec may use -> its `PassEntry` (factory names and short aliases).
PASSES: Dict[str, PassEntry] = _entries()


def _split_top(text: str, sep: str = ",") -> List[str]:
    """Split on ``sep`` outside parentheses (ValueError for unbalanced ones)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ')' in {text!r}")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '(' in {text!r}")
    parts.append("".join(cur))
    return parts


def _parse_item(item: str) -> Tuple[str, List[str], Dict[str, str]]:
    """``name``, ``name=value`` or ``name(a, k=v)`` -> (name, positional, keywords)."""
    if "(" in item:
        name, _, rest = item.partition("(")
        # The ')' that closes the first '(' must end the item: `clip(1)(2)` is balanced but not a call.
        depth = 1
        for end, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        if depth:
            raise ValueError(f"{item!r}: unbalanced '('")
        if end != len(rest) - 1:
            raise ValueError(f"{item!r}: text after the closing ')'")
        args = [a.strip() for a in _split_top(rest[:-1])]
        if args == [""]:
            args = []
        positional, keywords = [], {}
        for a in args:
            if not a:
                raise ValueError(f"{item!r}: empty argument")
            if "=" in a:
                k, _, v = a.partition("=")
                if k.strip() in keywords:
                    raise ValueError(f"{item!r}: {k.strip()} given twice")
                keywords[k.strip()] = v.strip()
            elif keywords:
                raise ValueError(f"{item!r}: a value without a name after a named one")
            else:
                positional.append(a)
        return name.strip(), positional, keywords
    name, eq, value = item.partition("=")
    if eq and not value.strip():
        raise ValueError(f"{item!r}: '=' without a value")
    return name.strip(), ([value] if eq else []), {}


def parse_passes(spec: Optional[str]):
    """Build the pass chain of a spec (see the module doc); None for an empty spec.

    Raises:
      ValueError: unknown name (listing the valid ones), a value for a pass
        that takes none, a missing required value, a bad value (the
        factory's message), or bad syntax; the message names the item.

    >>> parse_passes("int8,clip=0.5").name
    'chain(int8_fake_quant, clip_by_norm(0.5))'
    >>> parse_passes("topk(0.9, error_feedback=false)").name
    'chain(topk_compress(0.9))'
    """
    if spec is None:
        return None
    if not isinstance(spec, str):
        raise ValueError(f"a pass spec is a string, got {type(spec).__name__}")
    if not spec.strip():
        return None
    items = [s.strip() for s in _split_top(spec)]
    passes = []
    for item in items:
        if not item:
            raise ValueError(f"empty item in the pass list {spec!r}")
        name, positional, keywords = _parse_item(item)
        if name not in PASSES:
            raise ValueError(f"unknown pass {name!r} in {spec!r}; valid: {', '.join(sorted(PASSES))}")
        try:
            passes.append(PASSES[name].build(positional, keywords, item))
        except (TypeError, ValueError) as err:
            msg = str(err)
            raise ValueError(msg if msg.startswith("pass ") else f"bad value for pass {name!r} in {item!r}: {msg}") \
                from None
    return chain(*passes)


def describe() -> str:
    """One line per pass (names, then hyper-parameters with type and default), for ``--help``.

    Example:
      >>> from eae_jax.passes.spec import describe
      >>> print(describe().splitlines()[0])
        clip_by_norm | clip                  max_norm: float=1.0
    """
    groups: Dict[int, List[str]] = {}
    first: Dict[int, PassEntry] = {}
    for name, entry in PASSES.items():
        key = id(entry.factory), tuple(sorted(entry.fixed.items()))
        groups.setdefault(key, []).append(name)
        first.setdefault(key, entry)
    lines = []
    for key, names in groups.items():
        params = ", ".join(p.describe() for p in first[key].params) or "(no value)"
        lines.append(f"  {' | '.join(names):<36} {params}")
    return "\n".join(lines)
