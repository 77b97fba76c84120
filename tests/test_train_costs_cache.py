"""The memory costs a budgeted run keeps in its run directory (`eae_jax.train.costs_cache`)."""

import json

from eae_jax.reconstruct.costs import Costs, OptionCost, SegmentCosts
from eae_jax.train import TrainConfig
from eae_jax.train.costs_cache import FILENAME, UNRELATED, costs_key, load_costs, save_costs


def _costs():
    seg = SegmentCosts("decoder_block", 4, True, {"device": OptionCost(40, 10, 20, 1e-3, 0),
                                                  "dots": OptionCost(70, 40, 30, 5e-4, 0)})
    return Costs([seg], "device", 1000, 2e-3, 64, 64, "flops", "cpu")


def test_costs_saved_for_a_key_come_back_whole_for_that_key_only(tmp_path):
    said = []
    key = costs_key(TrainConfig(preset="tiny", batch=2, seq_len=8))
    assert save_costs(str(tmp_path), key, _costs()) == str(tmp_path / FILENAME)
    assert load_costs(str(tmp_path), key, said.append) == _costs()
    assert said == [f"memory costs reused from {tmp_path / FILENAME} (same model, layout and devices)"]
    other = costs_key(TrainConfig(preset="tiny", batch=4, seq_len=8))
    assert load_costs(str(tmp_path), other, said.append) is None and "measured for another model" in said[-1]
    assert [p.name for p in tmp_path.iterdir()] == [FILENAME]  # the temporary file was renamed


def test_only_fields_that_change_no_program_are_left_out_of_the_key():
    base = TrainConfig(preset="tiny")
    for field, value in (("steps", 7), ("lr", 1.0), ("seed", 3), ("memory_budget", "2GiB"), ("out", "/x")):
        assert field in UNRELATED
        assert costs_key(TrainConfig(preset="tiny", **{field: value})) == costs_key(base)
    for field, value in (("batch", 4), ("seq_len", 16), ("dtype", "bf16"), ("passes", "int8"), ("depth", 3),
                         ("microbatches", 2), ("grad_accum_dtype", "bf16")):
        assert costs_key(TrainConfig(preset="tiny", **{field: value})) != costs_key(base), field


def test_an_unreadable_file_is_measured_again_and_said(tmp_path):
    (tmp_path / FILENAME).write_text("{not json")
    said = []
    assert load_costs(str(tmp_path), {"k": 1}, said.append) is None
    assert "could not be read (JSONDecodeError" in said[0] and "measuring again" in said[0]
    (tmp_path / FILENAME).write_text(json.dumps({"key": {"k": 1}}))  # no costs
    assert load_costs(str(tmp_path), {"k": 1}, said.append) is None and "KeyError" in said[-1]


def test_nothing_is_written_where_the_run_directory_does_not_exist(tmp_path):
    assert save_costs(str(tmp_path / "absent"), {"k": 1}, _costs()) is None
    assert not (tmp_path / "absent").exists()
