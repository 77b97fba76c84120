"""One process of the fp8 campaign (see `bench_fp8_campaign.py`).

Roles (``spec['role']``, ``spec['variant']``):

* ``ref``, variant ``ref`` (first batch): for one model configuration,
  binds our seams as the training command does, observes the gradient
  scales, warms Flax's amax histories, and writes both fp8 states for the
  timed processes (`run_ref_states`).
* ``ref``, variant ``grads`` (after the timed processes): the gradients of
  one train step (same params, same tokens) in bf16, in float32 (HIGHEST
  matmul precision, XLA attention), with our fp8 seams and with Flax's fp8
  ops, and their cosines (`run_ref_grads`). Neither runs while anything is
  timed.
* ``timed``, variant ``ffn``: every FFN variant of one shape, compiled and
  set up before READY; after GO, ``rounds`` rounds, each a seeded random
  permutation of the variants; each visit times the forward, then the
  forward + backward: ``batches`` samples of ``calls`` calls dispatched back
  to back and synchronised once (per-call time = sample / calls).
* ``timed``, a step variant (``bf16``, ``eae-fp8``, ``eae-fp8-u``,
  ``flax-fp8``): the whole train step compiled before READY; after GO the
  params and optimizer state are made (the ref's seed: the fp8 states fit
  them), then ``warmup`` + ``steps`` steps, each synchronised and timed.

Usage: ``python bench_fp8_child.py SPEC.json`` (written by the parent).
Prints ``RESULT <json>`` (or ``ERROR <json>``) on stdout, as the stack
benchmark's children do (`bench_common.emit`).
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402


def _log(msg: str) -> None:
    sys.stderr.write(f"[fp8 child {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def plain(obj):
    """``obj`` with numpy scalars and arrays as JSON-able Python values.

    >>> plain({"a": np.float32(1.5), "b": [np.int64(2)], "c": np.arange(2)})
    {'a': 1.5, 'b': [2], 'c': [0, 1]}
    """
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def state_path(workdir: str, config: str, which: str) -> str:
    """Where the ref process leaves a configuration's fp8 state (``eae`` or ``flax``)."""
    return os.path.join(workdir, "state", config, f"{which}.pkl")


