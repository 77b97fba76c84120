"""The host-side event bus and the bridge from a jitted step's stats/pass state to events."""

import json
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import passes as P
from eae_jax.events import Event, EventBus, EventType, attach_json_logging, boundary_states, emit_step_events, summarize_state

D, DEPTH = 8, 3


def test_bus_delivers_to_type_and_wildcard_subscribers_in_order():
    bus = EventBus()
    seen = []
    bus.subscribe(EventType.PASS_APPLIED, lambda e: seen.append(("typed", e.type, e.payload["x"])))
    star = bus.subscribe("*", lambda e: seen.append(("star", e.type, e.payload.get("x"))))
    event = bus.emit(EventType.PASS_APPLIED, x=1)
    bus.emit(EventType.FORWARD_STARTED, num_blocks=3)
    assert isinstance(event, Event) and event.type == "PassApplied" and event.payload == {"x": 1}
    assert seen == [("typed", "PassApplied", 1), ("star", "PassApplied", 1), ("star", "ForwardStarted", None)]
    bus.unsubscribe("*", star)
    bus.unsubscribe("*", star)  # unknown: ignored
    bus.emit(EventType.FORWARD_STARTED)
    assert len(seen) == 3


def test_bus_recording_and_errors():
    bus = EventBus()
    bus.emit(EventType.FORWARD_STARTED)  # not recorded
    bus.start_recording()
    bus.emit(EventType.FORWARD_STARTED, n=1)
    bus.emit(EventType.FORWARD_FINISHED, n=2)
    assert [e.payload["n"] for e in bus.events_of_type(EventType.FORWARD_FINISHED)] == [2]
    log = bus.stop_recording()
    assert [e.type for e in log] == ["ForwardStarted", "ForwardFinished"]
    bus.emit(EventType.FORWARD_STARTED)
    assert len(bus.log) == 2
    with pytest.raises(TypeError, match="callable"):
        bus.subscribe("PassApplied", 3)
    with pytest.raises(TypeError, match="event_type"):
        bus.subscribe(None, print)
    with pytest.raises(TypeError, match="cannot emit"):
        bus.emit("*")

    def boom(event):
        raise RuntimeError("subscriber failed")

    bus.subscribe("PassApplied", boom)
    with pytest.raises(RuntimeError, match="subscriber failed"):
        bus.emit("PassApplied")


def test_seed_event_names():
    pytest.importorskip("eae_runtime")
    from eae_runtime.events import EventType as SeedEventType

    seed_names = {v for k, v in vars(SeedEventType).items() if k.isupper()}
    assert seed_names == set(EventType.ALL)


def _block(p, x):
    return x + jnp.tanh(x @ p["w"])


def _setup(passes):
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (DEPTH, D, D)) * 0.5}
    x = jax.random.normal(k[1], (2, 4, D))
    y = jax.random.normal(k[2], (2, 4, D))
    stack = eae_jax.reconstruct(_block, passes=passes)

    @jax.jit
    def step(params, carry):
        loss, (gp, gc) = jax.value_and_grad(lambda p, c: jnp.mean((stack(p, x, c) - y) ** 2), argnums=(0, 1))(
            params, carry)
        carry, stats = stack.update(carry, gc)
        return loss, carry, stats

    return stack, step, params, x


