"""experiments/fp8_weight_scaling.py on the real stories260K weights: both
weight scalings bind every seam of every layer and land near the gate."""

import json

from conftest import STORIES, load_experiment, needs_stories


@needs_stories
def test_weight_scaling_study_on_stories260k(tmp_path):
    out = tmp_path / "ws.json"
    assert load_experiment("fp8_weight_scaling").main(["--model", STORIES, "--tokens", "64", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tokens"] == 64 and set(res["seams"]) == {"qkv", "o", "ffn"}
    for name, r in res["seams"].items():
        for scaling in ("channel", "tensor"):
            c = r[scaling]
            # fp8 (3 mantissa bits) is close to, but not, the high-precision seam
            assert 0.99 < c["worst_bare_cos"] < 1.0 and 0.995 < c["worst_boundary_cos"] < 1.0, (name, scaling, c)
        assert r["channel"]["worst_bare_cos"] != r["tensor"]["worst_bare_cos"]  # the two really differ
        assert 0.0 < r["row_spread_binades_max"] < 8.0


def test_weight_scaling_study_without_the_model_says_so(tmp_path, capsys):
    mod = load_experiment("fp8_weight_scaling")
    assert mod.main(["--model", str(tmp_path / "missing.bin"), "--out", str(tmp_path / "x.json")]) == 2
    assert "stories260K checkpoint not found" in capsys.readouterr().err
