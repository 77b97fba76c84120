"""Numerical parity between the torch reference and the JAX port.

A parity run feeds the same inputs and weights to both sides and reports,
per block boundary, the max abs error, the relative error
``||jax - torch|| / ||torch||`` and the cosine of:

(a) ``forward``: the boundaries x0..xL (plus, for a language model, the logits and
    the logits of the unmodified torch model's own forward);
(b) ``grad``: the gradient with respect to the stack's input x0 and every
    block's parameters (one row per block, all its tensors together; plus
    embedding, final norm and head of a language model): `eae_jax.reconstruct`
    (no passes) against torch autograd of the whole model;
(c) the adjoint at every boundary of `eae_jax.reconstruct` with eae_jax
    passes against ``eae_runtime.EAERuntime`` with the equivalent seed passes:

    =========== ======================================= ===================================
    pipeline    eae_jax                                 eae_runtime
    =========== ======================================= ===================================
    none        (none)                                  (none)
    int8_clip   int8_fake_quant(), clip_by_norm(1.0)    Int8QuantizationPass(), ClipPass(1.0)
    fp16        cast_roundtrip('fp16')                  FP16Pass()
    =========== ======================================= ===================================

    in three sections per pipeline:

    ``adjoint[p]``: end to end. Both backward passes run on their own, the
    adjoints are read after the passes at every boundary (a ``capture()``
    pass appended to the JAX chain, a recording pass appended to the seed
    pipeline), plus every block's parameter gradients.
    ``vjp[p]``: one block at a time. The JAX block VJP is fed the seed's own
    post-pass adjoint at x(i+1) and the seed's boundary x_i, and compared with
    the seed's pre-pass adjoint at x_i and block i's parameter gradients.
    ``pass[p]``: the JAX pass chain applied to the seed's pre-pass adjoint at
    each boundary, compared with the seed's post-pass adjoint.

Tolerances. Every row of (a), (b), ``vjp`` and ``pass`` must be within the
relative-error tolerance of the run's dtype (`TOLERANCES`: float32 1e-5,
bfloat16 2e-2). End-to-end rows of quantizing pipelines get a looser floor
(`END_TO_END_FLOOR`): a quantizer is discontinuous, so two correct
implementations whose inputs differ in the last bit round a few elements
to neighbouring grid points (one fp16 ulp, or max|g|/127 for int8), and those
differences feed every later block and its quantizer, growing with depth
(measured on stories260K: ~2e-2 for int8 at x0, ~4e-4 for fp16). The tight
``vjp`` and ``pass`` rows are where an implementation difference would show:
with identical inputs there is nothing to flip. The table prints each
row's tolerance.

The generic engine is `run_parity` on a `ParityCase`; `blocks_case`,
`seed_lm_case` and `hf_lm_case` build cases for reference-block stacks, whole
models on seed blocks (llama2.c), and ``transformers`` LLaMA models.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import eae_jax
from eae_jax import passes as jpasses
from interop.parity_cases import (  # noqa: F401 - re-exported: the cases are part of this module's API
    TOLERANCES,
    ParityCase,
    blocks_case,
    checkpoint_case,
    hf_lm_case,
    seed_lm_case,
)
from interop.parity_report import ParityReport, Row, compare  # noqa: F401 - re-exported
from interop.tensors import require_torch, torch_to_numpy

torch = require_torch()

#: The pass pipelines compared in section (c).
PIPELINES = ("none", "int8_clip", "fp16")
#: Tolerance floor of the end-to-end rows of each pipeline (see the module doc).
END_TO_END_FLOOR = {"none": 0.0, "int8_clip": 5e-2, "fp16": 2.0 ** -9}


def _pipeline(name: str, int8: Callable, clip: Callable, fp16: Callable) -> list:
    """The passes of pipeline ``name``, built from one library's int8, clip and fp16 pass factories."""
    table = {"none": lambda: [], "int8_clip": lambda: [int8(), clip(1.0)], "fp16": lambda: [fp16()]}
    if name not in table:
        raise ValueError(f"unknown pipeline {name!r}; expected one of {PIPELINES}")
    return table[name]()


def jax_pipeline(name: str) -> list:
    """The eae_jax passes of a named pipeline (see the module table).

    Raises:
      ValueError: unknown name.

    Example:
      >>> from interop.parity import jax_pipeline
      >>> [p.name for p in jax_pipeline("int8_clip")]
      ['int8_fake_quant', 'clip_by_norm(1)']
    """
    return _pipeline(name, jpasses.int8_fake_quant, jpasses.clip_by_norm, lambda: jpasses.cast_roundtrip("fp16"))


