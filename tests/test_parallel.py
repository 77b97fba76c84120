"""eae_jax.parallel on one device: mesh specs, the logical-axis rules and the LM's
shardings, their errors, the GPipe schedule's bubble, and the pipelined LM against the
unpipelined stack. (Several devices: test_parallel_meshes, _fsdp, _passes, _multihost.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from conftest import TINY_TRAIN
from eae_jax.blocks import BlockConfig
from eae_jax.models import LMConfig
from eae_jax.parallel import (AXES, bubble_fraction, format_mesh, lm_logical_axes, logical_to_spec, make_mesh,
                              parse_mesh, without_axes)
from eae_jax.parallel.pipeline import ticks
from eae_jax.parallel.pipeline_lm import interleave_microbatches
from eae_jax.train import TrainConfig
from eae_jax.train.sharding import RunSharding
from parallel_worker import pipeline_vs_stack


def _abstract(spec):
    sizes = parse_mesh(spec)
    return AbstractMesh(tuple(sizes[a] for a in AXES), AXES)


@pytest.mark.parametrize("spec, sizes", [
    ("data=2,fsdp=2,model=2,stage=2", (2, 2, 2, 2)),
    (" model = 4 , data=2 ", (2, 1, 1, 4)),
    ("", (1, 1, 1, 1)),
])
def test_mesh_specs_name_axis_sizes_in_any_order(spec, sizes):
    assert tuple(parse_mesh(spec).values()) == sizes
    assert parse_mesh(format_mesh(parse_mesh(spec))) == parse_mesh(spec)


@pytest.mark.parametrize("spec, match", [
    ("tensor=2", "unknown axis 'tensor'"),
    ("data=2,data=4", "axis 'data' is given twice"),
    ("data=0", "data=0 is not a size"),
    ("data=two", "data=two is not a size"),
    ("data", "'data' is not axis=size"),
])
def test_bad_mesh_specs_name_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_mesh(spec)
    with pytest.raises(ValueError, match=match):
        TrainConfig(mesh=spec)


def test_a_mesh_needs_its_devices_and_devices_n_is_data_n():
    with pytest.raises(ValueError, match=f"mesh data=2,fsdp=4 needs 8 devices, {jax.device_count()} are available"):
        make_mesh("data=2,fsdp=4", devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="devices=2 and mesh='data=2' both given"):
        TrainConfig(devices=2, mesh="data=2")
    assert TrainConfig(mesh="fsdp=1,data=2").mesh == "data=2"  # stored in its canonical spelling


def test_the_rules_split_each_dimension_over_its_mesh_axes():
    mesh = _abstract("data=2,fsdp=4,model=2")
    # Megatron: q column-split over model, the model width over fsdp; the depth over stage (size 1: dropped)
    assert tuple(logical_to_spec(("layers", "heads", "embed"), mesh=mesh, shape=(4, 64, 32))) == (None, "model", "fsdp")
    assert tuple(logical_to_spec(("batch", None), mesh=mesh, shape=(8, 3))) == (("data", "fsdp"), None)
    assert tuple(without_axes(PartitionSpec("model", ("data", "fsdp")), ["fsdp"])) == ("model", "data")
    with pytest.raises(ValueError, match=r"w: dimension 1 \(embed\) of shape \(64, 30\) does not split evenly over "
                                         r"mesh axes \('fsdp',\) of 4 devices"):
        logical_to_spec(("heads", "embed"), mesh=mesh, shape=(64, 30), name="w")
    with pytest.raises(ValueError, match="logical axis 'width' has no rule"):
        logical_to_spec(("width",))
    with pytest.raises(ValueError, match="mesh axis 'fsdp' splits two dimensions"):
        logical_to_spec(("embed", "embed"))


def test_tensor_parallelism_splits_whole_heads():
    cfg = LMConfig(64, 2, BlockConfig(32, 4, 2, 48))
    # 2 kv heads over model=4: replicated (Megatron's GQA), the 4 q heads split
    axes = lm_logical_axes(cfg, _abstract("model=4"))
    assert axes["blocks"]["attn"]["wk"] == ("layers", None, "embed") and axes["blocks"]["attn"]["wq"][1] == "heads"
    assert lm_logical_axes(cfg, _abstract("model=2"))["blocks"]["attn"]["wk"] == ("layers", "kv_heads", "embed")
    with pytest.raises(ValueError, match="num_heads=4 does not divide by 8"):
        lm_logical_axes(cfg, _abstract("model=8"))


@pytest.mark.parametrize("mesh, kw, match", [
    ("data=4", dict(batch=4, microbatches=2), "micro-batch of 2 sequences does not split over the 4 devices of data"),
    ("stage=2,fsdp=2", {}, "a pipeline .stage > 1. combines with data parallelism only"),
    ("stage=3", {}, "depth 4 does not split into 3 stages"),
])
def test_run_layouts_that_cannot_work_are_refused(mesh, kw, match):
    cfg = TrainConfig(**{**TINY_TRAIN, "batch": 8, **kw})
    with pytest.raises(ValueError, match=match):
        RunSharding(cfg, cfg.model(), _abstract(mesh))


@pytest.mark.parametrize("stages, micro", [(1, 4), (2, 1), (4, 8), (3, 5)])
def test_the_bubble_is_the_share_of_idle_stage_ticks(stages, micro):
    # count the schedule's idle slots directly: stage s runs microbatch t - s at tick t
    busy = sum(0 <= t - s < micro for s in range(stages) for t in range(ticks(stages, micro)))
    assert busy == stages * micro
    assert bubble_fraction(stages, micro) == pytest.approx(1 - busy / (stages * ticks(stages, micro)), abs=1e-15)


def test_interleaved_microbatches_are_the_contiguous_ones_reordered():
    x = np.arange(12)
    inter = np.asarray(interleave_microbatches(x, 3))
    np.testing.assert_array_equal(inter.reshape(4, 3).T, x.reshape(3, 4))  # microbatch m: rows m, m+3, ...


def test_the_pipelined_lm_equals_the_microbatched_stack():
    """One device, two microbatches (eight devices: test_parallel_passes)."""
    out = pipeline_vs_stack("data=1")
    assert abs(out["loss"] - out["ref_loss"]) <= 1e-6 * out["ref_loss"]
    assert out["grad_err"] <= 1e-5 and out["stats_err"] <= 1e-5 and out["calls"] == 1.0
    assert out["clipped"] == [2, 5]  # the pass acted where asked, at the whole model's boundary indices
