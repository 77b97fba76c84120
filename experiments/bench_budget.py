"""Memory-budget reconstruction against the uniform storages, plain JAX and torch.compile's budget.

Sections (``--sections``):

* ``budgets``: the medium stack (``bench_common.configs``: dim 2048, depth
  16, seq 2048, batch 4, bf16). The parent measures the storage options'
  costs once (`eae_jax.reconstruct.measure_costs`) and plans every budget
  (``--budgets``, GiB) with `make_plan`; then one process per variant times
  its step and reads its allocator peak: the plan of each budget, the
  uniform storages (boundaries in gradient slots, on the device, in host
  memory, ``policy='dots'``, everything kept: plain autodiff's residuals),
  plain JAX (``plain_stack``) and ``jax.checkpoint`` remat of every block.
* ``torch``: the torch reference block under ``torch.compile`` with
  ``activation_memory_budget`` at each of ``--torch-budgets`` (fractions;
  bench_stack's child process). Per GiB budget the report names the fastest
  JAX and torch.compile variants whose measured peak fits, against the plan.
* ``7b``: dim 4096, depth 32, batch 1: the planned step with AdamW whose
  state and fp32 master weights the plan may move to pinned host memory
  (`eae_jax.offload_optim`), under ``--budget-7b`` GiB.

Protocol: processes of a batch (``--jobs``) compile at once, then are timed
one at a time while nothing else runs (``bench_common.wait_for_go``); each
reports its step times (``--warmup`` untimed, ``--steps`` timed) and
``memory_stats()['peak_bytes_in_use']``. ``--repeats`` processes per
variant; ``--deadline-s`` starts no batch past it and keeps every result so
far (``bench_budget.json`` is rewritten after each batch). Writes the table
(``bench_budget.txt``), the JSON and ``bench_budget.png`` (time vs memory)
to ``--out``.

GPU::

    PYTHONUNBUFFERED=1 python experiments/bench_budget.py --out $OUT

CPU smoke (tiny sizes)::

    python experiments/bench_budget.py --smoke --out /tmp/bb
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]  # this checkout's eae_jax, here and in the children (PYTHONPATH below)

import bench_common as bc  # noqa: E402

GIB = 1 << 30
UNIFORM = ("slots", "device", "host", "dots", "everything")
#: torch.compile's activation_memory_budget fractions: dense enough that every GiB budget has one near it.
TORCH_BUDGETS = "0.1,0.2,0.3,0.4,0.5,0.7"


def config(smoke: bool, big: bool = False) -> bc.StackConfig:
    """The medium stack (or the 7B-like one), tiny in smoke runs."""
    if big:
        if smoke:
            return bc.StackConfig("7b", dim=64, heads=4, kv_heads=2, ffn=128, depth=4, batch=1, seq=32)
        return bc.StackConfig("7b", dim=4096, heads=32, kv_heads=8, ffn=11008, depth=32, batch=1, seq=2048)
    return bc.configs(smoke)["medium"][0]


# ----------------------------------------------------------------------------- the JAX side (public API)
def jax_problem(cfg: bc.StackConfig):
    """``(block, params specs, x spec, y spec, loss)`` of a bf16 stack of decoder blocks."""
    import jax
    import jax.numpy as jnp

    from eae_jax.blocks import BlockConfig, decoder_block, init_stack

    bcfg = BlockConfig(dim=cfg.dim, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, ffn_hidden_dim=cfg.ffn,
                       norm_eps=1e-6, rope_style="interleaved", max_seq_len=max(4096, cfg.seq))
    params = jax.eval_shape(lambda: init_stack(jax.random.key(0), bcfg, cfg.depth, jnp.bfloat16))
    x = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.dim), jnp.bfloat16)

    def loss(out, y):
        d = out.astype(jnp.float32) - y.astype(jnp.float32)
        return 0.5 * jnp.mean(d * d)

    return decoder_block(bcfg), bcfg, params, x, loss


def storage_of(runs):
    """The storage of ``[[blocks, option name], ...]`` (`default_options` names)."""
    from eae_jax.reconstruct import Runs, default_options

    options = {o.name: o.storage for o in default_options()}
    if len(runs) == 1:
        return options[runs[0][1]]
    return Runs(tuple((int(n), options[name]) for n, name in runs))


def child(spec: dict) -> None:
    """One timed process: build the variant's step, compile, wait for GO, time it."""
    import jax
    import jax.numpy as jnp
    import optax

    import eae_jax
    from eae_jax.blocks import init_stack, plain_stack
    from eae_jax.reconstruct.costs import compiled_peak

    cfg = bc.StackConfig(**spec["config"])
    block, bcfg, p_spec, x_spec, loss = jax_problem(cfg)
    result = {"variant": spec["variant"], "backend": jax.default_backend()}
    t0 = time.perf_counter()
    kind = spec["kind"]
    params = init_stack(jax.random.key(spec["seed"]), bcfg, cfg.depth, jnp.bfloat16)
    kx, ky = jax.random.split(jax.random.key(spec["seed"] + 1))
    x = jax.random.normal(kx, x_spec.shape, jnp.bfloat16)
    y = jax.random.normal(ky, x_spec.shape, jnp.bfloat16)
    if kind in ("plain", "remat"):
        policy = "none" if kind == "plain" else "boundaries"  # remat: keep only each block's input
        forward = lambda p, h: plain_stack(block, p, h, remat_policy=policy)  # noqa: E731
    else:
        stack = eae_jax.reconstruct(block, storage=storage_of(spec["runs"]))
        forward = stack
    if kind == "7b":
        from eae_jax.offload_optim import offload_optimizer

        opt = offload_optimizer(optax.adamw(1e-5), master_dtype=jnp.float32, grad_clip=1.0,
                                memory_kind="auto" if spec["offload"] else None)
        state = opt.init(params)

        def step(p, s, xx, yy):
            value, grads = jax.value_and_grad(lambda pp: loss(forward(pp, xx), yy))(p)
            new_p, s = opt.apply(grads, s, p)
            return value, new_p, s

        # Every sharding named, memory kinds included, so that the donated host state is
        # updated in place (jax matches a donated buffer to an output of its memory kind).
        where = lambda tree: jax.tree_util.tree_map(lambda a: a.sharding, tree)  # noqa: E731
        compiled = jax.jit(step, in_shardings=(where(params), where(state), x.sharding, y.sharding),
                           out_shardings=(x.sharding, where(params), where(state)),
                           donate_argnums=(0, 1)).lower(params, state, x, y).compile()

        def run(carry):
            value, p, s = compiled(carry[0], carry[1], x, y)
            return value, (p, s)

        carry = (params, state)
    else:
        compiled = jax.jit(lambda p, xx, yy: jax.value_and_grad(lambda pp: loss(forward(pp, xx), yy))(p)).lower(
            params, x, y).compile()

        def run(carry):
            value, grads = compiled(params, x, y)
            return value, grads

        carry = None
    result["compiled_peak"] = compiled_peak(compiled)
    result["prep_s"] = time.perf_counter() - t0
    bc.wait_for_go(spec)
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        t = time.perf_counter()
        value, new = run(carry)
        jax.block_until_ready((value, new))
        if kind == "7b":
            carry = new
        new = None
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
    result.update(bc.summarize_times(times), times_ms=[t * 1e3 for t in times], loss=float(value))
    stats = jax.devices()[0].memory_stats() or {}
    result["peak_bytes"] = stats.get("peak_bytes_in_use")
    bc.emit("RESULT", result)


