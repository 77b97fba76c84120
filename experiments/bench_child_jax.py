"""One JAX variant of the stack benchmark, in its own process (see `bench_stack.py`).

Protocol with the parent: the child compiles its step ahead of time, loads the
shared weights, prints ``READY`` and waits for ``GO`` on stdin (so that no
other process compiles, and autotunes, on the GPU while it is being timed).
It then runs warm-up and timed steps, reads the allocator's peak, compares its
gradients with J-plain's reference and prints ``RESULT <json>``.

Usage: ``python bench_child_jax.py SPEC.json`` (written by the parent).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402


def _emit(tag: str, payload=None) -> None:
    line = tag if payload is None else f"{tag} {json.dumps(payload)}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _log(msg: str) -> None:
    sys.stderr.write(f"[child {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def _wait_for_go(spec) -> None:
    _emit("READY")
    line = sys.stdin.readline().strip()
    if line != "GO":
        _log(f"parent said {line!r}; exiting without measuring")
        sys.exit(3)
    if spec.get("inject") == "hang":
        _log("injected hang (testing the parent's timeout)")
        time.sleep(3600)


# Which variants leave their gradients for others, and who compares with whom
# (besides J-plain, the reference for every variant).
WRITES_REFERENCE = ("J-plain", "eae")
COMPARES_WITH = {"eae-offload": ("eae",), "eae-offload-unrolled": ("eae",), "eae-passes": ("eae",), "eae-dots": ("eae",)}


def _compare(jax, jnp, ref, gflat):
    """Relative error of the grads ``gflat`` against a stored reference (None if absent)."""
    if ref is None:
        return None
    meta, arrays = ref

    def ref_of(name):
        r = jax.device_put(np.ascontiguousarray(arrays[name]))
        return jax.lax.bitcast_convert_type(r, jnp.bfloat16) if meta["dtypes"][name] == "bf16bits" else r

    out = _rel_err(jnp, gflat, ref_of)
    out["loss_ref"] = meta["loss"]
    return out


def _rel_err(jnp, gflat, ref_of):
    """`bc.combine_rel_err` of the grads ``gflat`` against ``ref_of(name)``,
    one leaf on the device at a time, in float32."""
    f32 = jnp.float32
    per_leaf = {}
    for name, g in gflat.items():
        rd = ref_of(name).astype(f32)
        diff = g.astype(f32) - rd
        per_leaf[name] = (float(jnp.sum(diff * diff)), float(jnp.sum(rd * rd)))
        del rd, diff
    return bc.combine_rel_err(per_leaf)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    t_start = time.perf_counter()
    cfg = bc.StackConfig(**spec["config"])
    variant = bc.VARIANTS[spec["variant"]]
    workdir = spec["workdir"]

    import jax
    import jax.numpy as jnp

    import eae_jax
    from eae_jax.blocks import BlockConfig, causal_attention, decoder_block, plain_stack, swiglu

    if spec.get("inject") == "raise":
        raise RuntimeError("injected failure (testing the parent's error path)")

    dev = jax.devices()[0]
    if spec.get("require_gpu") and jax.default_backend() != "gpu":
        raise RuntimeError(f"full-size run needs a GPU; JAX backend is {jax.default_backend()!r}")
    bcfg = BlockConfig(dim=cfg.dim, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, ffn_hidden_dim=cfg.ffn,
                       norm_eps=1e-6, rope_style="interleaved", max_seq_len=max(4096, cfg.seq))
    bf16, f32 = jnp.bfloat16, jnp.float32
    mp = bool(variant.get("mp"))
    if mp:
        # fp32 master params and fp32 residual stream; norms in fp32; the
        # matmuls and attention in bf16 through the block's public seams.
        def _cast(tree):
            return jax.tree_util.tree_map(lambda a: a.astype(bf16), tree)

        def attn_bf16(params, h, **kw):
            return causal_attention(_cast(params), h.astype(bf16), **kw)

        def ffn_bf16(params, h):
            return swiglu(_cast(params), h.astype(bf16))

        block = decoder_block(bcfg, ffn_fn=ffn_bf16, attention_fn=attn_bf16)
        pdtype = xdtype = f32
    else:
        block = decoder_block(bcfg)  # computes in the input's dtype: bf16 everywhere
        pdtype = xdtype = bf16

    shapes = cfg.leaf_shapes()
    params_sds = {}
    for name, _ in bc.LEAVES:
        mod, leaf = name.split(".")
        params_sds.setdefault(mod, {})[leaf] = jax.ShapeDtypeStruct((cfg.depth,) + shapes[name], pdtype)
    x_sds = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.dim), xdtype)
    y_sds = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.dim), bf16)

    def mse(out, y):
        d = out.astype(f32) - y.astype(f32)
        return 0.5 * jnp.mean(d * d)

    mode = variant["mode"]
    stack = None
    if mode in ("plain", "remat"):
        policy = "none" if mode == "plain" else getattr(jax.checkpoint_policies, variant["policy"])

        def step(p, x, y):
            return jax.value_and_grad(lambda pp: mse(plain_stack(block, pp, x, remat_policy=policy), y))(p)

        state = None
        jitted = jax.jit(step)
        lowered = jitted.lower(params_sds, x_sds, y_sds)
    elif mode == "eae":
        passes = None
        if variant.get("passes"):
            from eae_jax.passes import chain, clip_by_norm, int8_fake_quant

            passes = chain(int8_fake_quant(), clip_by_norm(1.0))
        stack = eae_jax.reconstruct(block, passes=passes, boundary_dtype=variant.get("boundary_dtype"),
                                    offload=variant.get("offload", False), policy=variant.get("policy"),
                                    boundaries_in_grads=variant.get("boundaries_in_grads", True))
        state = stack.init(params_sds, x_sds, jax.random.key(0))

        def step(p, carry, x, y):
            loss, (gp, gc) = jax.value_and_grad(lambda pp, cc: mse(stack(pp, x, cc), y), argnums=(0, 1))(p, carry)
            # strict=False: the check's host callback would add a device->host
            # sync to every step; `calls` is verified once after timing instead.
            carry, stats = stack.update(carry, gc, strict=False)
            return (loss, gp), carry, stats["calls"]

        jitted = jax.jit(step)
        lowered = jitted.lower(params_sds, state, x_sds, y_sds)
    else:
        raise ValueError(f"unknown JAX mode {mode!r}")

    slotted = None
    if stack is not None:
        # Whether the boundaries live in the gradient buffers (changes what the
        # offload memory bound is measured against).
        slotted = _boundaries_in_grads(variant, params_sds, x_sds)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    _log(f"compiled in {compile_s:.1f}s")

    hlo = compiled.as_text() or ""
    starts = re.findall(r"\s([a-z][a-z-]*-start)\(", hlo)  # async op pairs: copy-start, async-start, ...
    hlo_stats = {
        "host_memory_space_S5": hlo.count("S(5)"),
        "async_starts": len(starts),
        "async_start_kinds": {k: starts.count(k) for k in sorted(set(starts))},
        "hlo_chars": len(hlo),
    }
    if spec.get("save_hlo"):
        os.makedirs(os.path.dirname(spec["save_hlo"]), exist_ok=True)
        with open(spec["save_hlo"], "w") as f:
            f.write(hlo)
    mem_analysis = {}
    try:
        ma = compiled.memory_analysis()
        for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
                  "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_temp_size_in_bytes"):
            if hasattr(ma, k):
                mem_analysis[k] = int(getattr(ma, k))
    except Exception as err:  # not every backend reports it
        mem_analysis["error"] = repr(err)

    # Load the shared weights and inputs (bf16 bit patterns) only now: compile-
    # time autotuning scratch then never coincides with the params in memory.
    bits = bc.load_weight_bits(workdir, cfg)

    def to_dev(b, dtype):
        arr = jax.lax.bitcast_convert_type(jax.device_put(np.ascontiguousarray(b)), bf16)
        return arr.astype(dtype) if dtype != bf16 else arr

    params = {}
    for name, _ in bc.LEAVES:
        mod, leaf = name.split(".")
        params.setdefault(mod, {})[leaf] = to_dev(bits[name], pdtype)
    xb, yb = bc.load_input_bits(workdir, cfg)
    x, y = to_dev(xb, xdtype), to_dev(yb, bf16)
    jax.block_until_ready((params, x, y))
    stats0 = dev.memory_stats() or {}
    prep_s = time.perf_counter() - t_start

    _wait_for_go(spec)

    def run_once(state):
        if mode == "eae":
            (loss, grads), state, calls = compiled(params, state, x, y)
            return loss, grads, state, calls
        loss, grads = compiled(params, x, y)
        return loss, grads, state, None

    times = []
    out = None
    total = spec["warmup"] + spec["steps"]
    for i in range(total):
        out = None  # drop the previous step's grads before the next step allocates its own
        t0 = time.perf_counter()
        res = run_once(state)
        jax.block_until_ready(res[:3])
        dt = time.perf_counter() - t0
        state, out, res = res[2], (res[0], res[1], res[3]), None
        if i >= spec["warmup"]:
            times.append(dt)
    stats1 = dev.memory_stats() or {}
    result = {"status": "ok", "compile_s": compile_s, "prep_s": prep_s, "memory_analysis": mem_analysis,
              "hlo": hlo_stats, **bc.summarize_times(times)}
    if slotted is not None:
        result["boundaries_in_grads"] = slotted
    result["peak_bytes"] = stats1.get("peak_bytes_in_use")
    result["bytes_in_use_after"] = stats1.get("bytes_in_use")
    result["bytes_in_use_before_steps"] = stats0.get("bytes_in_use")
    result["peak_bytes_before_steps"] = stats0.get("peak_bytes_in_use")
    loss, grads, calls = out
    result["loss"] = float(loss)
    if calls is not None:
        result["carry_calls"] = float(calls)
        if float(calls) != 1.0:
            raise RuntimeError(f"the reconstruct backward wrote the carry {float(calls)} times (expected 1)")
    gflat = {}
    for name, _ in bc.LEAVES:
        mod, leaf = name.split(".")
        gflat[name] = grads[mod][leaf]

    # Gradient agreement (after the peak was read: the reference arrays loaded
    # below are not part of this variant's footprint). J-plain's grads are the
    # reference for all; eae's are the reference eae-offload must reproduce.
    if spec["variant"] in WRITES_REFERENCE:
        host = {}
        for name, g in gflat.items():
            if g.dtype == bf16:
                host[name] = np.asarray(jax.device_get(jax.lax.bitcast_convert_type(g, jnp.uint16)))
            else:
                host[name] = np.asarray(jax.device_get(g.astype(f32)))
        bc.save_reference(workdir, cfg, host, float(loss), tag=spec["variant"])
        del host
    if spec["variant"] == "J-plain":
        result.update(bc.combine_rel_err({k: (0.0, 1.0) for k in gflat}))
        result["grad_reference"] = "self"
        if not mp:
            t0 = time.perf_counter()
            _save_f32_reference(jax, jnp, block, params, x, y, mse, workdir, cfg)
            result["f32_reference_s"] = time.perf_counter() - t0
    else:
        cmp = _compare(jax, jnp, bc.load_reference(workdir, cfg, "J-plain"), gflat)
        if cmp is None:
            result["grad_reference"] = "missing (J-plain did not run or failed)"
        else:
            result.update(cmp)
            result["grad_reference"] = "J-plain"
    cmp = _compare(jax, jnp, bc.load_reference(workdir, cfg, F32_TAG), gflat)
    if cmp is not None:
        result["grad_rel_err_vs_f32"] = cmp["grad_rel_err"]
        result["grad_worst_rel_err_vs_f32"] = [cmp["grad_worst_leaf"], cmp["grad_worst_rel_err"]]
    for tag in COMPARES_WITH.get(spec["variant"], ()):
        cmp = _compare(jax, jnp, bc.load_reference(workdir, cfg, tag), gflat)
        result[f"grad_rel_err_vs_{tag}"] = None if cmp is None else cmp["grad_rel_err"]
        if cmp is not None:
            result[f"loss_vs_{tag}"] = [result["loss"], cmp["loss_ref"]]
    if mode == "eae" and variant.get("offload"):
        result.update(_same_process_check(jax, jnp, eae_jax, block, variant, params_sds, x_sds, y_sds,
                                          params, x, y, mse, gflat, float(loss)))
    _emit("RESULT", result)


F32_TAG = "f32"


def _boundaries_in_grads(variant, params_sds, x_sds) -> bool:
    """Whether `reconstruct` stores this variant's boundaries inside its
    gradient buffers: its documented condition (boundary-only storage on the
    device, no policy, no offload) and a public `grad_slots.plan` for one
    block's params and the stored boundary."""
    import jax
    from eae_jax import grad_slots

    if not variant.get("boundaries_in_grads", True) or variant.get("policy") or variant.get("offload"):
        return False
    stored = variant.get("boundary_dtype") or x_sds.dtype
    specs = [(leaf.shape[1:], leaf.dtype) for leaf in jax.tree_util.tree_leaves(params_sds)]
    return grad_slots.plan(specs, x_sds.shape, stored) is not None


