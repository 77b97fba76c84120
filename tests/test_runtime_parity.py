"""End-to-end gradient parity with the seed runtime (issue 3's acceptance, kept with interop).

The same PreNormTransformerBlock weights run through
``eae_jax.reconstruct(passes=chain(int8_fake_quant(), clip_by_norm(1.0)))``
and through ``eae_runtime.EAERuntime(..., passes=[Int8QuantizationPass(),
ClipPass(1.0)]).compute_gradients``; every parameter gradient, the input
adjoint and the int8 scale used at every boundary must agree.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("eae_runtime")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eae_jax  # noqa: E402
from eae_jax import passes  # noqa: E402
from eae_jax.blocks import decoder_block  # noqa: E402
from interop.torch_blocks import block_param_name, import_seed_blocks  # noqa: E402

TOL = 1e-5  # float32


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class ScaleRecorder:
    """Seed-side pass that notes the int8 scale each boundary's adjoint was quantized with."""

    name = "ScaleRecorder"

    def __init__(self):
        self.scales = {}
        self.adjoints = {}

    def __call__(self, adjoint, context=None):
        i = context["block_index"]
        self.scales[i] = adjoint.metadata.get("quantization_scale")
        self.adjoints[i] = adjoint.tensor.detach().clone()
        return adjoint


def run_both(heads, kv, depth, pipeline, seed):
    from eae_runtime import EAERuntime, RuntimeConfig
    from eae_runtime.contrib import PreNormTransformerBlock

    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList([
        PreNormTransformerBlock(32, heads, num_kv_heads=kv, max_seq_len=64, ffn_hidden_dim=64) for _ in range(depth)])
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 12, 32, generator=g)
    target = torch.randn(2, 12, 32, generator=g)

    def torch_loss(y):
        return 0.5 * ((y - target) ** 2).sum()  # output adjoint norm >> 1: the clip acts

    seed_passes, jax_passes = pipeline
    recorder = ScaleRecorder()
    runtime = EAERuntime(blocks, None, RuntimeConfig(passes=list(seed_passes()) + [recorder], enable_profiler=False))
    t_loss, t_grads = runtime.compute_gradients(x, torch_loss)

    imported = import_seed_blocks(blocks)
    stack = eae_jax.reconstruct(decoder_block(imported.config), passes=passes.chain(*jax_passes(), passes.capture()))
    jx, jt = jnp.asarray(x.numpy()), jnp.asarray(target.numpy())
    carry = stack.init(imported.params, jx)

    @jax.jit
    def step(params, carry):
        def loss(params, carry):
            return 0.5 * jnp.sum((stack(params, jx, carry) - jt) ** 2)

        value, (g_params, g_carry) = jax.value_and_grad(loss, argnums=(0, 1))(params, carry)
        carry, stats = stack.update(carry, g_carry)
        return value, g_params, carry, stats

    j_loss, j_grads, carry, stats = step(imported.params, carry)
    return blocks, recorder, float(t_loss), t_grads, float(j_loss), j_grads, stack.state(carry), stats


def int8_clip():
    from eae_runtime.passes import ClipPass, Int8QuantizationPass

    return (lambda: [Int8QuantizationPass(), ClipPass(1.0)],
            lambda: [passes.int8_fake_quant(), passes.clip_by_norm(1.0)])


@pytest.mark.parametrize("heads,kv,depth,seed", [(4, 4, 2, 0), (4, 2, 4, 1), (4, 1, 3, 2)])
def test_int8_clip_gradients_match_eae_runtime(heads, kv, depth, seed):
    blocks, rec, t_loss, t_grads, j_loss, j_grads, state, stats = run_both(heads, kv, depth, int8_clip(), seed)
    assert abs(j_loss - t_loss) <= TOL * abs(t_loss)
    assert float(stats["calls"]) == 1.0
    # every parameter of every block
    checked = 0
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            _, _, group, leaf = block_param_name(i, name).split(".")  # blocks.<i>.<group>.<leaf>
            got = np.asarray(j_grads[group][leaf][i])
            want = t_grads[p].numpy()
            assert got.shape == want.shape
            assert rel_err(got, want) <= TOL, (i, name, rel_err(got, want))
            checked += 1
    assert checked == 9 * depth
    # the adjoint that leaves the stack (boundary 0, after the passes)
    chain_state = state["segments"][0]
    adj0 = np.asarray(chain_state[-1].adjoint[0])
    assert rel_err(adj0, rec.adjoints[0].numpy()) <= TOL
    # int8 scale per boundary: JAX Int8State vs the seed's metadata['quantization_scale']
    j_scales = list(np.asarray(chain_state[0].scale)) + [float(state["top"][0].scale)]
    for b in range(depth + 1):
        assert rec.scales[b] is not None
        assert abs(j_scales[b] - rec.scales[b]) <= TOL * rec.scales[b], b
    # the clip really acted: adjoint norms after the passes are <= 1, and smaller than before at the output
    after = np.asarray(stats["adjoint_norm_after_passes"])
    assert np.all(after <= 1.0 + 1e-5) and float(stats["adjoint_norm"][-1]) > 1.0


def test_a_wrong_pipeline_is_detected():
    """The comparison can fail: the seed without ClipPass vs JAX with it."""
    from eae_runtime.passes import Int8QuantizationPass

    pipeline = (lambda: [Int8QuantizationPass()], lambda: [passes.int8_fake_quant(), passes.clip_by_norm(1.0)])
    blocks, rec, t_loss, t_grads, j_loss, j_grads, state, stats = run_both(4, 2, 2, pipeline, 0)
    p = blocks[0].attn.q_proj.weight
    assert rel_err(np.asarray(j_grads["attn"]["wq"][0]), t_grads[p].numpy()) > 0.5