def _save(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(obj, f)
    os.replace(path + ".tmp", path)


def _load(path: str, timeout_s: float = 0.0):
    """The pickle at ``path``, waiting up to ``timeout_s`` for the reference
    process to write it (a ``failed`` file beside it ends the wait)."""
    t0 = time.time()
    failed = os.path.join(os.path.dirname(path), "failed")
    while not os.path.exists(path):
        if os.path.exists(failed) or time.time() - t0 > timeout_s:
            why = open(failed).read().strip() if os.path.exists(failed) else f"not written within {timeout_s:.0f}s"
            raise FileNotFoundError(f"{path}: the reference process of this configuration did not write it ({why})")
        time.sleep(0.5)
    with open(path, "rb") as f:
        return pickle.load(f)


def _model_and_batch(spec):
    import jax
    import bench_fp8_programs as bp

    smoke = spec.get("smoke", False)
    m16 = bp.lm_config(spec["preset"], "bf16", smoke)
    batch, seq = bp.batch_shape(spec["preset"], smoke)
    tokens_sds = jax.ShapeDtypeStruct((batch, seq + 1), np.int32)
    return m16, tokens_sds


def _params_and_tokens(spec, model, tokens_sds):
    """The params and tokens every process of a configuration uses (same seeds, same values)."""
    import jax
    from eae_jax.models.llama import init_lm

    params = init_lm(jax.random.key(spec["seed"]), model)
    tokens = jax.random.randint(jax.random.key(spec["seed"] + 1), tokens_sds.shape, 0, model.vocab_size, np.int32)
    return params, tokens


def _eae_from_states(spec, model, timeout_s: float = 0.0):
    """``(bound block, fp8 state)`` of our seams as the ref process wrote them."""
    from eae_jax import fp8

    saved = _load(state_path(spec["workdir"], spec["config"], "eae"), timeout_s)
    return fp8.BoundBlock(model.block, saved["seams"], saved["state"], {}, fallback=saved["fallback"]), saved["state"]


def _timed_compile(fn, args, donate=()):
    import jax

    t = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    return compiled, time.perf_counter() - t


# ---------------------------------------------------------------------- ref
def _grads_runner(params, tokens, out):
    """``grads(name, model, kind, bound, state, precision)``: one compiled
    gradient step, its compile and run seconds recorded in ``out``."""
    import jax
    import bench_fp8_programs as bp

    def grads(name, model, kind, bound=None, state=None, precision=None):
        fn = bp.grad_fn(model, kind, bound)
        args = (params, state, tokens)
        with jax.default_matmul_precision(precision) if precision else _null():
            compiled, out["compile_s"][name] = _timed_compile(fn, args)
        t = time.perf_counter()
        res = jax.block_until_ready(compiled(*args))
        out["run_s"][name] = time.perf_counter() - t
        _log(f"{name}: loss {float(res[0]):.5f} (compile {out['compile_s'][name]:.1f}s)")
        return res

    return grads


def _flax_failed(spec, err: BaseException) -> str:
    """Record a failed Flax reference beside its state (its timed processes stop waiting)."""
    why = f"{type(err).__name__}: {str(err)[:1000]}"
    _log(f"Flax reference failed: {why}")
    with open(os.path.join(os.path.dirname(state_path(spec["workdir"], spec["config"], "flax")), "failed"), "w") as f:
        f.write(f"Flax's reference step failed: {why[:300]}")
    return why


def run_ref_states(spec) -> dict:
    """Bind our seams as the training command does, observe the gradient
    scales with one current-scaling step, warm Flax's amax histories, and
    write both fp8 states: what the timed fp8 processes wait for, so it
    runs before them, alone, and does nothing else."""
    import jax
    import bench_fp8_programs as bp

    m16, tokens_sds = _model_and_batch(spec)
    params, tokens = _params_and_tokens(spec, m16, tokens_sds)
    out = {"status": "ok", "role": "ref", "part": "states", "compile_s": {}, "run_s": {}}
    grads = _grads_runner(params, tokens, out)
    t = time.perf_counter()
    bound = bp.eae_block(m16, params, tokens)
    out["bind_s"] = time.perf_counter() - t
    out["gate_worst_cos"] = min(c["worst_cos"] for c in bound.certification.values())
    _, _, gs = grads("eae-observe", m16, "eae", bound, bound.state)
    state, rejected = bound.fold_step(bound.state, gs, notify=False)
    out["observe_step_rejected"] = bool(rejected)
    ours = bp.delayed(bound)
    ours.require_grad_scales(jax.device_get(state))
    _save(state_path(spec["workdir"], spec["config"], "eae"),
          {"seams": ours.seams, "fallback": ours.fallback, "state": jax.device_get(state)})
    # A fresh Flax op scales by 1 until its amax histories hold this batch's:
    # its variables are warmed first (the params stay).
    try:
        vs = bp.flax_block_state(m16.depth)
        for i in range(spec.get("flax_warmup", 2)):
            _, _, vs = grads(f"flax-warm{i}", m16, "flax", state=vs)
        _save(state_path(spec["workdir"], spec["config"], "flax"), jax.device_get(vs))
    except Exception as err:  # ours is written: keep it
        out["flax_error"] = _flax_failed(spec, err)
    return out


def run_ref_grads(spec) -> dict:
    """The gradients of one train step (same params, same tokens) in bf16, in
    float32 (HIGHEST matmul precision, XLA attention), with our fp8 seams and
    with Flax's fp8 ops from the written states, and their cosines. Nothing
    waits for it: it runs after the timed processes."""
    import jax
    import bench_fp8_programs as bp

    m16, tokens_sds = _model_and_batch(spec)
    m32 = bp.lm_config(spec["preset"], "fp32", spec.get("smoke", False))
    params, tokens = _params_and_tokens(spec, m16, tokens_sds)
    out = {"status": "ok", "role": "ref", "part": "grads", "compile_s": {}, "run_s": {}, "cosines": {}}
    grads = _grads_runner(params, tokens, out)
    loss16, g16, _ = grads("bf16", m16, "bf16")
    loss32, g32, _ = grads("f32", m32, "f32", precision="highest")
    out.update(loss=float(loss16), loss_f32=float(loss32))
    out["cosines"]["bf16"] = {"vs_f32": bp.grad_agreement(g16, g32)}

    def compare(name, g, loss):
        out["cosines"][name] = {"vs_bf16": bp.grad_agreement(g, g16), "vs_f32": bp.grad_agreement(g, g32),
                                "loss": float(loss)}

    ours, state = _eae_from_states(spec, m16)
    loss8, g8, gs8 = grads("eae-fp8", m16, "eae", ours, state)
    _, bad = ours.fold_step(state, gs8, notify=False)
    report = ours.report(jax.device_get(ours.fold(state, gs8, notify=False)))
    out["eae_step"] = {"rejected": bool(bad), "fallbacks": sum(e["fallbacks"] for e in report),
                       "calls": sum(e["calls"] for e in report), "fp8_calls": sum(e["fp8_calls"] for e in report)}
    compare("eae-fp8", g8, loss8)
    del g8, gs8
    try:
        vs = _load(state_path(spec["workdir"], spec["config"], "flax"))
        lossf, gf, _ = grads("flax-fp8", m16, "flax", state=vs)
        compare("flax-fp8", gf, lossf)
    except Exception as err:  # the states process may have recorded why already
        out["flax_error"] = f"{type(err).__name__}: {str(err)[:1000]}"
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---------------------------------------------------------------------- FFN
def run_ffn(spec) -> dict:
    import jax
    import bench_fp8_programs as bp
    from bench_fp8 import hlo_counts
    from eae_jax import fp8

    m, d, f = spec["shape"]
    t0 = time.perf_counter()
    errors = {}
    progs = bp.ffn_programs(bp.ffn_inputs(m, d, f), spec["variants"], errors=errors)
    built, compile_s, hlo = {}, {}, {}
    for v, kinds in list(progs.items()):
        try:
            for kind, (fn, args) in kinds.items():
                compiled, compile_s[f"{v}/{kind}"] = _timed_compile(fn, args)
                built[(v, kind)] = (compiled, args)
                hlo[f"{v}/{kind}"] = hlo_counts(compiled)
        except Exception as err:  # the other variants are still timed; the report lists this one
            if v == "bf16":
                raise
            errors[v] = f"{type(err).__name__}: {str(err)[:500]}"
            del progs[v]
    for v, why in errors.items():
        _log(f"variant {v} left out: {why}")
    # One call of each, untimed: the outputs' agreement with bf16.
    ref = jax.block_until_ready(built[("bf16", "fwd")][0](*built[("bf16", "fwd")][1])) if ("bf16", "fwd") in built \
        else None
    cos = {}
    for v in progs:
        y = jax.block_until_ready(built[(v, "fwd")][0](*built[(v, "fwd")][1]))
        cos[v] = None if ref is None else float(fp8.cosine(y, ref))
    result = {"status": "ok", "prep_s": time.perf_counter() - t0, "compile_s": compile_s, "hlo": hlo,
              "cos_fwd_vs_bf16": cos, "variant_errors": errors}
    result["go_at"] = bc.wait_for_go(spec)

    rng = np.random.default_rng(spec["order_seed"])
    names = list(progs)
    times = {v: {"fwd": [], "fb": []} for v in names}
    order = []
    start = time.time()
    for r in range(spec["rounds"]):
        for i in rng.permutation(len(names)):
            v = names[i]
            order.append(v)
            for kind in ("fwd", "fb"):
                compiled, args = built[(v, kind)]
                out = None
                for _ in range(spec["warm_calls"]):
                    out = compiled(*args)
                jax.block_until_ready(out)
                for _ in range(spec["batches"]):
                    t = time.perf_counter()
                    for _ in range(spec["calls"]):
                        out = compiled(*args)
                    jax.block_until_ready(out)
                    times[v][kind].append((time.perf_counter() - t) * 1e3 / spec["calls"])
                out = None
    result.update(times_ms=times, order=order, timed_window=[start, time.time()],
                  step_ms_median=statistics.median(times[names[0]]["fb"]), peak_bytes=None)
    return result


# ---------------------------------------------------------------------- train steps
def run_step(spec) -> dict:
    import jax
    import bench_fp8_programs as bp
    from bench_fp8 import hlo_counts
    from eae_jax.models.llama import init_lm

    variant = spec["variant"]
    m16, tokens_sds = _model_and_batch(spec)
    tx = bp.optimizer()
    params_sds = jax.eval_shape(lambda k: init_lm(k, m16), jax.random.key(0))
    opt_sds = jax.eval_shape(tx.init, params_sds)
    bound, state, kind = None, None, {"bf16": "bf16", "flax-fp8": "flax"}.get(variant, "eae")
    if kind == "eae":
        bound, state = _eae_from_states(spec, m16, spec.get("state_timeout_s", 0.0))
        bound = bp.unguarded(bound) if variant == "eae-fp8-u" else bound
    elif kind == "flax":
        state = _load(state_path(spec["workdir"], spec["config"], "flax"), spec.get("state_timeout_s", 0.0))
    step = bp.train_step(m16, kind, tx, bound)
    args = (params_sds, opt_sds, state, tokens_sds)
    compiled, compile_s = _timed_compile(step, args, donate=(0, 1, 2))
    result = {"status": "ok", "compile_s": compile_s, "hlo": hlo_counts(compiled)}
    result["go_at"] = bc.wait_for_go(spec)

    t0 = time.perf_counter()
    params, tokens = _params_and_tokens(spec, m16, tokens_sds)
    opt_state = tx.init(params)
    bstate = None if state is None else jax.device_put(state)
    jax.block_until_ready((params, opt_state, bstate, tokens))
    result["init_s"] = time.perf_counter() - t0
    times, warm, losses, rejected = [], [], [], []
    timed_from = None
    for i in range(spec["warmup"] + spec["steps"]):
        if i == spec["warmup"]:
            timed_from = time.time()
        t = time.perf_counter()
        params, opt_state, bstate, loss, rej = compiled(params, opt_state, bstate, tokens)
        jax.block_until_ready((params, opt_state, bstate, loss))
        (warm if i < spec["warmup"] else times).append((time.perf_counter() - t) * 1e3)
        losses.append(loss)
        rejected.append(rej)
    result.update(bc.summarize_times([t / 1e3 for t in times]))
    result.update(times_ms=times, warmup_ms=warm, timed_window=[timed_from, time.time()],
                  losses=[float(x) for x in losses], rejected_steps=int(sum(bool(r) for r in rejected)),
                  peak_bytes=None)
    if kind == "eae":
        report = bound.report(jax.device_get(bstate))
        result["fp8"] = {"fallbacks": sum(e["fallbacks"] for e in report), "calls": sum(e["calls"] for e in report),
                         "fp8_calls": sum(e["fp8_calls"] for e in report),
                         "grad_clipped": sum(sum(e.get("grad_clipped", [])) for e in report),
                         "weight_clipped": sum(sum(e.get("weight_clipped", [])) for e in report)}
    return result


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("require_gpu"):
        import jax

        if jax.default_backend() != "gpu":
            raise RuntimeError(f"full-size run needs a GPU; JAX backend is {jax.default_backend()!r}")
    if spec.get("inject") == "raise":
        raise RuntimeError("injected failure (testing the parent's error path)")
    role, variant = spec.get("role", "timed"), spec["variant"]
    if role == "ref":
        try:
            result = run_ref_grads(spec) if variant == "grads" else run_ref_states(spec)
        except BaseException as err:  # the timed processes waiting for its states stop waiting
            path = os.path.join(spec["workdir"], "state", spec["config"], "failed")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(f"{type(err).__name__}: {str(err)[:300]}")
            raise
    elif variant == "ffn":
        result = run_ffn(spec)
    else:
        result = run_step(spec)
    bc.emit("RESULT", plain(result))


if __name__ == "__main__":
    bc.run_child(main, sys.argv[1])
