"""Integer bookkeeping that ties audio samples to video frames and generator steps.

Frame k (k = 0, 1, ...) carries the samples [frame_start(k), frame_start(k + 1)) with
frame_start(k) = floor(k * sample_rate / fps): exact integers, no drift however long the
session. Step s produces frames [s * frames_per_step, (s + 1) * frames_per_step).
"""

from __future__ import annotations

import dataclasses

from characters_jax.config import Config


@dataclasses.dataclass(frozen=True)
class Timeline:
    sample_rate: int  # Hz
    fps: int
    frames_per_step: int

    @classmethod
    def from_config(cls, cfg: Config) -> "Timeline":
        return cls(cfg.audio.sample_rate, cfg.video.fps, cfg.video.frames_per_step)

    def frame_start(self, k: int) -> int:
        """First sample carried by frame k."""
        return k * self.sample_rate // self.fps

    def step_span(self, s: int) -> tuple[int, int]:
        """[start, end) samples carried by step s's frames."""
        f = self.frames_per_step
        return self.frame_start(s * f), self.frame_start((s + 1) * f)

    def frames_for(self, num_samples: int) -> int:
        """Frames needed to carry num_samples samples: the smallest F with frame_start(F) >= n."""
        return -(-num_samples * self.fps // self.sample_rate)

    def steps_for(self, num_samples: int) -> int:
        """Steps needed to carry num_samples samples."""
        return -(-self.frames_for(num_samples) // self.frames_per_step)

    @property
    def max_step_samples(self) -> int:
        return -(-self.frames_per_step * self.sample_rate // self.fps)

    def frame_time(self, k: int) -> float:
        """Presentation time of frame k, seconds from the start of the audio."""
        return k / self.fps

    @property
    def step_seconds(self) -> float:
        return self.frames_per_step / self.fps
