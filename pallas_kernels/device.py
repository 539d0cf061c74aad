"""What the first device of the default backend is, for the kernels' dispatchers.

Every kernel that needs particular hardware asks here: the Mosaic GPU kernels (wgmma,
TMA) run on Hopper, sm_90 exactly (a later architecture has other instructions: it gets
the portable fallback, not a kernel built for sm_90); the Triton FP8 kernels need an
NVIDIA GPU of compute capability 8.9 or later (the e4m3 conversion).
"""

from __future__ import annotations

import jax

# SMs of an H100 / H200 SXM: the persistent grids' size where the device does not say.
DEFAULT_SM_COUNT = 132


def _first_device():
    try:
        return jax.devices()[0]
    except RuntimeError:
        return None


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first device if it is an NVIDIA GPU, else None."""
    dev = _first_device()
    if dev is None or dev.platform != "gpu":
        return None
    cc = getattr(dev, "compute_capability", None)
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except (TypeError, ValueError):
        return None


def is_nvidia_gpu() -> bool:
    """Whether the first device is an NVIDIA GPU (one with a compute capability)."""
    return compute_capability() is not None


def is_hopper() -> bool:
    """Whether the first device is an NVIDIA Hopper GPU: sm_90, exactly."""
    return compute_capability() == (9, 0)


def has_fp8_conversion() -> bool:
    """Whether the first device is an NVIDIA GPU with the e4m3 conversion (sm_89 or later)."""
    cc = compute_capability()
    return cc is not None and cc >= (8, 9)


def sm_count() -> int:
    """SMs of the first device (the persistent grids' size); DEFAULT_SM_COUNT if unknown."""
    return getattr(_first_device(), "core_count", DEFAULT_SM_COUNT)
