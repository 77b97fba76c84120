"""Where a training step's time goes: ``eae-jax train --profile`` on a small run, its stage table kept.

    python experiments/train_profile.py [--preset tiny] [--steps 8] [--profile 4:6] [--passes int8] [--out PATH]

Runs ``eae-jax train --synthetic`` (this checkout's ``eae_jax``) with
``--profile``, which traces the chosen steps with `jax.profiler` and sweeps
the trace into stages (`eae_jax.train.profile`). Records the stage table,
the step time measured on the host and the share of it the stages account
for (the acceptance: within 10%; exit 1 otherwise). Writes
``experiments/results/train_profile.json`` with the command and the
machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", default="4:6")
    parser.add_argument("--passes", default="int8")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "train_profile.json"))
    args = parser.parse_args(argv)
    import jax

    run = os.path.join(tempfile.mkdtemp(prefix="train_profile_"), "run")
    command = ["eae-jax", "train", "--synthetic", "--preset", args.preset, "--steps", str(args.steps), "--profile",
               args.profile, "--passes", args.passes, "--log-every", str(args.steps), "--out", run]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    load = os.getloadavg()
    proc = subprocess.run([sys.executable, "-m", "eae_jax.cli", *command[1:]], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    stages = json.load(open(os.path.join(run, "profile", "stages.json")))
    attributed = sum(v for k, v in stages["stages_s"].items() if k != "unattributed")
    share = attributed / stages["measured_step_s"]
    table = proc.stdout[proc.stdout.index("profile of steps"):].split("\nstep ")[0]
    result = {"command": " ".join(command[:-1] + ["runs/prof"]), "measured_with": "python experiments/train_profile.py",
              "steps": stages["steps"], "measured_step_s": stages["measured_step_s"],
              "stages_s": stages["stages_s"], "attributed_share": share, "within_10_percent": abs(1 - share) <= 0.1,
              "table": table.splitlines()[1:],
              "machine": {"cpu_count": os.cpu_count(), "load_average": load, "platform": platform.platform(),
                          "jax": jax.__version__, "device": jax.devices()[0].device_kind}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(table)
    print(f"stages account for {100 * share:.1f}% of the measured step time; wrote {args.out}")
    return 0 if result["within_10_percent"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
