"""FSDP: the compiled train step of a model whose params dominate (8 CPU devices, in a
fresh process): per-device peak memory, and the all-gathers inside the scan body."""

from conftest import run_worker


def test_fsdp_gathers_block_by_block_inside_the_scan_and_cuts_the_peak(tmp_path):
    out = run_worker("fsdp", tmp_path)
    one, fsdp = out["data=1"], out["fsdp=8"]
    # params, gradients and both AdamW moments split 8 ways; one block gathered at a time
    assert fsdp["peak"] <= one["peak"] / 5, (fsdp["peak"], one["peak"])
    assert one["all_gathers"] == [] and fsdp["block_weights"] > 0
    # the forward scan and the backward (reconstruction) scan each gather exactly one
    # block's weights per iteration ...
    per_body = [sum(g) for g in fsdp["body_gathers"] if g]
    assert len(per_body) >= 2 and all(n == fsdp["block_weights"] for n in per_body), fsdp["body_gathers"]
    # ... the backward reduces that block's gradients there ...
    assert any(r > 0 for g, r in zip(fsdp["body_gathers"], fsdp["body_reductions"]) if g), fsdp["body_reductions"]
    # ... and nothing ever gathers a stacked (all-blocks) leaf
    assert max(fsdp["all_gathers"]) <= fsdp["largest_block_leaf"] < fsdp["depth"] * fsdp["largest_block_leaf"]
