import jax
import jax.numpy as jnp
import numpy as np
import pytest

from characters_jax.model.rope import apply_rope, rope_frequencies

FREQS = rope_frequencies(16, (4, 2, 2), 10000.0)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_delta_rotation_equals_fresh_rotation(axis):
    """rope(rope(k, p), -R on one axis) == rope(k, p - R) for each of the three axes."""
    key = jax.random.key(axis)
    k = jax.random.normal(key, (50, 3, 16), jnp.float32)
    p = jax.random.randint(jax.random.key(10 + axis), (50, 3), 40, 90)
    delta = np.zeros(3, np.int32)
    delta[axis] = -42
    once = apply_rope(apply_rope(k, p, FREQS), jnp.broadcast_to(delta, (50, 3)), FREQS)
    fresh = apply_rope(k, p + delta, FREQS)
    np.testing.assert_allclose(once, fresh, rtol=1e-4, atol=1e-4)
    # and the rotation really moved something on that axis
    assert float(jnp.abs(apply_rope(k, p, FREQS) - fresh).max()) > 1e-2


def test_rotation_keeps_pair_norms_and_relative_scores():
    q = jax.random.normal(jax.random.key(0), (1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 16))
    pq, pk = jnp.array([[7, 2, 3]]), jnp.array([[3, 1, 1]])
    s1 = jnp.sum(apply_rope(q, pq, FREQS) * apply_rope(k, pk, FREQS))
    s2 = jnp.sum(apply_rope(q, pq + 42, FREQS) * apply_rope(k, pk + 42, FREQS))
    np.testing.assert_allclose(s1, s2, rtol=1e-4)
    np.testing.assert_allclose(jnp.linalg.norm(apply_rope(k, pk, FREQS)), jnp.linalg.norm(k), rtol=1e-5)