def _save_f32_reference(jax, jnp, block, params, x, y, mse, workdir, cfg) -> None:
    """The same step in float32 (weights and inputs upcast from the shared
    bf16 ones, matmuls at HIGHEST precision), saved as reference ``f32``.

    Every bf16 variant's error against it is its accuracy; the error
    against J-plain only says how differently two bf16 programs round
    (different fusions and GEMM algorithms move it by ~5e-3). Remat keeps
    its memory small, so it runs right after J-plain's timing in J-plain's
    process.
    """
    from eae_jax.blocks import plain_stack

    f32 = jnp.float32
    p32 = jax.tree_util.tree_map(lambda a: a.astype(f32), params)
    policy = jax.checkpoint_policies.nothing_saveable
    with jax.default_matmul_precision("highest"):
        step = jax.jit(lambda p, xx, yy: jax.value_and_grad(
            lambda pp: mse(plain_stack(block, pp, xx, remat_policy=policy), yy))(p))
        loss, grads = step(p32, x.astype(f32), y)
        host = {}
        for name, _ in bc.LEAVES:
            mod, leaf = name.split(".")
            host[name] = np.asarray(jax.device_get(grads[mod][leaf]), np.float32)
    bc.save_reference(workdir, cfg, host, float(loss), tag=F32_TAG)
    _log(f"float32 reference saved (loss {float(loss):.6f})")


