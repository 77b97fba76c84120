"""One JAX process of the stack benchmark (see `bench_stack.py`).

A timed child compiles its step ahead of time, loads the shared weights,
says READY and waits for GO (`bench_common.wait_for_go`), so that no other
process compiles, autotunes or runs on the GPU while it is timed. It then
runs warm-up and timed steps, reads the allocator's statistics, optionally
compares its gradients with the references and prints ``RESULT <json>``.

The reference child (``spec['role'] == 'ref'``) runs while the others
compile: J-plain's step and the same step in float32, whose gradients it
writes for the timed children to compare with.

Usage: ``python bench_child_jax.py SPEC.json`` (written by the parent).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402

F32_TAG = "f32"


def _log(msg: str) -> None:
    sys.stderr.write(f"[child {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def remat_stack(block, params, x, policy, prevent_cse: bool):
    """``jax.checkpoint(block, policy=policy, prevent_cse=prevent_cse)`` scanned
    over the stacked params: `eae_jax.blocks.plain_stack`'s remat form with
    ``prevent_cse`` exposed (a test checks the two trace the same program).

    >>> import jax, jax.numpy as jnp
    >>> blk = lambda p, h: jnp.tanh(h * p)
    >>> remat_stack(blk, jnp.ones((3, 2)), jnp.ones(2), None, False).shape
    (2,)
    """
    import jax

    fn = jax.checkpoint(block, policy=policy, prevent_cse=prevent_cse)

    def body(h, p):
        return fn(p, h), None

    out, _ = jax.lax.scan(body, x, params)
    return out


def boundaries_in_grads(variant, params_sds, x_sds) -> bool:
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


def _flat(grads):
    out = {}
    for name, _ in bc.LEAVES:
        mod, leaf = name.split(".")
        out[name] = grads[mod][leaf]
    return out


def _memory_stats(dev) -> dict:
    return {k: int(v) for k, v in (dev.memory_stats() or {}).items() if isinstance(v, (int, float))}


#: Allocator pool keys, in order of preference, as JAX backends name them.
POOL_KEYS = ("peak_pool_bytes", "peak_bytes_reserved", "pool_bytes", "bytes_reserved")


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
    if spec.get("inject") == "oom":
        raise RuntimeError("RESOURCE_EXHAUSTED: injected out of memory (testing the parent's retry)")

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
        if mode == "plain":
            def forward(p, x):
                return plain_stack(block, p, x)
        else:
            policy = getattr(jax.checkpoint_policies, variant["policy"])

            def forward(p, x):
                return remat_stack(block, p, x, policy, variant["prevent_cse"])

        def step(p, x, y):
            return jax.value_and_grad(lambda pp: mse(forward(pp, x), y))(p)

        state = None
        lowered = jax.jit(step).lower(params_sds, x_sds, y_sds)
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

        lowered = jax.jit(step).lower(params_sds, state, x_sds, y_sds)
    else:
        raise ValueError(f"unknown JAX mode {mode!r}")

    role = spec.get("role", "timed")
    if role == "ref" and mode != "plain":
        raise ValueError(f"the reference job runs J-plain, not {spec['variant']}")
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    _log(f"compiled in {compile_s:.1f}s")
    ref_step = _compile_f32_reference(jax, jnp, block, params_sds, x_sds, y_sds, mse) if role == "ref" else None

    hlo = compiled.as_text() or ""
    starts = re.findall(r"\s([a-z][a-z-]*-start)\(", hlo)  # async op pairs: copy-start, async-start, ...
    result = {"status": "ok", "compile_s": compile_s, "hlo": {
        "host_memory_space_S5": hlo.count("S(5)"), "async_starts": len(starts),
        "async_start_kinds": {k: starts.count(k) for k in sorted(set(starts))},
        "cudnn_attention_calls": len(re.findall(r"__cudnn\$fmha", hlo)), "hlo_chars": len(hlo)}}
    if spec.get("save_hlo"):
        os.makedirs(os.path.dirname(spec["save_hlo"]), exist_ok=True)
        with open(spec["save_hlo"], "w") as f:
            f.write(hlo)
    result["memory_analysis"] = mem_analysis = {}
    try:
        ma = compiled.memory_analysis()
        for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
                  "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_temp_size_in_bytes"):
            if hasattr(ma, k):
                mem_analysis[k] = int(getattr(ma, k))
    except Exception as err:  # not every backend reports it
        mem_analysis["error"] = repr(err)
    if stack is not None:
        # Whether the boundaries live in the gradient buffers (changes what the
        # offload memory bound is measured against).
        result["boundaries_in_grads"] = boundaries_in_grads(variant, params_sds, x_sds)

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

    if role == "ref":
        result.update(_write_references(jax, jnp, compiled, ref_step, params, x, y, workdir, cfg))
        result["prep_s"] = time.perf_counter() - t_start
        bc.emit("RESULT", result)
        return

    result["memory_stats_before_steps"] = _memory_stats(dev)
    result["prep_s"] = time.perf_counter() - t_start
    result["go_at"] = bc.wait_for_go(spec)

    def run_once(state):
        if mode == "eae":
            (loss, grads), state, calls = compiled(params, state, x, y)
            return loss, grads, state, calls
        loss, grads = compiled(params, x, y)
        return loss, grads, state, None

    times, warm = [], []
    out = None
    for i in range(spec["warmup"] + spec["steps"]):
        out = None  # drop the previous step's grads before the next step allocates its own
        if i == spec["warmup"]:
            timed_from = time.time()
        t0 = time.perf_counter()
        res = run_once(state)
        jax.block_until_ready(res[:3])
        (warm if i < spec["warmup"] else times).append(time.perf_counter() - t0)
        state, out, res = res[2], (res[0], res[1], res[3]), None
    result.update(bc.summarize_times(times))
    result.update(times_ms=[t * 1e3 for t in times], warmup_ms=[t * 1e3 for t in warm],
                  timed_window=[timed_from, time.time()])
    stats = result["memory_stats"] = _memory_stats(dev)
    result["peak_bytes"] = stats.get("peak_bytes_in_use")
    result["bytes_in_use_after"] = stats.get("bytes_in_use")
    pool_key = next((k for k in POOL_KEYS if k in stats), None)
    result["peak_reserved_bytes"] = None if pool_key is None else stats[pool_key]
    result["pool_name"] = ("none reported by this backend" if pool_key is None
                           else f"memory_stats()['{pool_key}'] (XLA's BFC allocator)")
    loss, grads, calls = out
    result["loss"] = float(loss)
    if calls is not None:
        result["carry_calls"] = float(calls)
        if float(calls) != 1.0:
            raise RuntimeError(f"the reconstruct backward wrote the carry {float(calls)} times (expected 1)")
    if spec.get("check"):
        # After the peak was read: the reference arrays loaded here are not
        # part of this variant's footprint.
        gflat = _flat(grads)
        for tag, key in (("J-plain", ""), (F32_TAG, "_vs_f32")):
            cmp = _compare(jax, jnp, bc.load_reference(workdir, cfg, tag), gflat)
            if cmp is None:
                result["grad_reference" + key] = f"missing ({tag} reference not written)"
            elif tag == "J-plain":
                result.update(cmp)
                result["grad_reference"] = "J-plain"
            else:
                result["grad_rel_err_vs_f32"] = cmp["grad_rel_err"]
                result["grad_worst_rel_err_vs_f32"] = [cmp["grad_worst_leaf"], cmp["grad_worst_rel_err"]]
        if mode == "eae" and variant.get("offload"):
            result.update(_same_process_check(jax, jnp, eae_jax, block, variant, params_sds, x_sds,
                                              params, x, y, mse, gflat, float(loss)))
    bc.emit("RESULT", result)


def _compile_f32_reference(jax, jnp, block, params_sds, x_sds, y_sds, mse):
    """The same step in float32 (weights and inputs upcast from the shared
    bf16 ones, matmuls at HIGHEST precision, remat to keep memory small).

    Every bf16 variant's error against it is its accuracy; the error
    against J-plain only says how differently two bf16 programs round.
    """
    f32 = jnp.float32
    policy = jax.checkpoint_policies.nothing_saveable

    def step(p, x, y):
        p32 = jax.tree_util.tree_map(lambda a: a.astype(f32), p)
        return jax.value_and_grad(lambda pp: mse(remat_stack(block, pp, x.astype(f32), policy, True), y))(p32)

    with jax.default_matmul_precision("highest"):
        return jax.jit(step).lower(params_sds, x_sds, y_sds).compile()


def _write_references(jax, jnp, compiled, ref_step, params, x, y, workdir, cfg) -> dict:
    """Run J-plain's step and the float32 step once; save both gradient sets."""
    t0 = time.perf_counter()
    loss, grads = compiled(params, x, y)
    host = {name: np.asarray(jax.device_get(jax.lax.bitcast_convert_type(g, jnp.uint16)))
            for name, g in _flat(grads).items()}
    bc.save_reference(workdir, cfg, host, float(loss), tag="J-plain")
    del grads, host
    loss32, grads32 = ref_step(params, x, y)
    host = {name: np.asarray(jax.device_get(g), np.float32) for name, g in _flat(grads32).items()}
    bc.save_reference(workdir, cfg, host, float(loss32), tag=F32_TAG)
    _log(f"references saved (loss {float(loss):.6f}, float32 {float(loss32):.6f})")
    return {"role": "ref", "loss": float(loss), "loss_f32": float(loss32), "reference_s": time.perf_counter() - t0}