# ----------------------------------------------------------------------------- the parent
def chosen_options(names):
    """The planner's options: `default_options`, or those named (comma list)."""
    from eae_jax.reconstruct import default_options

    options = default_options()
    return options if not names else [o for o in options if o.name in names.split(",")]


def plan_budgets(cfg, budgets_gib, option_names, timing):
    """Costs measured once, then a verified plan per budget (`plan_memory`):
    ``{budget: plan dict}`` (a refused budget: its message)."""
    import eae_jax
    from eae_jax.reconstruct import BudgetError, measure_costs, plan_memory

    block, _, p_spec, x_spec, loss = jax_problem(cfg)
    stack = eae_jax.reconstruct(block)
    options = chosen_options(option_names)
    t0 = time.perf_counter()
    costs = measure_costs(stack, p_spec, x_spec, loss=loss, loss_args=(x_spec,), options=options, timing=timing)
    plans = {"measure_s": time.perf_counter() - t0}
    for b in budgets_gib:
        try:
            # verified: the full step compiled once, the plan tightened if it needs more than predicted
            plan = plan_memory(stack, p_spec, x_spec, int(b * GIB), loss=loss, loss_args=(x_spec,), options=options,
                               costs=costs)
            plans[b] = {**plan.to_dict(), "table": plan.table()}
        except BudgetError as err:
            plans[b] = {"refused": str(err)}
    return plans