def torch_pipeline(name: str) -> list:
    """The eae_runtime passes of a named pipeline.

    Raises:
      ValueError: unknown name.

    Example:
      >>> from interop.parity import torch_pipeline
      >>> [type(p).__name__ for p in torch_pipeline("int8_clip")], torch_pipeline("none")
      (['Int8QuantizationPass', 'ClipPass'], [])
    """
    from eae_runtime.passes import ClipPass, FP16Pass, Int8QuantizationPass

    return _pipeline(name, Int8QuantizationPass, ClipPass, FP16Pass)


# --------------------------------------------------------------------------- engine
class _Recorder:
    """A seed pass (duck-typed ``EAEPass``: a ``name`` and ``__call__(adjoint, context)``)
    that keeps every adjoint it sees, keyed by boundary (the seed's ``block_index``).
    Put first in the pipeline it sees the raw VJP output, last what flows on."""

    def __init__(self, name: str):
        self.name = name
        self.adjoints: Dict[int, Any] = {}

    def __call__(self, adjoint, context=None):
        self.adjoints[int((context or {})["block_index"])] = adjoint.tensor.detach().clone()
        adjoint.record(self.name)
        return adjoint


def _torch_autograd(case: ParityCase):
    for p in case.torch_params.values():
        p.grad = None
    with torch.enable_grad():
        x0 = case.torch_pre()
        x0.retain_grad()
        xs = [x0]
        for b in case.torch_blocks:
            xs.append(b(xs[-1]))
        loss = case.torch_post(xs[-1])
        loss.backward()
    grads = {k: (torch_to_numpy(p.grad) if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
             for k, p in case.torch_params.items()}
    logits = None
    if case.torch_logits is not None:
        with torch.no_grad():
            logits = torch_to_numpy(case.torch_logits(xs[-1].detach()))
    return ([torch_to_numpy(x.detach()) for x in xs], torch_to_numpy(x0.grad), grads, float(loss.detach()), logits)


def _torch_runtime(case: ParityCase, pipeline: str):
    """EAERuntime.compute_gradients with the seed pipeline between two recorders.

    Returns (pre-pass adjoints, post-pass adjoints, named block param grads),
    the adjoint lists indexed by boundary 0..L.
    """
    from eae_runtime import EAERuntime, RuntimeConfig

    before, after = _Recorder("ParityRecorderIn"), _Recorder("ParityRecorderOut")
    runtime = EAERuntime(torch.nn.ModuleList(case.torch_blocks), None,
                         RuntimeConfig(passes=[before] + torch_pipeline(pipeline) + [after], enable_profiler=False))
    with torch.no_grad():
        x0 = case.torch_pre().detach()
    _, grads = runtime.compute_gradients(x0, case.torch_post)
    names = {id(p): k for k, p in case.torch_params.items()}
    named = {names[id(p)]: torch_to_numpy(g) for p, g in grads.items()}
    n = len(case.torch_blocks) + 1
    pre = [torch_to_numpy(before.adjoints[i]) for i in range(n)]
    post = [torch_to_numpy(after.adjoints[i]) for i in range(n)]
    for p in case.torch_params.values():
        p.grad = None
    return pre, post, named


def _jax_block_vjp(case: ParityCase):
    """jitted ``(params_i, x_i, g) -> (input adjoint, param grads)`` of one block."""
    block = case.jax_block

    @jax.jit
    def step(p_i, x_i, g):
        _, vjp = jax.vjp(block, p_i, x_i)
        g_p, g_x = vjp(g)
        return g_x, g_p

    return step


def _jax_pass_step(pipeline: str, num_boundaries: int):
    """jitted ``(adjoint, boundary) -> adjoint`` through the pipeline's eae_jax chain (fresh state)."""
    chain = jpasses.chain(*jax_pipeline(pipeline))

    @jax.jit
    def step(g, boundary):
        state = chain.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(0))
        b = jnp.asarray(boundary, jnp.int32)
        ctx = jpasses.PassContext(b, b, jnp.zeros((), jnp.int32), num_boundaries)
        return chain.update(g, state, ctx)[0]

    return step