def test_step_events_follow_the_seed_sequence_and_carry_the_numbers():
    passes = P.chain(P.statistics(), P.int8_fake_quant(), P.clip_by_norm(0.01), P.gaussian_noise(0.0))
    stack, step, params, x = _setup(passes)
    carry = jax.jit(stack.init)(params, x)
    bus = EventBus()
    bus.start_recording()
    loss, carry, stats = step(params, carry)
    loss, carry, stats = step(params, carry)
    assert bus.log == []  # nothing is emitted from inside the jitted step
    events = emit_step_events(bus, stack, stats, carry, loss=loss, lr=jnp.float32(0.1), run="a", hist=np.arange(2))
    assert events == bus.log
    types = [e.type for e in events]
    n_members = 4
    per_boundary = n_members + 1  # PassApplied per member + AdjointModified from statistics()
    expected = ["TrainStepStarted", "ForwardStarted", "ForwardFinished", "AdjointCreated"]
    expected += ["PassApplied", "AdjointModified"] + ["PassApplied"] * (n_members - 1)
    for _ in range(DEPTH):
        expected += ["BlockReconstructed", "PassApplied", "AdjointModified"] + ["PassApplied"] * (n_members - 1)
    expected += ["TrainStepFinished"]
    assert types == expected
    assert len(events) == 4 + (DEPTH + 1) * per_boundary + DEPTH + 1

    norms = np.asarray(stats["adjoint_norm"])
    after = np.asarray(stats["adjoint_norm_after_passes"])
    created = bus.events_of_type("AdjointCreated")[0].payload
    assert created["layer_id"] == DEPTH and created["grad_norm"] == pytest.approx(float(norms[DEPTH]))
    recon = bus.events_of_type("BlockReconstructed")
    assert [e.payload["block_index"] for e in recon] == [2, 1, 0]
    assert [e.payload["layer_id"] for e in recon] == [3, 2, 1]
    for e in recon:
        i = e.payload["block_index"]
        assert e.payload["grad_norm"] == pytest.approx(float(norms[i]), rel=1e-7)
        assert e.payload["grad_norm_after_passes"] == pytest.approx(float(after[i]), rel=1e-7)
        assert e.payload["step"] == 1
    # PassApplied payloads are the pass states at that boundary
    states = boundary_states(stack, stack.state(carry), DEPTH + 1)
    applied = bus.events_of_type("PassApplied")
    for e in applied:
        b, idx = e.payload["layer_id"], e.payload["pass_index"]
        assert e.payload["pass_name"] == passes.members[idx].name
        member_state = states[b][idx]
        if idx == 0:
            for key in ("mean", "std", "min", "max", "norm"):
                assert e.payload[key] == pytest.approx(float(getattr(member_state, key)), rel=1e-7)
            assert e.payload["numel"] == 2 * 4 * D and e.payload["has_nan"] is False
            # the statistics pass is first: it saw the raw adjoint
            assert e.payload["norm"] == pytest.approx(float(norms[b]), rel=1e-5)
        elif idx == 1:
            assert e.payload["scale"] == pytest.approx(float(member_state.scale))
        elif idx == 2:
            assert e.payload["clipped"] is True and e.payload["norm"] > 0.01
        else:
            assert set(e.payload) == {"pass_name", "pass_index", "layer_id", "block_index"}  # key left out
    modified = bus.events_of_type("AdjointModified")
    assert [e.payload["layer_id"] for e in modified] == [3, 2, 1, 0]
    finished = bus.events_of_type("TrainStepFinished")[0].payload
    assert finished == {"step": 1, "calls": 1.0, "loss": pytest.approx(float(loss)), "lr": pytest.approx(0.1),
                        "run": "a", "hist": [0, 1]}
    assert isinstance(finished["step"], int) and isinstance(finished["lr"], float)


def test_step_events_with_int_input_boundary_and_segments():
    """An embedding block takes int tokens: boundary 0 carries no adjoint and gets no pass events."""
    V = 13
    emb = jax.random.normal(jax.random.key(1), (V, D))
    w = jax.random.normal(jax.random.key(2), (DEPTH, D, D)) * 0.5
    tokens = jax.random.randint(jax.random.key(3), (2, 4), 0, V)

    def embed(p, toks):
        return p[toks]

    stack = eae_jax.reconstruct([embed, eae_jax.Scan(lambda p, h: _block({"w": p}, h), name="blocks")],
                                passes=P.int8_fake_quant())
    plist = [emb, w]
    carry = stack.init(plist, tokens)
    gc = jax.grad(lambda c: jnp.sum(stack(plist, tokens, c) ** 2))(carry)
    carry, stats = stack.update(carry, gc)
    bus = EventBus()
    events = emit_step_events(bus, stack, stats, carry)
    recon = [e.payload for e in events if e.type == "BlockReconstructed"]
    assert [p["block"] for p in recon] == ["blocks/2", "blocks/1", "blocks/0", "embed[0]"]
    assert recon[-1]["grad_norm"] is None and recon[0]["grad_norm"] > 0
    applied = [e.payload for e in events if e.type == "PassApplied"]
    assert sorted(p["layer_id"] for p in applied) == [1, 2, 3, 4]  # not boundary 0
    assert all(p["pass_name"] == "int8_fake_quant" and p["scale"] > 0 for p in applied)
    # int8_fake_quant alone (not a chain) was summarised above; a replay from the stats alone
    # (no pass state) gives the block events without pass events
    events = emit_step_events(EventBus(), stack, stats)
    assert not any(e.type == "PassApplied" for e in events)


