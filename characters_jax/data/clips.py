"""Clips: speech, its mouth track and a face speaking it, deterministic from (split, index, seed).

A clip of T frames (T a multiple of the 4-frame chunk) carries exactly frame_start(T) =
floor(T * 16000 / 24) audio samples, frame k carrying [frame_start(k), frame_start(k + 1))
as in `characters_jax.audio.timeline`. Its speech is a few phrases in one voice, with
silence before, between and after them; the mouth track follows the phonemes causally
(`visemes`); blinks and head motion are independent of the speech (`motion`).

`plan_clip` does everything but the pixels (numpy and espeak-ng, no jax: it runs in worker
processes); `render_plans` draws the frames with the jax renderer; `make_clip` does both.
"""

from __future__ import annotations

import dataclasses
import io
import wave

import numpy as np

from characters_jax.data import identity as identity_lib
from characters_jax.data import motion, text, visemes
from characters_jax.data.speech import SAMPLE_RATE, EspeakVoice, Phoneme, Utterance
from characters_jax.data.splits import VOICES, split_id


@dataclasses.dataclass(frozen=True)
class ClipSpec:
    """Size of a clip: seconds is rounded up to whole chunks."""

    seconds: float = 4.0
    height: int = 64
    width: int = 96
    fps: int = 24
    sample_rate: int = SAMPLE_RATE
    chunk_frames: int = 4

    def __post_init__(self):
        if not self.seconds > 0:
            raise ValueError(f"seconds must be positive, got {self.seconds}")
        if self.height < 8 or self.width < 8:
            raise ValueError(f"frames must be at least 8x8, got {self.height}x{self.width}")
        if self.sample_rate != SAMPLE_RATE:
            raise ValueError(f"the speech is {SAMPLE_RATE} Hz, got sample_rate={self.sample_rate}")

    @property
    def num_frames(self) -> int:
        return -(-round(self.seconds * self.fps * 1000) // (1000 * self.chunk_frames)) * self.chunk_frames

    def frame_start(self, k: int) -> int:
        """First audio sample of frame k."""
        return k * self.sample_rate // self.fps

    @property
    def num_samples(self) -> int:
        return self.frame_start(self.num_frames)


@dataclasses.dataclass(frozen=True)
class ClipPlan:
    """A clip without its pixels.

    audio: int16 [N]; phonemes: in clip time (seconds); track: float32 [T, 2] (jaw, width);
    identity: float32 [IDENTITY_SIZE]; params: float32 [T, FRAME_PARAMS] (track, blinks, head);
    meta: voice, texts, speech spans and the draw's settings (JSON-serialisable).
    """

    split: str
    index: int
    seed: int
    audio: np.ndarray
    phonemes: tuple[Phoneme, ...]
    track: np.ndarray
    identity: np.ndarray
    params: np.ndarray
    meta: dict


@dataclasses.dataclass(frozen=True)
class Clip:
    """A plan and its frames: uint8 [T, H, W, 3]."""

    plan: ClipPlan
    frames: np.ndarray


def _voice(rng: np.random.Generator, split: str) -> str:
    pool = VOICES[split]
    names = pool.english if rng.random() < pool.english_fraction else pool.other
    base = names[int(rng.integers(len(names)))]
    variant = pool.variants[int(rng.integers(len(pool.variants)))]
    return base + ("+" + variant if variant else "")


def _utterances(rng: np.random.Generator, split: str, seconds: float) -> tuple[list[Utterance], dict]:
    """Enough phrases in one voice to fill `seconds`, and the voice's settings."""
    settings = {"voice": _voice(rng, split), "rate": int(rng.integers(130, 211)), "pitch": int(rng.integers(25, 76)),
                "pitch_range": int(rng.integers(30, 91)), "volume": int(rng.integers(70, 131))}
    vocab = text.VOCABULARIES[split]
    count = int(np.ceil(seconds / 1.0)) + 1
    out = []
    for _ in range(count):
        out.append(Utterance(text.phrase(rng, vocab), settings["voice"],
                             rate=int(np.clip(settings["rate"] + rng.integers(-15, 16), 80, 450)),
                             pitch=int(np.clip(settings["pitch"] + rng.integers(-6, 7), 0, 100)),
                             pitch_range=settings["pitch_range"], volume=settings["volume"],
                             noise_seed=int(rng.integers(1 << 31))))
    return out, settings


def plan_clip(split: str, index: int, spec: ClipSpec, seed: int = 0, voice: EspeakVoice | None = None) -> ClipPlan:
    """The clip's audio, phonemes, track, identity and frame parameters (espeak-ng, no rendering).
    Without a voice, one for this call (EspeakVoice.for_this_process: cheap in a data worker;
    pass one to make many plans in a process with jax)."""
    streams = np.random.SeedSequence([int(seed), split_id(split), int(index)]).spawn(4)
    rng_id, rng_speech, rng_motion, rng_noise = (np.random.default_rng(s) for s in streams)
    ident = identity_lib.sample_identity(rng_id, heldout=split == "heldout")

    seconds = spec.num_frames / spec.fps
    utterances, settings = _utterances(rng_speech, split, seconds)
    if voice is None:
        with EspeakVoice.for_this_process() as own:
            speeches = own.say(utterances)
    else:
        speeches = voice.say(utterances)

    n = spec.num_samples
    audio = np.zeros(n, np.float64)
    phonemes: list[Phoneme] = []
    spans, texts = [], []
    t = rng_speech.uniform(0.0, 0.6)
    for utt, sp in zip(utterances, speeches):
        start = int(round(t * SAMPLE_RATE))
        if start >= n:
            break
        seg = sp.audio[: n - start].astype(np.float64)
        audio[start:start + len(seg)] = seg
        offset = start / SAMPLE_RATE
        limit = n / SAMPLE_RATE
        phonemes += [Phoneme(p.symbol, p.start + offset, min(p.end + offset, limit)) for p in sp.phonemes
                     if p.start + offset < limit]
        spans.append([offset, min(offset + sp.seconds, limit)])
        texts.append(utt.text)
        t = offset + sp.seconds + rng_speech.uniform(0.15, 1.0)
    floor_db = rng_noise.uniform(-68.0, -50.0)
    audio += rng_noise.normal(0.0, 32768.0 * 10 ** (floor_db / 20), n)
    audio_i16 = np.clip(np.rint(audio), -32768, 32767).astype(np.int16)

    jaw_scale = float(rng_motion.uniform(0.8, 1.15))
    track = visemes.mouth_track(phonemes, spec.num_frames, spec.fps, jaw_scale=jaw_scale)
    params = motion.frame_params(track, motion.blinks(rng_motion, spec.num_frames, spec.fps),
                                 motion.head_motion(rng_motion, spec.num_frames, spec.fps))
    meta = {**settings, "texts": texts, "speech_spans_s": spans, "jaw_scale": jaw_scale,
            "noise_floor_db": float(floor_db)}
    return ClipPlan(split, int(index), int(seed), audio_i16, tuple(phonemes), track, ident.to_vector(), params, meta)


def render_plans(plans: list[ClipPlan], height: int, width: int) -> list[Clip]:
    """The plans' frames (jax renderer; plans of one length are drawn in one batch)."""
    from characters_jax.data.face import render_batch

    if not plans:
        return []
    if len({p.params.shape for p in plans}) != 1:
        return [c for p in plans for c in render_plans([p], height, width)]
    frames = render_batch(np.stack([p.identity for p in plans]), np.stack([p.params for p in plans]), height, width)
    return [Clip(p, f) for p, f in zip(plans, frames)]


def make_clip(split: str, index: int, spec: ClipSpec, seed: int = 0, voice: EspeakVoice | None = None) -> Clip:
    """A whole clip: plan_clip, then render_plans."""
    return render_plans([plan_clip(split, index, spec, seed, voice)], spec.height, spec.width)[0]


def portrait(plan: ClipPlan, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3]: the plan's first frame with the mouth closed (the reference image)."""
    return reference_image(plan.identity, plan.params, height, width)


def reference_image(identity: np.ndarray, params: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3]: a clip's reference image from its identity [IDENTITY_SIZE] and frame
    parameters [T, FRAME_PARAMS]: frame 0's head pose, mouth closed and neutral, eyes open."""
    from characters_jax.data.face import render_frames

    return render_frames(identity, motion.still_params(np.asarray(params[:1], np.float32), 1), height, width)[0]


def wav_bytes(audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A mono s16le WAV file of int16 audio [N]."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(np.asarray(audio, "<i2").tobytes())
    return buf.getvalue()


def write_demo_assets(out_dir, index: int = 0, seed: int = 0, spec: ClipSpec = ClipSpec(),
                      split: str = "heldout") -> tuple[str, str]:
    """Writes a held-out clip's portrait (PNG, first frame, mouth closed) and speech (WAV).
    Returns (png path, wav path)."""
    import pathlib

    from PIL import Image

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_clip(split, index, spec, seed)
    png, wav = out / f"{split}-{index:05d}-portrait.png", out / f"{split}-{index:05d}-speech.wav"
    Image.fromarray(portrait(plan, spec.height, spec.width)).save(png)
    wav.write_bytes(wav_bytes(plan.audio))
    return str(png), str(wav)
