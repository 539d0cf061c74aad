"""The mouth box covers the pixels that the mouth's parameters change, at any head pose."""

import numpy as np
import pytest

from characters_jax.data.face import render_frames
from characters_jax.data.identity import sample_identity
from characters_jax.data.motion import DX, DY, JAW, TILT, WIDTH, still
from characters_jax.train.geometry import mouth_mask

SEED = 11


def _pair(rng, h, w, change):
    ident = sample_identity(rng).to_vector()
    base = still(2)
    base[:, DX], base[:, DY], base[:, TILT] = rng.uniform(-0.02, 0.02), rng.uniform(-0.02, 0.02), rng.uniform(-0.05, 0.05)
    base[:, JAW] = rng.uniform(0.2, 0.6)
    change(base)
    frames = render_frames(ident, base, h, w).astype(np.float32)
    diff = np.abs(frames[1] - frames[0]).max(-1)
    return diff, np.asarray(mouth_mask(ident, base, h, w)).max(0) > 0


@pytest.mark.parametrize("size", [(64, 96), (128, 192)])
def test_mouth_box_covers_what_the_mouth_changes(size):
    h, w = size
    rng = np.random.default_rng(SEED)
    for _ in range(3):
        # lip width: only the lips change
        diff, mask = _pair(rng, h, w, lambda p: p.__setitem__((slice(None), WIDTH), [0.0, 1.0]))
        changed = diff > 12
        assert changed.sum() > 5 and (changed & mask).sum() >= 0.95 * changed.sum()
        assert mask.mean() < 0.08  # a box around the mouth, not the face
        # the jaw: the chin's outline moves too, but the largest changes are the mouth's
        diff, mask = _pair(rng, h, w, lambda p: p.__setitem__((1, JAW), 0.95))
        top = np.argsort(diff.ravel())[-20:]
        assert mask.ravel()[top].mean() >= 0.9
