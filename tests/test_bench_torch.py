"""The benchmark's PyTorch side (experiments/bench_torch.py) against the seed
reference (`eae_runtime`): the SDPA/GQA block computes the reference block's
function, the loss keeps no float32 tensors, the no-host-read scheduler
gives the seed's gradients without its per-block ``.item()``, and every
step mode computes the same gradients."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("eae_runtime")

from conftest import load_experiment, rel_err  # noqa: E402

bt = load_experiment("bench_torch")
import bench_common as bc  # noqa: E402  (load_experiment put experiments/ on the path)

DIM, HEADS, KV, FFN, SEQ, DEPTH = 32, 4, 2, 64, 12, 3


def _weights(depth=DEPTH, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = bc.StackConfig("t", DIM, HEADS, KV, FFN, depth, 2, SEQ)
    out = {}
    for name, shape in cfg.leaf_shapes().items():
        t = torch.rand((depth,) + shape, generator=g) * 2 - 1
        out[name] = 1 + 0.1 * t if name.endswith("scale") else t / shape[-1] ** 0.5
    return out


def _blocks(dtype=torch.float32, depth=DEPTH):
    shape = {"dim": DIM, "heads": HEADS, "kv_heads": KV, "ffn": FFN, "depth": depth}
    weights = _weights(depth)
    return bt.build_blocks(shape, lambda name, i: weights[name][i], bc.LEAVES, SEQ, "cpu", dtype)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, SEQ, DIM, generator=g).to(dtype), torch.randn(2, SEQ, DIM, generator=g).to(dtype)


def _grads(blocks, grads=None):
    return [(grads[p] if grads is not None else p.grad).detach().double().clone() for p in blocks.parameters()]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_sdpa_gqa_block_computes_the_reference_block(dtype, tol):
    from eae_runtime.contrib import PreNormTransformerBlock

    ours = _blocks(dtype, depth=1)[0]
    ref = PreNormTransformerBlock(DIM, HEADS, num_kv_heads=KV, max_seq_len=64, ffn_hidden_dim=FFN).to(dtype)
    ref.load_state_dict(ours.state_dict(), strict=True)
    x, _ = _inputs(dtype)
    outs, grads = [], []
    for blk in (ours, ref):
        xi = x.clone().requires_grad_(True)
        out = blk(xi)
        out.float().square().sum().backward()
        outs.append(out.detach().double())
        grads.append([xi.grad.double()] + [p.grad.double() for p in blk.parameters()])
    assert rel_err(outs[0], outs[1]) < tol
    for a, b in zip(grads[0], grads[1]):
        assert rel_err(a, b) < 5 * tol


def test_gqa_grouping_is_the_references_repeat_interleave():
    # two kv heads, four query heads: heads 0,1 read kv head 0 and heads 2,3 kv head 1
    blk = _blocks(torch.float32, depth=1)[0]
    with torch.no_grad():
        blk.attn.v_proj.weight[: DIM // HEADS] = 0.0  # kv head 0 sees zero values
    x, _ = _inputs()
    captured = {}
    hook = blk.attn.out_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("o", a[0].detach()))
    blk(x)
    hook.remove()
    hd = DIM // HEADS
    o = captured["o"].view(2, SEQ, HEADS, hd)
    assert torch.all(o[:, :, :2] == 0) and torch.all(o[:, :, 2:].abs().sum((0, 1, 3)) > 0)


def test_expanded_kv_heads_compute_what_enable_gqa_does():
    # the compile-budget variants repeat the kv heads (torch's partitioner refuses grouped SDPA shapes)
    blk = _blocks(torch.float32, depth=1)[0]
    x, _ = _inputs()
    with torch.no_grad():
        grouped = blk(x)
        blk.attn.expand_kv = True
        expanded = blk(x)
    assert blk.attn.num_kv_heads < blk.attn.num_heads
    assert rel_err(expanded.double(), grouped.double()) < 1e-6


def test_rope_tables_match_the_seed_tables_rounded_once():
    from eae_runtime.contrib import RotaryPositionalEmbedding

    ref = RotaryPositionalEmbedding(8, max_seq_len=64)
    ours = bt.RopeTables(8, SEQ, torch.bfloat16)
    assert torch.equal(ours.cos, ref.cos_cached[:SEQ].to(torch.bfloat16))
    assert torch.equal(ours.sin, ref.sin_cached[:SEQ].to(torch.bfloat16))


def test_sequence_longer_than_the_tables_is_refused():
    blk = _blocks(depth=1)[0]
    with pytest.raises(ValueError, match="longer than the RoPE tables"):
        blk(torch.zeros(1, SEQ + 1, DIM))


def test_half_mse_value_gradient_and_saved_tensors():
    out = torch.randn(3, 5, 7).to(torch.bfloat16).requires_grad_(True)
    y = torch.randn(3, 5, 7).to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        loss = bt.half_mse(out, y)
    loss.backward()
    d = out.detach().double().numpy() - y.double().numpy()
    assert loss.dtype == torch.float32
    assert float(loss.detach()) == pytest.approx(0.5 * np.mean(d * d), rel=1e-6)
    want = (d / d.size).astype(np.float32)
    np.testing.assert_allclose(out.grad.float().numpy(), want, rtol=1e-2, atol=1e-6)
    assert saved == [torch.bfloat16, torch.bfloat16]  # the inputs only, no float32 copy
    with pytest.raises(ValueError, match="differ in shape"):
        bt.half_mse(out, y[:, :4])


def test_no_host_read_scheduler_gives_the_seeds_gradients_without_item(monkeypatch):
    x, y = _inputs()
    calls = {"n": 0}
    item = torch.Tensor.item

    def counting_item(self):
        calls["n"] += 1
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    results = {}
    for mode in ("eae", "eae-nosync"):
        blocks = _blocks()
        calls["n"] = 0
        loss, grads = bt.make_step(blocks, mode, x, y)()
        results[mode] = (float(loss), _grads(blocks, grads), calls["n"])
    assert results["eae"][2] == DEPTH  # the seed reads one norm per block
    assert results["eae-nosync"][2] == 0
    assert results["eae"][0] == results["eae-nosync"][0]
    for a, b in zip(results["eae"][1], results["eae-nosync"][1]):
        assert torch.equal(a, b)


def test_eager_modes_compute_the_same_gradients():
    x, y = _inputs()
    ref_blocks = _blocks()
    ref_loss, _ = bt.make_step(ref_blocks, "plain", x, y, backend="math")()
    ref = _grads(ref_blocks)
    for mode in ("ckpt", "eae", "eae-nosync"):
        blocks = _blocks()
        loss, grads = bt.make_step(blocks, mode, x, y, backend="math")()
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
        for a, b in zip(_grads(blocks, grads), ref):
            assert rel_err(a, b) < 1e-5, mode


def test_a_pinned_backend_that_cannot_run_raises():
    x, y = _inputs()
    # the memory-efficient kernel has no enable_gqa path on the CPU
    with pytest.raises(RuntimeError):
        bt.make_step(_blocks(), "plain", x, y, backend="efficient")()


def test_bad_arguments_are_refused():
    x, y = _inputs()
    with pytest.raises(ValueError, match="unknown torch mode"):
        bt.make_step(_blocks(), "nope", x, y)
    with pytest.raises(ValueError, match="compile-budget"):
        bt.make_step(_blocks(), "plain", x, y, budget=0.5)
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        bt.sdpa_backend("fast")
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            bt.set_memory_budget(bad)


@pytest.mark.slow
def test_compiled_modes_compute_the_same_gradients():
    """torch.compile (inductor, C++ on the CPU) of each block, of each
    checkpointed block, and under an activation budget: eager's gradients,
    and one compiled graph for all blocks (the input needs a gradient here,
    so the first block's graph is the others')."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    from torch._dynamo.utils import counters

    x, y = _inputs()
    x.requires_grad_(True)
    ref_blocks = _blocks()
    bt.make_step(ref_blocks, "plain", x, y, backend="math")()
    ref = _grads(ref_blocks) + [x.grad.double().clone()]
    before = functorch_config.activation_memory_budget
    try:
        for mode, budget in (("compile", None), ("compile-ckpt", None), ("compile-budget", 0.3)):
            torch._dynamo.reset()
            counters.clear()
            blocks = _blocks()
            step = bt.make_step(blocks, mode, x, y, backend="math", budget=budget)
            for _ in range(2):
                x.grad = None
                step()
            for a, b in zip(_grads(blocks) + [x.grad.double()], ref):
                assert rel_err(a, b) < 1e-5, mode
            assert counters["stats"]["unique_graphs"] == 1, (mode, dict(counters["stats"]))
            if budget is not None:
                assert functorch_config.activation_memory_budget == budget
    finally:
        functorch_config.activation_memory_budget = before
        torch._dynamo.reset()