def launch(spec: dict, workdir: str):
    path = os.path.join(workdir, f"{spec['variant']}-{spec['repeat']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    script = os.path.join(HERE, "bench_child_torch.py") if spec.get("torch") else os.path.abspath(__file__)
    argv = [sys.executable, script, path] if spec.get("torch") else [sys.executable, script, "--child", path]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    # stderr to a file: a chatty child (compiler warnings) must not block on a full pipe
    err = open(path[:-len(".json")] + ".stderr", "w")
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    proc.stderr_path = err.name
    err.close()
    return proc


def _stderr_tail(proc) -> str:
    with open(proc.stderr_path) as f:
        return f.read()[-2000:]


def run_batch(specs, workdir, timeout_s):
    """Start the batch, wait for every READY, then GO one at a time; a row per process."""
    procs = [(s, launch(s, workdir)) for s in specs]
    rows, ready = [], []
    for spec, proc in procs:
        line = proc.stdout.readline().strip()
        while line and not line.startswith(("READY", "RESULT", "SKIP")):
            line = proc.stdout.readline().strip()
        if line == "READY":
            ready.append((spec, proc))
        else:
            proc.wait()
            err = _stderr_tail(proc)
            rows.append({"variant": spec["variant"], "status": "failed", "error": line or err})
    for spec, proc in ready:
        try:
            out, _ = proc.communicate("GO\n", timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            rows.append({"variant": spec["variant"], "status": "failed", "error": _stderr_tail(proc)})
        else:
            rows.append({**json.loads(line[len("RESULT "):]), "variant": spec["variant"], "status": "ok",
                         "repeat": spec["repeat"]})
    return rows


def variants(args, cfg, plans):
    """The specs of every timed process, in campaign order."""
    base = {"config": cfg.__dict__, "warmup": args.warmup, "steps": args.steps, "seed": args.seed}
    out = []
    if "budgets" in args.sections:
        for b in args.budgets:
            if "segments" in plans.get(b, {}):
                out.append({**base, "variant": f"plan-{b:g}GiB", "kind": "planned",
                            "runs": plans[b]["segments"][0]["runs"]})
        out += [{**base, "variant": f"uniform-{o}", "kind": "uniform", "runs": [[cfg.depth, o]]} for o in UNIFORM]
        out += [{**base, "variant": "J-plain", "kind": "plain"}, {**base, "variant": "J-remat", "kind": "remat"}]
    if "torch" in args.sections:
        for fraction in args.torch_budgets:
            name = f"T-compile-b{fraction:g}"
            out.append({**base, "variant": name, "torch": True, "workdir": args.workdir, "sdpa_backend": "flash",
                        "require_gpu": not args.smoke, "check": False})
    if args.variants:
        out = [s for s in out if any(s["variant"].startswith(v) for v in args.variants.split(","))]
    return [{**s, "repeat": r} for r in range(args.repeats) for s in out]


def big_specs(args):
    """The 7B-like planned step (optimizer offload as the plan says)."""
    import jax
    import jax.numpy as jnp

    import eae_jax
    from eae_jax.reconstruct import make_plan, measure_costs
    from eae_jax.reconstruct.costs import float_bytes, nbytes

    cfg = config(args.smoke, big=True)
    block, _, p_spec, x_spec, loss = jax_problem(cfg)
    f32 = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), p_spec)
    optimizer_bytes = 3 * float_bytes(f32)  # fp32 master weights, Adam's mu and nu
    options = chosen_options(args.options)
    costs = measure_costs(eae_jax.reconstruct(block), p_spec, x_spec, loss=loss, loss_args=(x_spec,), options=options,
                          timing=args.timing)
    plan = make_plan(costs, int(args.budget_7b * GIB), optimizer_bytes=optimizer_bytes, options=options)
    spec = {"config": cfg.__dict__, "warmup": 1, "steps": max(2, args.steps // 2), "seed": args.seed,
            "variant": f"7b-plan-{args.budget_7b:g}GiB", "kind": "7b", "runs": plan.segments[0].runs,
            "offload": plan.optimizer_offloaded, "repeat": 0}
    return spec, {**plan.to_dict(), "table": plan.table(), "param_bytes": nbytes(p_spec)}


def summarize(rows):
    """Per variant: median step ms over processes, max peak GiB, compiled peak GiB."""
    by = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r)
    table = {}
    for name, rs in by.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        if not ok:
            table[name] = {"status": "failed", "error": rs[0].get("error", "")[:300]}
            continue
        ms = sorted(r["step_ms_median"] for r in ok if r.get("step_ms_median") is not None)
        peaks = [r.get("peak_bytes") for r in ok if r.get("peak_bytes")]
        table[name] = {"status": "ok", "processes": len(ok), "median_ms": ms[len(ms) // 2] if ms else None,
                       "peak_gib": max(peaks) / GIB if peaks else None,
                       "compiled_peak_gib": (ok[0].get("compiled_peak") or 0) / GIB or None}
    return table


def budget_verdicts(doc):
    """Per GiB budget: the plan against the fastest uniform storage or plain JAX variant
    and the fastest torch.compile budget whose measured peak fits (ratio: other / plan ms,
    above 1: the plan is faster)."""
    table, out = doc["table"], []

    def peak(row):  # the allocator's; the compiled step's where the backend keeps no statistics (CPU)
        return row.get("peak_gib") if row.get("peak_gib") is not None else row.get("compiled_peak_gib")

    def fastest(prefixes, budget_gib):
        fits = [(row["median_ms"], name) for name, row in table.items()
                if name.startswith(prefixes) and row["status"] == "ok" and row["median_ms"] is not None
                and peak(row) is not None and peak(row) <= budget_gib]
        return min(fits) if fits else (None, None)

    for b in doc["budgets"]:
        plan = table.get(f"plan-{b:g}GiB")
        if plan is None or plan["status"] != "ok":
            continue
        row = {"budget_gib": b, "plan_ms": plan["median_ms"], "plan_peak_gib": peak(plan),
               "plan_fits": peak(plan) is not None and peak(plan) <= b}
        for key, prefixes in (("jax", ("uniform-", "J-")), ("torch", ("T-",))):
            ms, name = fastest(prefixes, b)
            row[key] = name
            row[f"{key}_ms"] = ms
            row[f"{key}_over_plan"] = None if ms is None else ms / plan["median_ms"]
        out.append(row)
    return out


def render(doc) -> str:
    lines = [f"{'variant':<22} {'step ms':>9} {'peak GiB':>9} {'compiled GiB':>13} {'predicted GiB':>14}"]
    for name, row in doc["table"].items():
        if row["status"] != "ok":
            lines.append(f"{name:<22} failed: {row['error'][:80]}")
            continue
        pred = doc["predicted"].get(name)
        f = lambda v, w: f"{v:>{w}.3f}" if v is not None else " " * (w - 1) + "-"  # noqa: E731
        lines.append(f"{name:<22} {f(row['median_ms'], 9)} {f(row['peak_gib'], 9)} {f(row['compiled_peak_gib'], 13)}"
                     f" {f(pred, 14)}")
    verdicts = doc.get("verdicts") or []
    if verdicts:
        lines += ["", "per budget: the fastest variant whose peak fits, its ms / the plan's (above 1: plan faster)",
                  f"{'budget':>7} {'plan ms':>8} {'fits':>5}  {'fastest JAX (uniform, J-)':<26} {'ratio':>6}  "
                  f"{'fastest torch.compile':<22} {'ratio':>6}"]
        for v in verdicts:
            r = lambda x: f"{x:6.3f}" if x is not None else "     -"  # noqa: E731
            lines.append(f"{v['budget_gib']:>7g} {v['plan_ms']:>8.2f} {str(v['plan_fits']):>5}  "
                         f"{v['jax'] or '-':<26} {r(v['jax_over_plan'])}  {v['torch'] or '-':<22} "
                         f"{r(v['torch_over_plan'])}")
    for b, p in doc["plans"].items():
        if isinstance(p, dict) and "refused" in p:
            lines.append(f"budget {b} GiB refused: {p['refused']}")
    return "\n".join(lines)


def plot(doc, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in doc["table"].items():
        mem = row.get("peak_gib") or row.get("compiled_peak_gib")
        if row["status"] != "ok" or mem is None or row["median_ms"] is None:
            continue
        marker = "o" if name.startswith("plan") else ("s" if name.startswith("uniform") else
                                                       ("^" if name.startswith("T-") else "D"))
        ax.scatter(mem, row["median_ms"], marker=marker)
        ax.annotate(name, (mem, row["median_ms"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for b in doc["budgets"]:
        ax.axvline(b, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("peak device memory (GiB)")
    ax.set_ylabel("step time (ms, median)")
    ax.set_title(f"{doc['config']['name']}: time vs memory ({doc['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(doc, out) -> None:
    os.makedirs(out, exist_ok=True)
    doc["table"] = summarize(doc["rows"])
    doc["verdicts"] = budget_verdicts(doc)
    tmp = os.path.join(out, "bench_budget.json.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, os.path.join(out, "bench_budget.json"))
    with open(os.path.join(out, "bench_budget.txt"), "w") as f:
        f.write(render(doc) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU)")
    p.add_argument("--sections", default="budgets,torch", help="comma list of budgets, torch, 7b")
    p.add_argument("--budgets", default=None, help="GiB, comma list (default 4,5,6,8,12; smoke: small)")
    p.add_argument("--variants", default=None, help="only the variants whose names start with these (comma list)")
    p.add_argument("--options", default=None, help="the planner's options by name (default: all of default_options)")
    p.add_argument("--timing", default=None, choices=("flops", "profile"),
                   help="how the planner prices time (measure_costs; default profile, smoke flops)")
    p.add_argument("--torch-budgets", default=TORCH_BUDGETS,
                   help=f"torch.compile activation_memory_budget fractions, comma list (default {TORCH_BUDGETS})")
    p.add_argument("--budget-7b", type=float, default=60.0, help="GiB for the 7b section")
    p.add_argument("--repeats", type=int, default=1, help="processes per variant")
    p.add_argument("--steps", type=int, default=None, help="timed steps per process (default 8; smoke 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--jobs", type=int, default=4, help="processes compiling at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=280.0,
                   help="seconds from the start, planning included: no batch starts past it (results kept)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-process limit after GO")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results", "budget"))
    p.add_argument("--workdir", default=None, help="scratch (torch weights); default a temp dir")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in args.sections if s not in ("budgets", "torch", "7b")]
    if bad:
        p.error(f"unknown sections {bad}; valid: budgets, torch, 7b")
    default = "0.0016,0.002,0.003" if args.smoke else "4,5,6,8,12"
    args.budgets = [float(b) for b in (args.budgets or default).split(",")]
    args.torch_budgets = [float(f) for f in args.torch_budgets.split(",") if f]
    if any(not 0 < f <= 1 for f in args.torch_budgets):
        p.error(f"--torch-budgets: fractions in (0, 1], got {args.torch_budgets}")
    args.steps = args.steps or (2 if args.smoke else 8)
    args.timing = args.timing or ("flops" if args.smoke else "profile")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        with open(args.child) as f:
            child(json.load(f))
        return 0
    # The parent's probes and the children share the device: nobody preallocates it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    start = time.time()
    cfg = config(args.smoke)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench_budget_")
    if "torch" in args.sections:
        bc.ensure_weights(args.workdir, cfg, cfg.depth)
        bc.ensure_inputs(args.workdir, cfg)
    doc = {"config": cfg.__dict__, "budgets": args.budgets, "device": jax.devices()[0].device_kind,
           "versions": {"jax": jax.__version__}, "args": {k: v for k, v in vars(args).items() if k != "child"},
           "rows": [], "plans": {}, "predicted": {}}
    if "budgets" in args.sections:
        plans = plan_budgets(cfg, args.budgets, args.options, args.timing)
        doc["plans"] = {str(k): v for k, v in plans.items()}
        for b in args.budgets:
            if "peak" in plans[b]:
                doc["predicted"][f"plan-{b:g}GiB"] = plans[b]["peak"] / GIB
                print(f"--- budget {b:g} GiB\n{plans[b]['table']}", flush=True)
    else:
        plans = {}
    specs = variants(args, cfg, plans)
    if "7b" in args.sections:
        spec, big = big_specs(args)
        doc["plans"]["7b"] = big
        doc["predicted"][spec["variant"]] = big["peak"] / GIB
        print(f"--- 7b, {args.budget_7b:g} GiB\n{big['table']}", flush=True)
        specs.append(spec)
    write(doc, args.out)
    print(f"planned in {time.time() - start:.0f}s; {len(specs)} processes, batches start until "
          f"{args.deadline_s:.0f}s", flush=True)
    for i in range(0, len(specs), args.jobs):
        if time.time() - start > args.deadline_s:
            doc["skipped"] = [s["variant"] for s in specs[i:]]
            print(f"deadline: {len(specs) - i} processes not run", flush=True)
            break
        doc["rows"] += run_batch(specs[i:i + args.jobs], args.workdir, args.timeout_s)
        write(doc, args.out)
    write(doc, args.out)
    try:
        plot(doc, os.path.join(args.out, "bench_budget.png"))
    except ImportError as err:
        print(f"no plot: {err}")
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
