"""The cartoon face renderer (characters_jax.data.face) and its parameters (identity, motion)."""

import numpy as np
import pytest

from characters_jax.data import face, motion
from characters_jax.data.identity import HELDOUT_REGION, IDENTITY_SIZE, Identity, sample_identity

SEED = 3


def _identity(seed=SEED, heldout=False):
    return sample_identity(np.random.default_rng(seed), heldout=heldout).to_vector()


T = 6  # frames per render in these tests: one compiled program per frame size


def _poses(**cols):
    """T frames at rest, with the given columns set on the first frames (the rest repeat the last)."""
    p = motion.still(T)
    for name, values in cols.items():
        values = np.asarray(values, np.float32)
        p[:, getattr(motion, name.upper())] = np.concatenate([values, np.repeat(values[-1:], T - len(values))])
    return p


def test_shapes_dtype_and_sizes():
    ident = _identity()
    p = _poses(jaw=[0.0, 0.5, 1.0])
    for h, w in ((128, 192), (37, 53)):  # any size and aspect
        f = face.render_frames(ident, p, h, w)
        assert f.shape == (T, h, w, 3) and f.dtype == np.uint8
        assert f.std() > 20  # a face on a background, not a flat image
    b = face.render_batch(np.stack([ident, _identity(SEED + 1)]), np.stack([p, p]), 128, 192)
    assert b.shape == (2, T, 128, 192, 3)
    np.testing.assert_array_equal(b[0], face.render_frames(ident, p, 128, 192))


def test_same_inputs_same_bytes():
    ident, p = _identity(), _poses(jaw=np.linspace(0, 1, T), blink=np.linspace(0, 1, T))
    first = face.render_frames(ident, p, 128, 192)
    assert first.tobytes() == face.render_frames(ident.copy(), p.copy(), 128, 192).tobytes()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_jaw_opening_opens_the_mouth(seed):
    """More jaw opening changes more of the lower face from the closed mouth, for several
    identities, and nothing above it."""
    ident = _identity(seed)
    h, w = 128, 192
    frames = face.render_frames(ident, _poses(jaw=np.linspace(0, 1, T)), h, w).astype(np.int32)
    changed = np.abs(frames - frames[:1]).sum(-1) > 24
    area = changed.sum(axis=(1, 2))
    assert np.all(np.diff(area) > 0) and area[-1] > 150
    rows = np.nonzero(changed.any(axis=(0, 2)))[0]
    assert rows.min() > 0.53 * h  # the eyes and everything above stay


def test_blinks_close_the_eyes_only():
    h, w = 128, 192
    frames = face.render_frames(_identity(), _poses(blink=[0.0, 1.0]), h, w)[:2]
    diff = np.abs(frames[0].astype(int) - frames[1].astype(int)).sum(-1) > 0
    rows = np.nonzero(diff.any(1))[0]
    assert diff.sum() > 20
    assert rows.min() > 0.3 * h and rows.max() < 0.55 * h  # the eyes' band, not the mouth


def test_head_motion_moves_the_head_not_the_background():
    h, w = 128, 192
    frames = face.render_frames(_identity(), _poses(dx=[0.0, 0.03]), h, w)[:2]
    diff = np.abs(frames[0].astype(int) - frames[1].astype(int)).sum(-1) > 8
    assert diff.sum() > 100
    assert not diff[:, :int(0.2 * w)].any() and not diff[:, int(0.8 * w):].any()


def test_the_ellipse_distance_matches_a_float64_reference_near_the_edge():
    """The approximate signed distance against the exact one (dense boundary samples, float64) on
    fresh random points within two pixels of the edge: error under a tenth of a pixel at 128 px."""
    rng = np.random.default_rng(SEED)
    rx, ry = 0.23, 0.30
    theta = np.linspace(0, 2 * np.pi, 50001)
    boundary = np.stack([rx * np.cos(theta), ry * np.sin(theta)], 1)
    ang = rng.uniform(0, 2 * np.pi, 200)
    scale = 1 + rng.uniform(-2, 2, 200) / (128 * ry)
    pts = np.stack([rx * np.cos(ang) * scale, ry * np.sin(ang) * scale], 1)
    exact = np.sqrt(((pts[:, None] - boundary[None]) ** 2).sum(-1)).min(1)
    inside = (pts[:, 0] / rx) ** 2 + (pts[:, 1] / ry) ** 2 < 1
    exact = np.where(inside, -exact, exact)
    approx = np.asarray(face._ellipse(pts[:, 0].astype(np.float32), pts[:, 1].astype(np.float32), rx, ry))
    px = 1 / face.layout_unit(128, 192)
    assert np.abs(approx - exact).max() < 0.1 * px


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="identity"):
        face.render_frames(np.zeros(5, np.float32), motion.still(T), 128, 192)
    with pytest.raises(ValueError, match="at least 8x8"):
        face.render_frames(_identity(), motion.still(T), 4, 96)


def test_identity_vector_round_trip_and_the_heldout_region():
    rng = np.random.default_rng(SEED)
    train = [sample_identity(rng) for _ in range(300)]
    held = [sample_identity(rng, heldout=True) for _ in range(60)]
    assert not any(HELDOUT_REGION.contains(i) for i in train)
    assert all(HELDOUT_REGION.contains(i) for i in held)
    for ident in train[:5] + held[:5]:
        v = ident.to_vector()
        assert v.shape == (IDENTITY_SIZE,) and v.dtype == np.float32
        np.testing.assert_allclose(Identity.from_vector(v).to_vector(), v)
    # the region is a small part of identity space: training covers the rest of each axis
    assert any(HELDOUT_REGION.clothes_hue[0] <= face_hue(i) < HELDOUT_REGION.clothes_hue[1] for i in train)


def face_hue(ident):
    from characters_jax.data.identity import hue

    return hue(ident.colours["clothes"])


def test_blinks_and_head_motion_are_natural():
    rng = np.random.default_rng(SEED)
    fps, frames = 24, 24 * 60
    blink = motion.blinks(rng, frames, fps)
    starts = np.nonzero((blink[1:] > 0.5) & (blink[:-1] <= 0.5))[0]
    assert 8 <= len(starts) <= 35  # 8..35 blinks a minute
    assert blink.min() == 0.0 and blink.max() <= 1.0
    head = motion.head_motion(rng, frames, fps)
    assert np.abs(head[:, :2]).max() < 0.03 and np.abs(head[:, 2]).max() < 0.05
    assert np.abs(np.diff(head[:, 0])).max() < 0.002  # smooth: well under a pixel per frame at 128 px
