"""`experiments/offload_optim_donation.py` on CPU: the donated state is aliased, the undonated one is not."""

import json

from conftest import load_experiment


def test_smoke_run_aliases_the_donated_state_only(tmp_path):
    exp = load_experiment("offload_optim_donation")
    assert exp.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "offload_optim_donation.json").read_text())
    rows, state = result["rows"], result["state_bytes"]

    def aliased(row):  # XLA:CPU counts its host memory kind as device memory
        return row["alias_size_in_bytes"] + (row["host_alias_size_in_bytes"] or 0)

    assert aliased(rows["state donated, shardings named"]) >= state
    assert aliased(rows["params donated"]) <= result["param_bytes"] < state
    assert len(rows["state donated, shardings named"]["step_s"]) == 2
