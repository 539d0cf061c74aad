"""The train and held-out splits: disjoint voices, vocabularies and identity regions.

A held-out clip has an identity from `identity.HELDOUT_REGION` (training never draws there),
an espeak base voice and voice variant that no training clip uses, and words from the
held-out vocabulary (its nonsense phrases come from the same syllable inventory, drawn from
the held-out split's own seeds).
"""

from __future__ import annotations

import dataclasses

SPLITS = ("train", "heldout")


@dataclasses.dataclass(frozen=True)
class VoicePool:
    """espeak base voices (languages and accents) and voice variants ('' = the base voice's own)."""

    english: tuple[str, ...]
    other: tuple[str, ...]
    variants: tuple[str, ...]
    english_fraction: float = 0.5

    def voices(self) -> tuple[str, ...]:
        return self.english + self.other


VOICES = {
    "train": VoicePool(
        english=("en-us", "en", "en-gb-scotland", "en-029", "en-us-nyc"),
        other=("de", "fr", "es", "it", "pt-br", "nl", "pl", "sv", "da", "id", "sw", "af", "ca", "eo", "ms"),
        variants=("", "m1", "m2", "m3", "m4", "m6", "f1", "f2", "f3", "klatt", "klatt2", "klatt4", "klatt6",
                  "Andy", "linda", "steph", "travis", "edward")),
    "heldout": VoicePool(
        english=("en-gb-x-rp", "en-gb-x-gbclan"),
        other=("fr-be", "es-419", "pt", "cs", "fi", "hu", "ro", "tr", "hr", "et", "cy", "sk"),
        variants=("m5", "m7", "f4", "f5", "klatt3", "klatt5", "Annie", "michel")),
}


def split_id(split: str) -> int:
    """The split's number in the seed sequence of its clips."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: one of {', '.join(SPLITS)}")
    return SPLITS.index(split)
