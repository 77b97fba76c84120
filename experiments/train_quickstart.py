"""The README's first training command, timed from a cold start, and what it learned.

    python experiments/train_quickstart.py [--runs 1] [--out PATH]

Reads the command from README.md (the ``eae-jax train ...`` after its
set-up ``pip install``), runs it as a new user would in a fresh folder (the
text cache starts empty) with this checkout's ``eae_jax`` on the path, and
records the whole process's wall time and the run's summary: the
validation loss at step 0 and its best, the fraction it fell, compile time,
tokens/s. The acceptance is 5 minutes on a 2-core CPU and a validation loss
falling at least 30%; a run missing either exits 1. Writes
``experiments/results/train_quickstart.json`` with the machine's core count
and load (this project's machine is shared: its load average tells how busy
it was).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIMIT_S = 300.0
MIN_DROP = 0.30


def readme_command() -> list:
    """The argv of the README's first ``eae-jax train`` command (after its ``pip install``)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        m = re.search(r"^pip install [^\n]*?&& (eae-jax train [^\n`]*)$", f.read(), re.M)
    if not m:
        raise SystemExit("README.md has no 'pip install ... && eae-jax train ...' line")
    return shlex.split(m.group(1))


def run_once(argv: list) -> dict:
    """Run ``argv`` (``eae-jax train ... --out runs/X``) in a fresh folder; its wall time and summary."""
    work = tempfile.mkdtemp(prefix="quickstart_")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "eae_jax.cli", *argv[1:]]
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    out = os.path.join(work, summary["out"])
    return {"wall_s": wall, "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "plot_written": bool(summary.get("plot")) and os.path.isfile(os.path.join(work, summary["plot"])),
            "summary": {k: summary.get(k) for k in (
                "steps_run", "tokens", "wall_s", "compile_s", "validation_s", "tokens_per_s", "first_loss",
                "final_loss", "first_val_loss", "best_val_loss", "best_val_step", "val_loss_drop", "trained_on")},
            "run_dir_files": sorted(os.listdir(out))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="how many times to run the command")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "train_quickstart.json"))
    args = parser.parse_args(argv)
    import jax

    command = readme_command()
    runs = [run_once(command) for _ in range(args.runs)]
    ok = all(r["wall_s"] < LIMIT_S and r["summary"]["val_loss_drop"] >= MIN_DROP and r["plot_written"]
             for r in runs)
    result = {"command": " ".join(command), "measured_with": "python experiments/train_quickstart.py"
              + (f" --runs {args.runs}" if args.runs != 1 else ""),
              "acceptance": {"wall_s_below": LIMIT_S, "val_loss_drop_at_least": MIN_DROP, "met": ok},
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "jax": jax.__version__,
                          "device": jax.devices()[0].device_kind},
              "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"| run | wall s | compile s | tokens/s | val loss start | best | drop | load avg |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(runs):
        s = r["summary"]
        print(f"| {i} | {r['wall_s']:.1f} | {s['compile_s']:.1f} | {s['tokens_per_s']:,.0f} | {s['first_val_loss']:.3f} "
              f"| {s['best_val_loss']:.3f} | {100 * s['val_loss_drop']:.1f}% | {r['load_average_before'][0]:.1f} |")
    print(f"{result['command']}: {'meets' if ok else 'MISSES'} the acceptance (< {LIMIT_S:.0f} s, validation loss "
          f"down >= {100 * MIN_DROP:.0f}%); wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
