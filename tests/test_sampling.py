"""eae_jax.models.sampling against a float64 numpy reference of the same rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax.models.sampling import Sampling, sample_tokens, sampling_probs, top_k_mask, top_p_mask


def reference_probs(logits, temperature, top_k=None, top_p=None):
    """The documented rules, written out in float64 numpy."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    scaled = logits / temperature
    keep = np.ones(scaled.shape, bool)
    if top_k is not None:
        keep[:] = False
        keep[np.argsort(-scaled, kind="stable")[:top_k]] = True
    probs = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    probs /= probs.sum()
    if top_p is not None:
        mass, chosen = 0.0, []
        for i in np.argsort(-probs, kind="stable"):
            if mass >= top_p:
                break
            chosen.append(i)
            mass += probs[i]
        keep = np.zeros(probs.shape, bool)
        keep[chosen] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0, top_k=5),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=0.8, top_k=10, top_p=0.9),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.0),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_distribution_matches_the_numpy_reference(setting):
    logits = np.asarray(jax.random.normal(jax.random.key(3), (4, 50))) * 3.0
    got = np.asarray(sampling_probs(jnp.asarray(logits, jnp.float32), Sampling(**setting)))
    for row, want_logits in zip(got, logits):
        want = reference_probs(want_logits, **setting)
        np.testing.assert_allclose(row, want, atol=2e-6)
        assert set(np.flatnonzero(row)) == set(np.flatnonzero(want))


def test_draws_follow_the_distribution():
    logits = jnp.log(jnp.array([0.30, 0.05, 0.25, 0.15, 0.20, 0.05]))
    sampling = Sampling(temperature=1.0, top_k=4, top_p=0.7)
    want = reference_probs(np.asarray(logits), 1.0, 4, 0.7)
    n = 20000
    keys = jax.random.split(jax.random.key(11), n)
    draws = np.asarray(jax.vmap(lambda k: sample_tokens(k, logits, sampling))(keys))
    freq = np.bincount(draws, minlength=6) / n
    assert set(np.flatnonzero(freq)) == set(np.flatnonzero(want)) == {0, 2, 4}
    sigma = np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-12), (freq, want)


def test_top_k_one_is_greedy_ties_included():
    logits = jax.random.normal(jax.random.key(0), (64, 20))
    logits = logits.at[:, 7].set(9.0).at[::2, 3].set(9.0)   # even rows: a tie between ids 3 and 7
    greedy = sample_tokens(None, logits, Sampling(temperature=0.0))
    for seed in range(3):
        sampled = sample_tokens(jax.random.key(seed), logits, Sampling(temperature=1.5, top_k=1))
        np.testing.assert_array_equal(sampled, greedy)
    assert greedy[0] == 3 and greedy[1] == 7                  # argmax: the lowest tied id


def test_top_k_keeps_exactly_k_with_ties():
    logits = jnp.array([2.0, 5.0, 5.0, 5.0, 1.0])
    assert top_k_mask(logits, 2).tolist() == [False, True, True, False, False]
    assert top_k_mask(logits, 4).tolist() == [True, True, True, True, False]
    assert top_k_mask(logits, 99).tolist() == [True] * 5


def test_top_p_boundary_at_equality():
    probs = jnp.array([0.125, 0.5, 0.25, 0.0625, 0.0625])    # exact in binary
    assert top_p_mask(probs, 0.5).tolist() == [False, True, False, False, False]
    assert top_p_mask(probs, 0.75).tolist() == [False, True, True, False, False]
    above = float(np.nextafter(np.float32(0.75), np.float32(1.0)))
    assert top_p_mask(probs, above).tolist() == [True, True, True, False, False]
    assert top_p_mask(probs, 1.0).tolist() == [True, True, True, True, True]
    assert top_p_mask(probs, 1e-9).tolist() == [False, True, False, False, False]   # the top id is always kept


def test_same_key_same_draws_other_keys_differ():
    logits = jax.random.normal(jax.random.key(1), (200, 30))
    sampling = Sampling(temperature=1.0, top_p=0.95)
    a = sample_tokens(jax.random.key(5), logits, sampling)
    b = sample_tokens(jax.random.key(5), logits, sampling)
    c = sample_tokens(jax.random.key(6), logits, sampling)
    np.testing.assert_array_equal(a, b)
    assert np.mean(np.asarray(a) != np.asarray(c)) > 0.3


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=True),
                                 dict(top_k=0), dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_p=float("nan"))])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Sampling(**bad)


def test_no_filtered_distribution_when_greedy():
    from eae_jax.models.sampling import filtered_logits

    with pytest.raises(ValueError, match="greedy"):
        filtered_logits(jnp.zeros(4), Sampling(temperature=0))
