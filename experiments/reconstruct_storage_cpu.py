"""What each boundary storage of `reconstruct` compiles to, and what it computes.

For every storage (chosen through `reconstruct`'s keywords, so the script
runs unchanged against any revision of the library) this records:

* the compiled train step of a small decoder stack: `memory_analysis()`
  (temp, argument, output bytes) and the HLO instruction counts by opcode;
* the compiled gradient of a small stack whose blocks read a side input
  (temp bytes, HLO instructions);
* a SHA-256 of the bits of everything a train step returns (loss, parameter
  and input gradients, the next pass state, the statistics) for a grid of
  small stacks: scanned, a list of single blocks, a heterogeneous stack
  with int token input, a side input, and a pass chain.

Run it on two revisions and compare: the digests say whether results are
bit-identical, the table whether the compiled programs do the same work::

    PYTHONPATH=/path/to/old python experiments/reconstruct_storage_cpu.py --out /tmp/before.json
    PYTHONPATH=$PWD python experiments/reconstruct_storage_cpu.py --out /tmp/after.json
    python experiments/reconstruct_storage_cpu.py --compare /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

#: Storage variants as `reconstruct` keywords.
STORAGES = {
    "device": {"boundaries_in_grads": False},
    "device-bf16": {"boundaries_in_grads": False, "boundary_dtype": "bfloat16"},
    "grad-slots": {},
    "grad-slots-bf16": {"boundary_dtype": "bfloat16"},
    "policy-dots": {"policy": "dots"},
    "policy-everything": {"policy": "everything"},
    "host-scan": {"offload": True},
    "host-scan-bf16": {"offload": True, "boundary_dtype": "bfloat16"},
    "host-unrolled": {"offload": "unrolled"},
}

_OPCODE = re.compile(r"=\s.*?\s([a-z][a-z0-9\-]*)\(")


def hlo_op_counts(text: str) -> dict:
    """Instruction count per HLO opcode of a compiled module's text."""
    counts = collections.Counter()
    for line in text.splitlines():
        if " = " not in line or line.lstrip().startswith(("HloModule", "//")):
            continue
        m = _OPCODE.search(line)
        if m:
            counts[m.group(1)] += 1
    return dict(sorted(counts.items()))


def _train_step(stack):
    def loss(p, c, x, y, side):
        out = stack(p, x, c) if side is None else stack(p, x, c, side=side)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    def step(p, c, x, y, side=None):
        argnums = (0, 1, 2) if jnp.issubdtype(x.dtype, jnp.floating) else (0, 1)
        val, grads = jax.value_and_grad(loss, argnums=argnums)(p, c, x, y, side)
        new_c, stats = stack.update(c, grads[1], strict=False)
        return val, grads[0], grads[2:], stack.state(new_c), stats

    return step


def decoder_compiled(kw) -> dict:
    import eae_jax
    from eae_jax.blocks import BlockConfig, decoder_block, init_stack

    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128)
    params = init_stack(jax.random.key(0), cfg, 4)
    x = jax.random.normal(jax.random.key(1), (2, 32, 64))
    stack = eae_jax.reconstruct(decoder_block(cfg), **kw)
    carry = stack.init(params, x)
    compiled = jax.jit(_train_step(stack)).lower(params, carry, x, x).compile()
    ma = compiled.memory_analysis()
    ops = hlo_op_counts(compiled.as_text())
    return {"temp_bytes": ma.temp_size_in_bytes, "argument_bytes": ma.argument_size_in_bytes,
            "output_bytes": ma.output_size_in_bytes, "hlo_instructions": sum(ops.values()), "hlo_ops": ops}