def _jax_forward(case: ParityCase, params):
    block = case.jax_block

    @jax.jit
    def run(params):
        x0 = case.jax_pre(params)

        def body(h, p):
            y = block(p, h)
            return y, y

        _, ys = jax.lax.scan(body, x0, params["blocks"])
        logits = case.jax_logits(params, ys[-1]) if case.jax_logits is not None else None
        return x0, ys, logits

    x0, ys, logits = run(params)
    xs = [np.asarray(x0)] + [np.asarray(y) for y in ys]
    return xs, (None if logits is None else np.asarray(logits))


def _flat_grads(g: dict) -> Dict[str, np.ndarray]:
    """Parity names -> numpy gradient (stacked block leaves split per block)."""
    out = {}
    blocks = g["blocks"]
    depth = jax.tree_util.tree_leaves(blocks)[0].shape[0]
    for a, sub in blocks.items():
        for c, leaf in sub.items():
            leaf = np.asarray(leaf)
            for i in range(depth):
                out[f"blocks.{i}.{a}.{c}"] = leaf[i]
    if "embed" in g:
        out["embed"] = np.asarray(g["embed"])
    if "final_norm" in g:
        out["final_norm.scale"] = np.asarray(g["final_norm"]["scale"])
    if "lm_head" in g:
        out["lm_head"] = np.asarray(g["lm_head"])
    return out


def _jax_pipeline(case: ParityCase, params, pipeline: str):
    """`eae_jax.reconstruct` with the pipeline's passes and a trailing ``capture()``.

    Returns (loss, adjoints after the passes at boundaries 0..L, named
    gradients of every parameter). With no passes the boundary-0 adjoint is
    dL/dx0 and the gradients are the plain ones (section (b)).
    """
    stack = eae_jax.reconstruct(case.jax_block, passes=jax_pipeline(pipeline) + [jpasses.capture()])
    carry = stack.init(params["blocks"], case.jax_pre(params))

    @jax.jit
    def run(params, carry):
        def loss_fn(params, carry):
            return case.jax_post(params, stack(params["blocks"], case.jax_pre(params), carry))

        loss, (g_params, g_carry) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, carry)
        new_carry, stats = stack.update(carry, g_carry)
        return loss, g_params, stack.state(new_carry), stats

    loss, g_params, state, stats = run(params, carry)
    if float(stats["calls"]) != 1.0:
        raise RuntimeError(f"reconstruct's backward ran {float(stats['calls'])} times for one step; "
                           "the captured adjoints are unusable")
    below = np.asarray(state["segments"][0][-1].adjoint)  # boundaries 0..L-1, stacked
    top = np.asarray(state["top"][-1].adjoint)  # boundary L
    adjoints = [below[i] for i in range(below.shape[0])] + [top]
    return float(loss), adjoints, _flat_grads(g_params)


def _block_groups(names: Sequence[str]) -> Dict[str, List[str]]:
    """Group parity names into report rows: ``block i`` (all its tensors), then the rest."""
    groups: Dict[str, List[str]] = {}
    for n in names:
        if n.startswith("blocks."):
            groups.setdefault(f"block {int(n.split('.')[1])}", []).append(n)
        else:
            groups.setdefault(n, []).append(n)
    return groups


