"""Parity of the JAX port with the torch reference blocks (forward, gradients, adjoints vs EAERuntime)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("eae_runtime")

from interop.parity import (  # noqa: E402
    END_TO_END_FLOOR,
    PIPELINES,
    TOLERANCES,
    ParityReport,
    blocks_case,
    compare,
    run_parity,
)


def reference_stack(heads, kv, depth, dim=32, ffn=64, seed=0):
    from eae_runtime.contrib import PreNormTransformerBlock

    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList([
        PreNormTransformerBlock(dim, heads, num_kv_heads=kv, max_seq_len=64, ffn_hidden_dim=ffn) for _ in range(depth)])
    with torch.no_grad():  # non-trivial norm gains
        for b in blocks:
            b.attn_norm.weight.uniform_(0.5, 1.5)
            b.ffn_norm.weight.uniform_(0.5, 1.5)
    return blocks


def check_report(report: ParityReport, depth: int, pipelines=PIPELINES):
    assert report.ok, "\n" + report.table()
    sections = {r.section for r in report.rows}
    assert {"forward", "grad"} <= sections
    names = [r.name for r in report.rows if r.section == "forward"]
    assert names[: depth + 1] == [f"x{i}" for i in range(depth + 1)]
    for p in pipelines:
        rows = [r for r in report.rows if r.section == f"adjoint[{p}]"]
        assert [r.name for r in rows[: depth + 1]] == [f"x{i}" for i in reversed(range(depth + 1))]
        assert len([r for r in report.rows if r.section == f"vjp[{p}]"]) == 2 * depth
        if p != "none":
            assert len([r for r in report.rows if r.section == f"pass[{p}]"]) == depth + 1
    # the tight rows (everything but end-to-end rows of quantizing pipelines) use the dtype tolerance
    tight = [r for r in report.rows if not (r.section.startswith("adjoint[") and r.section != "adjoint[none]")]
    assert all(r.tol == TOLERANCES[report.dtype] for r in tight)


# Every pipeline costs one more XLA compile of the reconstruct stack, so the three pipelines run
# on one configuration here; tests/test_runtime_parity.py covers int8+clip on MHA/GQA/MQA again.
@pytest.mark.parametrize("heads,kv,depth,pipelines", [
    (4, 4, 1, PIPELINES),   # MHA
    (4, 2, 3, ("none",)),   # GQA
    (4, 1, 2, ("none",)),   # MQA
], ids=["MHA-d1", "GQA-d3", "MQA-d2"])
def test_reference_blocks_float32(heads, kv, depth, pipelines):
    report = run_parity(blocks_case(reference_stack(heads, kv, depth), seq=12, seed=depth), pipelines=pipelines)
    check_report(report, depth, pipelines)
    # float32 is much better than the tolerance in practice
    assert report.worst("forward") < 2e-6 and report.worst("grad") < 2e-6


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv,depth,pipelines", [(8, 2, 4, ("fp16",)), (4, 1, 5, ("none", "int8_clip"))],
                         ids=["GQA-d4", "MQA-d5"])
def test_reference_blocks_float32_deeper(heads, kv, depth, pipelines):
    report = run_parity(blocks_case(reference_stack(heads, kv, depth, dim=64, ffn=96), seq=16, seed=depth),
                        pipelines=pipelines)
    check_report(report, depth, pipelines)


def test_reference_blocks_bfloat16():
    depth = 2
    pipelines = ("none", "int8_clip")
    report = run_parity(blocks_case(reference_stack(4, 2, depth), dtype="bfloat16", seq=12), pipelines=pipelines)
    check_report(report, depth, pipelines)
    assert report.dtype == "bfloat16" and report.worst("forward") > 1e-4  # it really ran in bf16


def test_parity_detects_a_perturbed_weight():
    report = run_parity(blocks_case(reference_stack(4, 2, 2), seq=8, perturb=1e-3), pipelines=("none",))
    assert not report.ok
    bad = {(r.section, r.name) for r in report.failures}
    assert ("forward", "x0") not in bad and ("forward", "x1") in bad and ("grad", "block 0") in bad
    assert "FAIL" in report.table()


def test_tolerance_override_and_report_dict():
    report = run_parity(blocks_case(reference_stack(4, 4, 1), seq=8), pipelines=(), tol=1e-12)
    assert not report.ok  # nothing in float32 is exact after a block
    d = report.to_dict()
    assert d["ok"] is False and len(d["rows"]) == len(report.rows) and d["rows"][0]["section"] == "forward"


def test_compare_metrics():
    a = np.array([1.0, 2.0, 3.0])
    assert compare(a, a) == (0.0, 0.0, 1.0)
    m, r, c = compare(a * 1.01, a)
    assert m == pytest.approx(0.03) and r == pytest.approx(0.01) and c == pytest.approx(1.0)
    assert compare(-a, a)[2] == pytest.approx(-1.0)
    assert compare(np.zeros(3), np.zeros(3)) == (0.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        compare(np.zeros(3), np.zeros(4))


def test_end_to_end_floors_are_loose_only_where_documented():
    assert END_TO_END_FLOOR["none"] == 0.0
    assert END_TO_END_FLOOR["fp16"] < 2.0 ** -8 and END_TO_END_FLOOR["int8_clip"] <= 5e-2
    with pytest.raises(ValueError, match="unknown pipeline"):
        run_parity(blocks_case(reference_stack(4, 4, 1), seq=8), pipelines=("fp8",))