def test_step_events_errors():
    stack, step, params, x = _setup(P.statistics())
    carry = stack.init(params, x)
    _, carry, stats = step(params, carry)
    with pytest.raises(KeyError, match="adjoint_norm"):
        emit_step_events(EventBus(), stack, {"step": 0, "calls": 1.0}, carry)
    with pytest.raises(ValueError, match="depths"):
        emit_step_events(EventBus(), stack, stats, carry, depths=[2])
    with pytest.raises(ValueError, match="stack.state"):
        boundary_states(stack, {"top": None}, DEPTH + 1)


def test_json_logging_one_object_per_line(caplog):
    stack, step, params, x = _setup(P.chain(P.statistics(), P.nonfinite_guard()))
    carry = stack.init(params, x)
    loss, carry, stats = step(params, carry)
    bus = EventBus()
    logger = logging.getLogger("eae_jax.events.test")
    handle = attach_json_logging(bus, logger=logger)
    with caplog.at_level(logging.INFO, logger="eae_jax.events.test"):
        events = emit_step_events(bus, stack, stats, carry, loss=loss)
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "eae_jax.events.test"]
    assert len(records) == len(events)
    assert [r["event"] for r in records] == [e.type for e in events]
    first_pass = next(r for r in records if r["event"] == "PassApplied")
    assert first_pass["pass_name"] == "statistics" and isinstance(first_pass["mean"], float)
    assert records[-1]["loss"] == pytest.approx(float(loss))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eae_jax.events.test"):
        bus.emit("PassApplied", arr=np.arange(3), value=np.float32(0.5), device=jnp.ones(2))
    (record,) = [json.loads(r.getMessage()) for r in caplog.records]
    assert record["arr"] == [0, 1, 2] and record["value"] == 0.5 and record["device"] == [1.0, 1.0]
    bus.unsubscribe("*", handle)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eae_jax.events.test"):
        bus.emit("PassApplied", arr=np.arange(3))
    assert not caplog.records


# ----------------------------------------------------------------------------- found by probing
def test_adjoint_modified_only_where_statistics_ran():
    """at_layers(statistics(), [-1]) reported zero statistics at every other boundary."""
    stack = eae_jax.reconstruct(lambda w, x: x + jnp.tanh(x @ w),
                                passes=P.chain(P.at_layers(P.statistics(), [-1]), P.clip_by_norm(10.0)))
    params, x = jnp.stack([jnp.eye(3) * 0.1] * 4), jnp.ones((2, 3))
    carry = stack.init(params, x, jax.random.key(0))
    carry, stats = stack.update(carry, jax.grad(lambda c: jnp.sum(stack(params, x, c)))(carry))
    events = emit_step_events(EventBus(), stack, stats, carry)
    modified = [e for e in events if e.type == EventType.ADJOINT_MODIFIED]
    assert [e.payload["layer_id"] for e in modified] == [4]
    np.testing.assert_allclose(modified[0].payload["norm"], float(stats["adjoint_norm"][4]), rtol=1e-5)
    applied = [e for e in events if e.type == EventType.PASS_APPLIED]
    assert len(applied) == 2 * 5  # PassApplied still at every boundary, for both passes


def test_summarize_state_keeps_bfloat16_fields():
    class S(NamedTuple):
        a: jax.Array
        b: jax.Array

    out = summarize_state(S(jnp.full((4,), 2.0, jnp.bfloat16), jnp.full((4,), 2.0, jnp.float16)))
    assert out == {"a_norm": 4.0, "b_norm": 4.0}