def _concat(d: Mapping[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    return np.concatenate([np.asarray(d[n], np.float64).ravel() for n in names])


def run_parity(case: ParityCase, *, pipelines: Sequence[str] = PIPELINES, tol: Optional[float] = None,
               info: Optional[dict] = None) -> ParityReport:
    """Run the torch reference and the JAX port on ``case`` and compare (see the module doc).

    Args:
      case: from `blocks_case`, `seed_lm_case`, `hf_lm_case`, `checkpoint_case`
        or built by hand.
      pipelines: which pass pipelines to compare in section (c) (a subset of
        `PIPELINES`; empty skips the EAERuntime comparison).
      tol: override the relative-error tolerance of every row (e.g. a tiny
        value to force a failure); default `TOLERANCES` of the case's dtype
        (with `END_TO_END_FLOOR` for end-to-end rows of quantizing pipelines).
      info: extra facts to put in the report.

    Returns:
      A `ParityReport`; ``report.ok`` says whether every row passed.

    Raises:
      ValueError: unknown pipeline, or the two sides do not name the same parameters.

    Example:
      >>> import torch
      >>> from eae_runtime.contrib import PreNormTransformerBlock
      >>> from interop.parity import blocks_case, run_parity
      >>> _ = torch.manual_seed(0)
      >>> blocks = torch.nn.ModuleList([PreNormTransformerBlock(8, 2, max_seq_len=8, ffn_hidden_dim=16)])
      >>> report = run_parity(blocks_case(blocks, batch=1, seq=4), pipelines=["none"])
      >>> report.ok, sorted({row.section.split("[")[0] for row in report.rows})
      (True, ['adjoint', 'forward', 'grad', 'vjp'])
    """
    for p in pipelines:
        if p not in PIPELINES:
            raise ValueError(f"unknown pipeline {p!r}; expected one of {PIPELINES}")
    base_tol = TOLERANCES[case.dtype] if tol is None else float(tol)
    rows: List[Row] = []

    def add(section, name, got, want, row_tol):
        m, r, c = compare(got, want)
        rows.append(Row(section, name, m, r, c, row_tol, bool(r <= row_tol)))

    params = case.jax_params
    t_xs, t_gx0, t_grads, t_loss, t_logits = _torch_autograd(case)
    j_xs, j_logits = _jax_forward(case, params)
    for i, (a, b) in enumerate(zip(j_xs, t_xs)):
        add("forward", f"x{i}", a, b, base_tol)
    if t_logits is not None:
        add("forward", "logits", j_logits, t_logits, base_tol)
    if case.torch_model_logits is not None:
        with torch.no_grad():
            whole = torch_to_numpy(case.torch_model_logits().float())
        add("forward", "logits(model)", j_logits, whole, base_tol)
    runs = {p: _jax_pipeline(case, params, p) for p in dict.fromkeys(["none", *pipelines])}
    j_loss, j_adj_none, j_grads = runs["none"]
    add("forward", "loss", j_loss, t_loss, base_tol)
    if set(j_grads) != set(t_grads):
        raise ValueError(f"the JAX and torch sides name different parameters: only JAX {sorted(set(j_grads) - set(t_grads))}, "
                         f"only torch {sorted(set(t_grads) - set(j_grads))}")
    add("grad", "dL/dx0", j_adj_none[0], t_gx0, base_tol)
    for group, names in _block_groups(list(t_grads)).items():
        add("grad", group, _concat(j_grads, names), _concat(t_grads, names), base_tol)

    depth = len(case.torch_blocks)
    block_groups = _block_groups([n for n in t_grads if n.startswith("blocks.")])
    vjp_step = _jax_block_vjp(case) if pipelines else None
    e2e_tols = {}
    for pipe in pipelines:
        e2e_tol = max(base_tol, END_TO_END_FLOOR[pipe]) if tol is None else base_tol
        e2e_tols[pipe] = e2e_tol
        t_pre, t_post, t_pg = _torch_runtime(case, pipe)
        _, j_adj, j_pg = runs[pipe]
        for i in reversed(range(depth + 1)):
            add(f"adjoint[{pipe}]", f"x{i}", j_adj[i], t_post[i], e2e_tol)
        for group, names in block_groups.items():
            add(f"adjoint[{pipe}]", f"{group} grads", _concat(j_pg, names), _concat(t_pg, names), e2e_tol)
        # One block at a time, from the seed's own boundary and incoming adjoint.
        for i in reversed(range(depth)):
            p_i = jax.tree_util.tree_map(lambda l: l[i], params["blocks"])
            x_i = jnp.asarray(t_xs[i])
            g_x, g_p = vjp_step(p_i, x_i, jnp.asarray(t_post[i + 1]))
            add(f"vjp[{pipe}]", f"x{i}", np.asarray(g_x), t_pre[i], base_tol)
            names = block_groups[f"block {i}"]
            got = _flat_grads({"blocks": jax.tree_util.tree_map(lambda l: l[None], g_p)})
            got = {k.replace("blocks.0.", f"blocks.{i}.", 1): v for k, v in got.items()}
            add(f"vjp[{pipe}]", f"block {i} grads", _concat(got, names), _concat(t_pg, names), base_tol)
        if pipe != "none":
            pass_step = _jax_pass_step(pipe, depth + 1)
            for i in reversed(range(depth + 1)):
                add(f"pass[{pipe}]", f"x{i}", np.asarray(pass_step(jnp.asarray(t_pre[i]), i)), t_post[i], base_tol)

    meta = {"depth": depth, "x0_shape": list(t_xs[0].shape), "loss_torch": t_loss, "loss_jax": j_loss,
            "pipelines": list(pipelines), "tolerance": base_tol, "end_to_end_tolerances": e2e_tols}
    meta.update(info or {})
    return ParityReport(case.title, case.dtype, rows, meta)