def _same_process_check(jax, jnp, eae_jax, block, variant, params_sds, x_sds, y_sds, params, x, y, mse, gflat,
                        loss):
    """Gradients of the same stack without offload, compiled and run in this
    process, against this variant's (after its timing and peak were read).

    Across processes the GEMM autotuner may pick other algorithms (J-remat
    and J-plain differ by ~5e-3 in bf16 for that reason alone), so the
    cross-process comparison cannot show that offloading changes nothing;
    here both programs share one autotuning cache and the same inputs. The
    reference keeps its boundaries in a device buffer of their own
    (``boundaries_in_grads=False``) like the offloaded stack keeps them in a
    host one: the same program but for the memory space, so bf16 fusion
    choices do not differ between the two (the gradient-slot layout changes
    them, and with them the bf16 rounding, by ~4e-3).
    """
    ref = eae_jax.reconstruct(block, boundary_dtype=variant.get("boundary_dtype"), policy=variant.get("policy"),
                              boundaries_in_grads=False)
    state = ref.init(params_sds, x_sds, jax.random.key(0))

    def step(p, carry, x, y):
        return jax.value_and_grad(lambda pp, cc: mse(ref(pp, x, cc), y), argnums=(0,))(p, carry)

    loss_ref, (g_ref,) = jax.jit(step)(params, state, x, y)

    def ref_of(name):
        mod, leaf = name.split(".")
        return g_ref[mod][leaf]

    cmp = _rel_err(jnp, gflat, ref_of)
    return {"grad_rel_err_vs_eae_same_process": cmp["grad_rel_err"],
            "loss_vs_eae_same_process": [loss, float(loss_ref)]}


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except SystemExit:
        raise
    except BaseException as err:  # report, so the parent can record it in the table
        traceback.print_exc()
        _emit("ERROR", {"status": "error", "error": f"{type(err).__name__}: {str(err)[:2000]}"})
        sys.exit(1)
