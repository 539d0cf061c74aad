"""Clips, splits, shards, the `data` command and the demo assets (characters_jax.data)."""

import json
import wave

import numpy as np
import pytest

pytest.importorskip("espeakng_loader")

from characters_jax.audio.timeline import Timeline  # noqa: E402
from characters_jax.cli import main as cli_main  # noqa: E402
from characters_jax.data import text  # noqa: E402
from characters_jax.data.clips import ClipSpec, plan_clip, portrait, write_demo_assets  # noqa: E402
from characters_jax.data.identity import HELDOUT_REGION, Identity  # noqa: E402
from characters_jax.data.shards import ShardReader, write_shards  # noqa: E402
from characters_jax.data.speech import EspeakVoice  # noqa: E402
from characters_jax.data.splits import VOICES  # noqa: E402

SEED = 11
SPEC = ClipSpec(seconds=2.0, height=32, width=48)


@pytest.fixture(scope="module")
def voice():
    with EspeakVoice() as v:
        yield v


def test_clip_lengths_follow_the_timeline():
    tl = Timeline(16000, 24, 4)
    for seconds in (0.1, 1.0, 2.0, 4.0, 3.33):
        spec = ClipSpec(seconds=seconds)
        t = spec.num_frames
        assert t % 4 == 0 and t >= seconds * 24 - 1e-9 and t < seconds * 24 + 4
        assert spec.num_samples == tl.frame_start(t) == t * 16000 // 24
        assert tl.frames_for(spec.num_samples) == t
    with pytest.raises(ValueError, match="positive"):
        ClipSpec(seconds=0)


def test_a_plan_has_speech_and_silence_and_consistent_arrays(voice):
    plan = plan_clip("train", 0, SPEC, SEED, voice)
    t, n = SPEC.num_frames, SPEC.num_samples
    assert plan.audio.shape == (n,) and plan.audio.dtype == np.int16
    assert plan.track.shape == (t, 2) and plan.track.dtype == np.float32
    assert plan.params.shape == (t, 6) and plan.params.dtype == np.float32
    np.testing.assert_array_equal(plan.params[:, :2], plan.track)
    assert plan.phonemes and all(0 <= p.start < p.end <= n / 16000 + 1e-9 for p in plan.phonemes)
    speaking = np.zeros(n, bool)
    for a, b in plan.meta["speech_spans_s"]:
        speaking[int(a * 16000):int(b * 16000)] = True
    assert speaking.any() and (~speaking).mean() > 0.05  # speech and silence
    x = plan.audio.astype(np.float64)
    assert np.sqrt((x[speaking] ** 2).mean()) > 5 * np.sqrt((x[~speaking] ** 2).mean())
    json.dumps(plan.meta)


def test_same_seed_same_bytes_other_seed_other_clip(voice):
    a = plan_clip("heldout", 3, SPEC, SEED, voice)
    b = plan_clip("heldout", 3, SPEC, SEED, voice)
    for x, y in ((a.audio, b.audio), (a.track, b.track), (a.params, b.params), (a.identity, b.identity)):
        assert x.tobytes() == y.tobytes()
    assert a.meta == b.meta and a.phonemes == b.phonemes
    c = plan_clip("heldout", 3, SPEC, SEED + 1, voice)
    assert c.audio.tobytes() != a.audio.tobytes() and c.identity.tobytes() != a.identity.tobytes()


def test_splits_are_disjoint(voice):
    vocab = {s: set(sum((list(getattr(text.VOCABULARIES[s], f)) for f in ("nouns", "verbs", "adjectives", "adverbs")),
                        [])) for s in ("train", "heldout")}
    assert not vocab["train"] & vocab["heldout"]
    assert not set(VOICES["train"].voices()) & set(VOICES["heldout"].voices())
    assert not set(VOICES["train"].variants) & set(VOICES["heldout"].variants)
    spec = ClipSpec(seconds=0.5, height=16, width=24)
    for split in ("train", "heldout"):
        for i in range(6):
            plan = plan_clip(split, i, spec, SEED, voice)
            base, _, variant = plan.meta["voice"].partition("+")
            assert base in VOICES[split].voices() and variant in VOICES[split].variants + ("",)
            assert HELDOUT_REGION.contains(Identity.from_vector(plan.identity)) == (split == "heldout")
            words = {w.strip(".,?!").lower() for t in plan.meta["texts"] for w in t.split()}
            other = "heldout" if split == "train" else "train"
            assert not words & vocab[other]


def test_shards_round_trip_and_do_not_depend_on_the_workers(tmp_path, capsys):
    """The API with one worker and the `data` command with two write the same bytes."""
    one = write_shards(tmp_path / "one", "train", 3, SPEC, seed=SEED, workers=1, shard_size=2, progress=False)
    code = cli_main(["data", "--split", "train", "--clips", "3", "--out", str(tmp_path / "two"),
                     *(a for kv in (f"seconds={SPEC.seconds}", f"height={SPEC.height}", f"width={SPEC.width}", "workers=2",
                                    "shard_size=2", f"seed={SEED}", "quiet=true") for a in ("--set", f"data.{kv}"))])
    assert code == 0 and "wrote 3 clips" in capsys.readouterr().out
    assert [s["clips"] for s in one["shards"]] == [2, 1]
    for s in one["shards"]:
        assert (tmp_path / "one" / s["file"]).read_bytes() == (tmp_path / "two" / s["file"]).read_bytes()
    reader = ShardReader(tmp_path / "one")
    assert len(reader) == 3 and reader.num_shards == 2
    clips = list(reader)
    assert [c.plan.index for c in clips] == [0, 1, 2]
    c = reader.clip(2)
    assert c.frames.shape == (SPEC.num_frames, SPEC.height, SPEC.width, 3) and c.frames.dtype == np.uint8
    plan = plan_clip("train", 2, SPEC, SEED)
    assert c.plan.audio.tobytes() == plan.audio.tobytes() and c.plan.meta["texts"] == plan.meta["texts"]
    assert [p.symbol for p in c.plan.phonemes] == [p.symbol for p in plan.phonemes]
    with pytest.raises(IndexError):
        reader.clip(3)
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        ShardReader(tmp_path)


def test_the_data_command_rejects_bad_arguments(tmp_path, capsys):
    assert cli_main(["data", "--clips", "2", "--set", "data.seconds=-1", "--out", str(tmp_path)]) == 2
    assert "data: seconds must be positive" in capsys.readouterr().err
    assert cli_main(["data", "--set", "data.seconds=1"]) == 2
    assert "--out is required" in capsys.readouterr().err
    assert cli_main(["data", "--set", "data.second=1", "--out", str(tmp_path)]) == 2
    assert "data.second: unknown key" in capsys.readouterr().err


def test_demo_assets(tmp_path):
    from PIL import Image

    png, wav = write_demo_assets(tmp_path, index=1, seed=SEED, spec=SPEC)
    img = np.asarray(Image.open(png))
    plan = plan_clip("heldout", 1, SPEC, SEED)
    assert img.shape == (SPEC.height, SPEC.width, 3)
    np.testing.assert_array_equal(img, portrait(plan, SPEC.height, SPEC.width))
    with wave.open(wav) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        audio = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    np.testing.assert_array_equal(audio, plan.audio)