def side_compiled(kw) -> dict:
    """Compiled gradient of a 6-block MLP stack whose blocks read a (512, 64) side input."""
    import eae_jax

    def block(p, h, gate):
        return h + jnp.tanh(h @ p["w1"]) @ p["w2"] * gate

    params = {"w1": jnp.full((6, 64, 256), 0.01), "w2": jnp.full((6, 256, 64), 0.01)}
    x, gate = jnp.ones((512, 64)), jnp.linspace(0.0, 1.0, 512 * 64).reshape(512, 64)
    stack = eae_jax.reconstruct(block, **kw)
    compiled = jax.jit(jax.grad(lambda p, x, s: jnp.sum(stack(p, x, side=s)))).lower(params, x, gate).compile()
    return {"temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "hlo_instructions": sum(hlo_op_counts(compiled.as_text()).values())}


def _mlp(p, h):
    return h + jnp.tanh(h @ p["w1"]) @ p["w2"] * p["s"]


def _mlp_params(key, depth=None):
    lead = () if depth is None else (depth,)
    k1, k2 = jax.random.split(key)
    return {"w1": 0.4 * jax.random.normal(k1, lead + (8, 12)), "w2": 0.4 * jax.random.normal(k2, lead + (12, 8)),
            "s": jnp.full(lead + (8,), 0.9)}


def grid_cases():
    """(name, blocks, params, x, side) of the small stacks every storage runs."""
    import eae_jax

    key = jax.random.key(7)
    ks = jax.random.split(key, 6)
    x = jax.random.normal(ks[0], (3, 8))
    tokens = jnp.array([[1, 4, 2], [0, 3, 3]], jnp.int32)
    return [
        ("scanned", _mlp, _mlp_params(ks[1], 3), x, None),
        ("list", [_mlp, _mlp, _mlp], [_mlp_params(k) for k in jax.random.split(ks[2], 3)], x, None),
        ("hetero-int-input", [lambda t, i: jnp.take(t, i, axis=0), eae_jax.Scan(_mlp, "body"), _mlp],
         [jax.random.normal(ks[3], (5, 8)), _mlp_params(ks[4], 2), _mlp_params(ks[5])], tokens, None),
        ("side", lambda p, h, gate: _mlp(p, h) * gate[:, None], _mlp_params(ks[1], 3), x,
         jnp.linspace(0.5, 1.5, 3)),
    ]


def grid_digests(kw) -> dict:
    import eae_jax
    from eae_jax.passes import chain, clip_by_norm, int8_fake_quant, statistics

    out = {}
    for passes_name, passes in (("no-passes", None), ("passes", [int8_fake_quant(), clip_by_norm(0.05),
                                                                   statistics()])):
        for name, blocks, params, x, side in grid_cases():
            stack = eae_jax.reconstruct(blocks, passes=passes, **kw)
            carry = stack.init(params, x, jax.random.key(3), side=side)
            shape = jax.eval_shape(lambda: stack(params, x, side=side)).shape
            y = jnp.cos(jnp.arange(int(np.prod(shape)), dtype=jnp.float32)).reshape(shape)
            res = jax.jit(_train_step(stack))(params, carry, x, y, side)
            digest = hashlib.sha256()
            for leaf in jax.tree_util.tree_leaves(res):
                arr = np.asarray(jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
                                 else leaf)
                digest.update(str(arr.dtype).encode() + str(arr.shape).encode() + arr.tobytes())
            out[f"{name}/{passes_name}"] = digest.hexdigest()[:16]
    return out


def compare(before_path: str, after_path: str) -> int:
    before, after = (json.load(open(p)) for p in (before_path, after_path))
    print(f"{'storage':<18} {'temp B':>18} {'argument B':>18} {'output B':>18} {'HLO instr.':>14}  digests")
    bad = 0
    for name in before["storages"]:
        b, a = before["storages"][name], after["storages"].get(name)
        if a is None:
            print(f"{name:<18} missing after")
            bad += 1
            continue
        cells = []
        for k in ("temp_bytes", "argument_bytes", "output_bytes", "hlo_instructions"):
            cells.append(f"{b['compiled'][k]}->{a['compiled'][k]}" if b["compiled"][k] != a["compiled"][k]
                         else f"{b['compiled'][k]} =")
        same = sum(b["digests"][c] == a["digests"].get(c) for c in b["digests"])
        print(f"{name:<18} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} {cells[3]:>14}  "
              f"{same}/{len(b['digests'])} identical")
        bad += same != len(b["digests"])
        if "side_compiled" in b and "side_compiled" in a:
            sb, sa = b["side_compiled"], a["side_compiled"]
            print(f"{'':<18} with a side input: temp {sb['temp_bytes']}->{sa['temp_bytes']}, "
                  f"HLO {sb['hlo_instructions']}->{sa['hlo_instructions']}")
        diff = {op: (b["compiled"]["hlo_ops"].get(op, 0), a["compiled"]["hlo_ops"].get(op, 0))
                for op in set(b["compiled"]["hlo_ops"]) | set(a["compiled"]["hlo_ops"])
                if b["compiled"]["hlo_ops"].get(op, 0) != a["compiled"]["hlo_ops"].get(op, 0)}
        if diff:
            print(f"{'':<18} opcodes before->after: {dict(sorted(diff.items()))}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the measurements here (JSON)")
    ap.add_argument("--only", help="comma-separated storage names (default: all)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print the before/after table")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    import eae_jax

    names = args.only.split(",") if args.only else list(STORAGES)
    result = {"command": " ".join(["python"] + sys.argv), "jax": jax.__version__, "backend": jax.default_backend(),
              "eae_jax": eae_jax.__file__, "storages": {}}
    for name in names:
        kw = STORAGES[name]
        row = {"kwargs": kw, "compiled": decoder_compiled(kw), "side_compiled": side_compiled(kw),
               "digests": grid_digests(kw)}
        result["storages"][name] = row
        c = row["compiled"]
        print(f"{name:<18} temp {c['temp_bytes']:>9} arg {c['argument_bytes']:>9} out {c['output_bytes']:>9} "
              f"HLO {c['hlo_instructions']:>5}", flush=True)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        import os

        os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
