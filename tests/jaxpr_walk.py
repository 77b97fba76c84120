"""Test helper: every equation of a jaxpr, those of nested jaxprs included
(scan and cond bodies, custom-VJP calls, pjit)."""


def all_eqns(jaxpr):
    """Yield the equations of ``jaxpr`` (a Jaxpr) and of every jaxpr nested in their params."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def _is_var(v):
    return hasattr(v, "aval") and not hasattr(v, "val")  # literals have a val and no producer


def ancestors(jaxpr, *outs):
    """The top-level equations of ``jaxpr`` that ``outs`` (its variables)
    are computed from, directly or transitively."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    seen, stack = {}, [v for v in outs if _is_var(v)]
    while stack:
        eqn = producer.get(stack.pop())
        if eqn is None or id(eqn) in seen:
            continue
        seen[id(eqn)] = eqn
        stack.extend(v for v in eqn.invars if _is_var(v))
    return list(seen.values())


def reads(jaxpr, eqn, source):
    """Whether equation ``eqn`` reads variable ``source``, directly or through
    the equations its operands come from."""
    return any(v is source for v in eqn.invars) or any(
        v is source for e in ancestors(jaxpr, *eqn.invars) for v in e.invars)