def _same_process_check(jax, jnp, eae_jax, block, variant, params_sds, x_sds, params, x, y, mse, gflat, loss):
    """Gradients of the same stack without offload, compiled and run in this
    process, against this variant's (after its timing and peak were read).

    Across processes the GEMM autotuner may pick other algorithms, so the
    cross-process comparison cannot show that offloading changes nothing;
    here both programs share one autotuning cache and the same inputs. The
    reference keeps its boundaries in a device buffer of their own
    (``boundaries_in_grads=False``) like the offloaded stack keeps them in a
    host one: the same program but for the memory space.
    """
    ref = eae_jax.reconstruct(block, boundary_dtype=variant.get("boundary_dtype"), policy=variant.get("policy"),
                              boundaries_in_grads=False)
    state = ref.init(params_sds, x_sds, jax.random.key(0))

    def step(p, carry, x, y):
        return jax.value_and_grad(lambda pp, cc: mse(ref(pp, x, cc), y), argnums=(0,))(p, carry)

    loss_ref, (g_ref,) = jax.jit(step)(params, state, x, y)
    g_ref = _flat(g_ref)
    cmp = _rel_err(jnp, gflat, lambda name: g_ref[name])
    return {"grad_rel_err_vs_eae_same_process": cmp["grad_rel_err"],
            "loss_vs_eae_same_process": [loss, float(loss_ref)]}


if __name__ == "__main__":
    bc.run_child(main, sys.argv[1])
