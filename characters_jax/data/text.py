"""Generated texts for the speech: sentences from a word list and nonsense syllables.

Two disjoint vocabularies (`VOCABULARIES["train"]`, `VOCABULARIES["heldout"]`): held-out
clips speak words never spoken in training. Nonsense phrases come from a syllable
inventory (onsets, vowels, codas) that every Latin-script espeak voice can read.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """Words by role, for sentences of the form [det] [adj] noun verb [det] [adj] noun."""

    nouns: tuple[str, ...]
    verbs: tuple[str, ...]
    adjectives: tuple[str, ...]
    adverbs: tuple[str, ...]


def _words(s: str) -> tuple[str, ...]:
    return tuple(s.split())


VOCABULARIES = {
    "train": Vocabulary(
        nouns=_words("cat dog house river window garden table mother father teacher doctor city morning "
                     "music picture water paper letter market bridge forest mountain island kitchen train "
                     "station weather summer winter friend neighbour question answer story moon "
                     "bottle basket pocket jacket blanket candle orange lemon butter bread cheese"),
        verbs=_words("sees finds makes takes brings opens closes paints reads writes watches follows "
                     "carries builds cleans wants likes visits remembers forgets answers calls helps "
                     "moves pushes pulls keeps"),
        adjectives=_words("red green small big old young happy quiet busy yellow warm cold bright dark "
                          "little heavy simple early lovely gentle"),
        adverbs=_words("today again slowly quickly always never often later soon together")),
    "heldout": Vocabulary(
        nouns=_words("lantern harbour pilot violin tiger meadow cottage sailor pepper ribbon castle engine "
                     "parrot saddle thunder velvet wizard puzzle turnip anchor beacon canyon falcon goblet "
                     "hammock igloo jigsaw kettle lobster marble noodle oyster pebble quilt rocket"),
        verbs=_words("polishes juggles gathers borrows repairs admires chases unlocks delivers steers "
                     "whistles measures invents rescues hides"),
        adjectives=_words("purple silver curious ancient tiny fuzzy clumsy glossy frozen noble"),
        adverbs=_words("gladly barely yearly meanwhile nearby")),
}

ONSETS = _words("b d f g h k l m n p r s t v w z ch sh th br pl st tr kl")
VOWELS = _words("a e i o u a e o ai oo ee ou")
CODAS = ("",) * 6 + _words("n m s t k l r")


def sentence(rng: np.random.Generator, vocab: Vocabulary) -> str:
    """A short sentence with a capital and a final mark."""

    def pick(words):
        return words[int(rng.integers(len(words)))]

    def noun_phrase():
        out = []
        if rng.random() < 0.7:
            out.append(pick(("the", "a", "my", "your", "this", "that")))
        if rng.random() < 0.5:
            out.append(pick(vocab.adjectives))
        out.append(pick(vocab.nouns))
        return out

    words = noun_phrase() + [pick(vocab.verbs)] + noun_phrase()
    if rng.random() < 0.4:
        words.append(pick(vocab.adverbs))
    if rng.random() < 0.25:
        words += ["and"] + noun_phrase()
    text = " ".join(words)
    return text[0].upper() + text[1:] + pick((".", ".", ".", "?", "!"))


def nonsense(rng: np.random.Generator) -> str:
    """A phrase of 2..6 made-up words of 1..3 syllables."""

    def syllable():
        return ONSETS[int(rng.integers(len(ONSETS)))] + VOWELS[int(rng.integers(len(VOWELS)))] + \
            CODAS[int(rng.integers(len(CODAS)))]

    words = ["".join(syllable() for _ in range(int(rng.integers(1, 4)))) for _ in range(int(rng.integers(2, 7)))]
    if len(words) > 3 and rng.random() < 0.3:
        words[1] += ","
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def phrase(rng: np.random.Generator, vocab: Vocabulary, nonsense_fraction: float = 0.35) -> str:
    """A sentence, or with probability nonsense_fraction a nonsense phrase."""
    return nonsense(rng) if rng.random() < nonsense_fraction else sentence(rng, vocab)
