"""experiments/generate_speed.py runs end to end at tiny sizes (a smoke test: it times nothing it asserts)."""

import json

from conftest import load_experiment


def test_generate_speed_smoke(tmp_path):
    out = tmp_path / "speed.json"
    assert load_experiment("generate_speed").main(["--model", "tiny", "--steps", "6", "--repeats", "1",
                                                   "--out", str(out)]) == 0
    (record,) = json.load(open(out))["models"]
    assert record["tokens_identical"] and set(record["results"]) == {"recompute", "kv-cache"}
    assert record["speedup"] > 0 and "--steps 6" in json.load(open(out))["command"]
