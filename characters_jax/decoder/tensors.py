"""float32 arrays <-> the `Tensor` proto (shape + little-endian bytes)."""

from __future__ import annotations

import numpy as np

from characters_jax.protos_gen import decoder_pb2


def tensor_to_proto(x) -> decoder_pb2.Tensor:
    a = np.ascontiguousarray(np.asarray(x, dtype="<f4"))
    return decoder_pb2.Tensor(shape=list(a.shape), data=a.tobytes())


def tensor_from_proto(t: decoder_pb2.Tensor, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Raises ValueError when the bytes do not match the shape, or the shape is not `expected_shape`."""
    shape = tuple(int(s) for s in t.shape)
    if expected_shape is not None and shape != tuple(expected_shape):
        raise ValueError(f"expected shape {tuple(expected_shape)}, got {shape}")
    n = int(np.prod(shape)) if shape else 1
    if len(t.data) != 4 * n:
        raise ValueError(f"{len(t.data)} bytes do not hold float32 {shape}")
    return np.frombuffer(t.data, dtype="<f4").reshape(shape).astype(np.float32)
