"""Arrays <-> the `Tensor` proto (shape + little-endian bytes; float32, or the dtype it names)."""

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


def array_to_proto(x) -> decoder_pb2.Tensor:
    """Any numpy dtype (its name in `dtype`, "" for float32) -> Tensor, little-endian."""
    a = np.asarray(x)
    name = "" if a.dtype == np.float32 else a.dtype.name
    return decoder_pb2.Tensor(shape=list(a.shape), data=np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"))).tobytes(), dtype=name)


def array_from_proto(t: decoder_pb2.Tensor) -> np.ndarray:
    """Tensor -> numpy array of its dtype. Raises ValueError for an unknown dtype or bytes
    that do not hold the shape."""
    dtype = dtype_of(t.dtype or "float32").newbyteorder("<")
    shape = tuple(int(s) for s in t.shape)
    n = int(np.prod(shape)) if shape else 1
    if len(t.data) != dtype.itemsize * n:
        raise ValueError(f"{len(t.data)} bytes do not hold {dtype.name} {shape}")
    return np.frombuffer(t.data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def dtype_of(name: str) -> np.dtype:
    """The numpy dtype of a name: numpy's own, or ml_dtypes' (bfloat16, float8_e4m3fn, ...).
    Raises ValueError for an unknown name."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        found = getattr(ml_dtypes, name, None)
        if found is None:
            raise ValueError(f"unknown dtype {name!r}") from None
        return np.dtype(found)
