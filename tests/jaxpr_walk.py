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
