"""Reference images under mutation: every outcome is an image of the right shape or an
ImageError with a clean message, never another exception, and through the worker only OK or
INVALID_ARGUMENT (never UNKNOWN), the worker healthy afterwards.

The corpus: valid PNG (split IDAT, RGBA, palette with transparency, 16-bit grey, interlaced
with text, APNG), JPEG (baseline, progressive, grey) and WebP (lossy, lossless, animated),
mutated with a fixed seed by bit flips, byte runs, truncation, insertion and deletion, chunk
and segment corruption (PNG chunks with and without a fixed CRC, JPEG marker segments, WebP
RIFF chunks), header dimensions, splices of two files, and header swaps to TIFF, DDS, BMP,
GIF, EPS, PSD and ICO magic. The two reported reproductions (a PNG with a broken chunk, a
DDS file) are named cases. CHARACTERS_IMAGES_FUZZ_REPORT=PATH writes the figures as JSON.
"""

import collections
import io
import re
import struct
import time
import zlib

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.demo.fakes import FakeWorker
from characters_jax.wire.service import SERVICE_NAME
from characters_jax.wire.images import ImageError, ImageLimits, clean_detail, load_reference_image
from characters_jax.serving.worker import WorkerOptions
from serving_harness import report_writer

SEED = 20261207
CASES = 3000
THROUGH_WORKER = 500  # of the cases, every (CASES // THROUGH_WORKER)-th goes through CreateSession
WIDTH, HEIGHT = 32, 24
LIMITS = ImageLimits(max_pixels=256 * 256)  # mutated dimensions meet the pixel limit, not a 16-megapixel decode
REASONS = {"empty", "too_large", "format", "damaged", "too_many_pixels"}
ADDRESS = re.compile(r"0x[0-9a-f]{6,}", re.IGNORECASE)
FOREIGN_MAGIC = {
    "TIFF": b"II*\x00\x08\x00\x00\x00", "TIFF-BE": b"MM\x00*\x00\x00\x00\x08", "DDS": b"DDS |\x00\x00\x00", "BMP": b"BM",
    "GIF": b"GIF89a", "EPS": b"%!PS-Adobe-3.0 EPSF-3.0\n", "EPS-DOS": b"\xc5\xd0\xd3\xc6", "PSD": b"8BPS\x00\x01", "ICO": b"\x00\x00\x01\x00\x01\x00",
}
OWN_MAGIC = {"PNG": b"\x89PNG\r\n\x1a\n", "JPEG": b"\xff\xd8\xff\xe0", "WEBP": b"RIFF\x00\x00\x00\x00WEBP"}

reports, _write_reports = report_writer("CHARACTERS_IMAGES_FUZZ_REPORT")


# -- the corpus ---------------------------------------------------------------------------------
def _picture(rng, w: int, h: int) -> np.ndarray:
    """A smooth gradient with noise (compresses like a photo, not like noise)."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 127 // max(w + h - 2, 1)], -1)
    return np.clip(base + rng.integers(-12, 12, (h, w, 3)), 0, 255).astype(np.uint8)


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    out, i = [], 8
    while i + 8 <= len(data):
        n = struct.unpack(">I", data[i : i + 4])[0]
        out.append((data[i + 4 : i + 8], data[i + 8 : i + 8 + n]))
        i += 12 + n
    return out


def png_chunk(kind: bytes, payload: bytes, crc: int | None = None) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF if crc is None else crc
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def png_from_chunks(chunks) -> bytes:
    return OWN_MAGIC["PNG"] + b"".join(png_chunk(k, p) for k, p in chunks)


def split_idat(data: bytes, parts: int) -> bytes:
    """The PNG with its image data in `parts` IDAT chunks."""
    chunks = png_chunks(data)
    idat = b"".join(p for k, p in chunks if k == b"IDAT")
    step = -(-len(idat) // parts)
    head = [(k, p) for k, p in chunks if k not in (b"IDAT", b"IEND")]
    return png_from_chunks(head + [(b"IDAT", idat[i : i + step]) for i in range(0, len(idat), step)] + [(b"IEND", b"")])


def corpus(rng) -> dict[str, bytes]:
    rgb = Image.fromarray(_picture(rng, 48, 40))
    two = [Image.fromarray(_picture(rng, 40, 32)), Image.fromarray(_picture(rng, 40, 32))]
    grey16 = Image.fromarray((_picture(rng, 24, 20)[..., 0].astype(np.uint16) * 257)).convert("I;16")
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    text = io.BytesIO()
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "a reference portrait")
    rgb.save(text, format="PNG", pnginfo=info, interlace=1)
    return {
        "png-rgb-3idat": split_idat(_save(rgb, "PNG"), 3),
        "png-rgba": _save(rgb.convert("RGBA"), "PNG"),
        "png-palette-trns": _save(palette, "PNG", transparency=3),
        "png-grey16": _save(grey16, "PNG"),
        "png-interlaced-text": text.getvalue(),
        "apng": _save(two[0], "PNG", save_all=True, append_images=[two[1]], duration=40),
        "jpeg-baseline": _save(rgb, "JPEG", quality=85),
        "jpeg-progressive": _save(rgb, "JPEG", quality=70, progressive=True),
        "jpeg-grey": _save(rgb.convert("L"), "JPEG", quality=80),
        "webp-lossy": _save(rgb, "WEBP", quality=70),
        "webp-lossless": _save(rgb, "WEBP", lossless=True),
        "webp-animated": _save(two[0], "WEBP", save_all=True, append_images=[two[1]], duration=40, quality=60),
    }


# -- mutations ----------------------------------------------------------------------------------
def bit_flips(rng, data: bytes) -> bytes:
    b = bytearray(data)
    head = rng.random() < 0.5  # half of them in the first 64 bytes: the headers' parsers
    for _ in range(int(rng.integers(1, 9))):
        i = int(rng.integers(0, min(64, len(b)) if head else len(b)))
        b[i] ^= 1 << int(rng.integers(0, 8))
    return bytes(b)


def byte_run(rng, data: bytes) -> bytes:
    b = bytearray(data)
    n = int(rng.integers(1, 17))
    i = int(rng.integers(0, max(1, len(b) - n)))
    b[i : i + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    return bytes(b)


def truncate(rng, data: bytes) -> bytes:
    return data[: int(rng.integers(1, len(data)))]


def insert_or_delete(rng, data: bytes) -> bytes:
    i = int(rng.integers(0, len(data)))
    n = int(rng.integers(1, 65))
    if rng.random() < 0.5:
        return data[:i] + rng.integers(0, 256, n, dtype=np.uint8).tobytes() + data[i:]
    return data[:i] + data[i + n :]


def png_chunk_corruption(rng, data: bytes) -> bytes:
    chunks = png_chunks(data)
    j = int(rng.integers(0, len(chunks)))
    kind, payload = chunks[j]
    how = int(rng.integers(0, 6))
    rebuilt = [png_chunk(k, p) for k, p in chunks]
    if how == 0:  # the chunk's type: random bytes (the reported "broken PNG file")
        rebuilt[j] = png_chunk(rng.integers(0, 256, 4, dtype=np.uint8).tobytes(), payload)
    elif how == 1:  # its length field
        rebuilt[j] = struct.pack(">I", int(rng.integers(0, 1 << 32))) + rebuilt[j][4:]
    elif how == 2:  # its CRC
        rebuilt[j] = png_chunk(kind, payload, int(rng.integers(0, 1 << 32)))
    elif how == 3 and payload:  # a byte of its payload, the CRC fixed: past the checksum, into the parser
        p = bytearray(payload)
        p[int(rng.integers(0, len(p)))] = int(rng.integers(0, 256))
        rebuilt[j] = png_chunk(kind, bytes(p))
    elif how == 4:  # dropped or doubled
        rebuilt[j : j + 1] = [] if rng.random() < 0.5 else [rebuilt[j], rebuilt[j]]
    else:  # swapped with another chunk
        k = int(rng.integers(0, len(chunks)))
        rebuilt[j], rebuilt[k] = rebuilt[k], rebuilt[j]
    return OWN_MAGIC["PNG"] + b"".join(rebuilt)


def jpeg_segment_corruption(rng, data: bytes) -> bytes:
    segments, i = [], 2  # (offset of the marker, length incl. the length field) up to SOS
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker, n = data[i + 1], struct.unpack(">H", data[i + 2 : i + 4])[0]
        segments.append((i, n))
        if marker == 0xDA:
            break
        i += 2 + n
    at, n = segments[int(rng.integers(0, len(segments)))]
    b = bytearray(data)
    how = int(rng.integers(0, 3))
    if how == 0:  # the marker byte
        b[at + 1] = int(rng.integers(0, 256))
    elif how == 1:  # the length field
        b[at + 2 : at + 4] = struct.pack(">H", int(rng.integers(0, 1 << 16)))
    else:  # a byte of the payload (SOF dimensions and components, DHT, DQT, SOS tables)
        b[at + 4 + int(rng.integers(0, max(1, n - 2)))] = int(rng.integers(0, 256))
    return bytes(b[: len(data)])


def webp_chunk_corruption(rng, data: bytes) -> bytes:
    b = bytearray(data)
    offsets, i = [], 12  # RIFF chunks after "RIFF size WEBP"
    while i + 8 <= len(b):
        offsets.append(i)
        i += 8 + (struct.unpack("<I", b[i + 4 : i + 8])[0] + 1) // 2 * 2
    how = int(rng.integers(0, 4))
    at = offsets[int(rng.integers(0, len(offsets)))]
    if how == 0:  # RIFF size
        b[4:8] = struct.pack("<I", int(rng.integers(0, 1 << 32)))
    elif how == 1:  # a chunk's FourCC
        b[at : at + 4] = rng.choice([b"VP8 ", b"VP8L", b"VP8X", b"ANIM", b"ANMF", b"ALPH", b"XXXX"])
    elif how == 2:  # a chunk's size
        b[at + 4 : at + 8] = struct.pack("<I", int(rng.integers(0, 1 << 32)))
    else:  # the bitstream's header bytes (dimensions, frame tags)
        j = at + 8 + int(rng.integers(0, 16))
        if j < len(b):
            b[j] = int(rng.integers(0, 256))
    return bytes(b)


def chunk_corruption(rng, data: bytes) -> bytes:
    if data.startswith(OWN_MAGIC["PNG"]):
        return png_chunk_corruption(rng, data)
    if data.startswith(b"\xff\xd8"):
        return jpeg_segment_corruption(rng, data)
    return webp_chunk_corruption(rng, data)


def dimensions(rng, data: bytes) -> bytes:
    """The header's width and height set to random values (PNG: its IHDR CRC fixed)."""
    w, h = (int(x) for x in rng.choice([0, 1, 255, 257, 4096, 65535, 1 << 20, (1 << 31) - 1, 1 << 31], 2))
    if data.startswith(OWN_MAGIC["PNG"]):
        chunks = png_chunks(data)
        kind, p = chunks[0]
        chunks[0] = (kind, struct.pack(">II", w, h) + p[8:])
        return png_from_chunks(chunks)
    b = bytearray(data)
    if data.startswith(b"\xff\xd8"):
        at = next((i for i in range(2, len(b) - 9) if b[i] == 0xFF and b[i + 1] in (0xC0, 0xC1, 0xC2)), None)
        if at is not None:
            b[at + 5 : at + 9] = struct.pack(">HH", h & 0xFFFF, w & 0xFFFF)
        return bytes(b)
    at = data.find(b"VP8")
    if at > 0 and at + 30 <= len(b):  # VP8X canvas, VP8L or VP8 frame sizes: 14 to 24 bits
        b[at + 12 : at + 18] = struct.pack("<HHH", w & 0xFFFF, h & 0xFFFF, (w ^ h) & 0xFFFF)
    return bytes(b)


def header_swap(rng, data: bytes) -> bytes:
    """Another format's magic over the first bytes (or another accepted format's: a PNG that
    says JPEG)."""
    names = sorted(FOREIGN_MAGIC) + sorted(OWN_MAGIC)
    name = names[int(rng.integers(0, len(names)))]
    magic = {**FOREIGN_MAGIC, **OWN_MAGIC}[name]
    keep = int(rng.integers(0, 2))  # over the head, or in front of it
    return magic + data[len(magic) * keep :]


def splice(rng, data: bytes, other: bytes) -> bytes:
    return data[: int(rng.integers(1, len(data)))] + other[int(rng.integers(0, len(other))) :]


MUTATIONS = {"bit_flips": bit_flips, "byte_run": byte_run, "truncate": truncate, "insert_or_delete": insert_or_delete,
             "chunk_corruption": chunk_corruption, "dimensions": dimensions, "header_swap": header_swap, "splice": splice}


def fuzz_cases(seed: int, n: int) -> list[tuple[str, str, bytes]]:
    """[(base name, mutation name, bytes)]: n mutants, the same for the same seed."""
    rng = np.random.default_rng(seed)
    bases = corpus(rng)
    names, kinds = sorted(bases), sorted(MUTATIONS)
    singles = [k for k in kinds if k != "splice" and k != "chunk_corruption"]  # these two need a whole file
    out = []
    for _ in range(n):
        base, kind = names[int(rng.integers(0, len(names)))], kinds[int(rng.integers(0, len(kinds)))]
        data = bases[base]
        if kind == "splice":
            data = splice(rng, data, bases[names[int(rng.integers(0, len(names)))]])
        else:
            data = MUTATIONS[kind](rng, data)
        if rng.random() < 0.15 and len(data) > 1:  # a second mutation on top
            data = MUTATIONS[singles[int(rng.integers(0, len(singles)))]](rng, data)
        out.append((base, kind, data or b"\x00"))
    return out


# -- checks -------------------------------------------------------------------------------------
def check_message(msg: str) -> None:
    assert msg.startswith("image: "), msg
    assert not ADDRESS.search(msg) and " object at " not in msg, msg
    assert msg.isprintable() and len(msg) < 400, msg


def outcome(data: bytes, width: int = WIDTH, height: int = HEIGHT):
    """("ok", array) or (reason, message); anything else raises."""
    try:
        return "ok", load_reference_image(data, width, height, LIMITS)
    except ImageError as err:
        return err.reason, str(err)


def pillow_unguarded(data: bytes) -> str:
    """What Pillow alone does with the bytes (every reader it has; the pixel limit kept):
    "ok" or the exception's type name."""
    try:
        img = Image.open(io.BytesIO(data))
        if img.size[0] * img.size[1] > LIMITS.max_pixels:
            return "pixels"
        img.load()
        img.convert("RGB")
        return "ok"
    except Exception as err:
        return type(err).__name__


# The two reported reproductions.
def broken_png_chunk() -> bytes:
    """A PNG whose second IDAT chunk's type is not a chunk type: Pillow raises SyntaxError
    ("broken PNG file") from load(), after the header was read."""
    data = split_idat(_save(Image.fromarray(_picture(np.random.default_rng(SEED), 48, 40)), "PNG"), 2)
    i = data.index(b"IDAT", data.index(b"IDAT") + 4)
    return data[:i] + b"ID\x00T" + data[i + 4 :]


def dds_file() -> bytes:
    """A DDS file (Pillow writes it) whose pixel format is a FourCC Pillow does not know:
    Pillow raises NotImplementedError from open()."""
    b = bytearray(_save(Image.fromarray(_picture(np.random.default_rng(SEED), 48, 40)).convert("RGBA"), "DDS"))
    b[80:84] = struct.pack("<I", 4)  # DDPF_FOURCC
    b[84:88] = b"ABCD"
    return bytes(b)


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker("tiny", WorkerOptions(image_limits=LIMITS))
    yield w
    w.close()


@pytest.fixture(scope="module")
def stubs(worker):
    with grpc.insecure_channel(worker.address) as ch:
        yield characters_pb2_grpc.CharacterServiceStub(ch), health_pb2_grpc.HealthStub(ch)


def create(stub, image: bytes) -> tuple[grpc.StatusCode, str]:
    """CreateSession's status and details (an opened session is closed at once)."""
    try:
        s = stub.CreateSession(pb.CreateSessionRequest(image=image, seed=1), timeout=30)
    except grpc.RpcError as err:
        return err.code(), err.details()
    token = getattr(s, "session_token", "")  # the session's secret, where the worker issues one
    stub.CloseSession(pb.CloseSessionRequest(session_id=s.session_id, **({"session_token": token} if token else {})), timeout=30)
    return grpc.StatusCode.OK, ""


def serving(health) -> str:
    r = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def test_reported_broken_png_chunk_is_a_clear_invalid_argument(stubs):
    data = broken_png_chunk()
    with pytest.raises(SyntaxError, match="broken PNG file"):  # the defect is real: Pillow's own exception
        Image.open(io.BytesIO(data)).load()
    reason, msg = outcome(data)
    assert reason == "damaged" and "PNG data is damaged" in msg and "broken PNG file" in msg, msg
    check_message(msg)
    code, details = create(stubs[0], data)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == msg, (code, details)


def test_reported_dds_file_is_refused_by_name(stubs):
    data = dds_file()
    with pytest.raises(NotImplementedError):  # what Pillow's DDS reader does with it
        Image.open(io.BytesIO(data))
    plain = _save(Image.new("RGB", (8, 8)), "DDS")
    assert Image.open(io.BytesIO(plain)).format == "DDS"  # Pillow alone would open a DDS
    for bad in (data, plain, _save(Image.new("RGB", (8, 8)), "TIFF"), _save(Image.new("RGB", (8, 8)), "BMP"),
                _save(Image.new("RGB", (8, 8)), "GIF"), b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n"):
        reason, msg = outcome(bad)
        assert reason == "format" and "files are not accepted; send a PNG, JPEG or WebP file" in msg, msg
        check_message(msg)
    code, details = create(stubs[0], data)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "DDS files are not accepted" in details, (code, details)


def test_messages_carry_no_object_repr_or_address():
    err = OSError("cannot identify image file <_io.BytesIO object at 0x7f3a2b1c9d80> at 0xdeadbeef12")
    detail = clean_detail(err)
    assert not ADDRESS.search(detail) and "object at" not in detail and detail.startswith("OSError: cannot identify image file"), detail
    assert ADDRESS.search(str(err))  # the guard sees what it must remove
    reason, msg = outcome(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    assert reason == "damaged" and "header is damaged" in msg, msg
    check_message(msg)


def test_dimensions_over_pillows_own_ceiling_are_named_with_ours():
    """Pillow refuses over 2 * 89478485 pixels in open(), before any limit of ours is checked."""
    chunks = png_chunks(_save(Image.new("RGB", (8, 8)), "PNG"))
    chunks[0] = (b"IHDR", struct.pack(">II", 20000, 20000) + chunks[0][1][8:])
    with pytest.raises(ImageError, match=f"400000000 pixels is over the limit of {2 * Image.MAX_IMAGE_PIXELS} pixels") as err:
        load_reference_image(png_from_chunks(chunks), WIDTH, HEIGHT, ImageLimits(max_pixels=500_000_000))
    assert err.value.reason == "too_many_pixels"


def test_every_base_image_decodes():
    for name, data in corpus(np.random.default_rng(SEED)).items():
        kind, out = outcome(data)
        assert kind == "ok" and out.shape == (HEIGHT, WIDTH, 3) and out.dtype == np.uint8, (name, kind, out)


@pytest.mark.filterwarnings("ignore::UserWarning:PIL.TiffImagePlugin")  # Pillow alone, reading swapped-in TIFF headers
@pytest.mark.filterwarnings("ignore:Palette images with Transparency")  # Pillow alone, converting to RGB directly
@pytest.mark.filterwarnings("ignore:Invalid APNG")  # Pillow's notice for a damaged APNG it reads as a PNG
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_mutated_images_are_images_or_clear_errors_and_never_unknown_through_the_worker(stubs):
    stub, health = stubs
    t0 = time.perf_counter()
    cases = fuzz_cases(SEED, CASES)
    t_made = time.perf_counter()
    counts, by_mutation, unguarded = collections.Counter(), collections.defaultdict(collections.Counter), collections.Counter()
    messages = {}
    for i, (base, kind, data) in enumerate(cases):
        try:
            reason, out = outcome(data)
        except Exception as err:  # the defect: an exception other than ImageError
            pytest.fail(f"seed {SEED} case {i} ({base}, {kind}): {type(err).__name__}: {err}")
        if reason == "ok":
            assert out.shape == (HEIGHT, WIDTH, 3) and out.dtype == np.uint8, (i, out.shape, out.dtype)
        else:
            assert reason in REASONS, (i, reason)
            check_message(out)
            messages[i] = out
        counts[reason] += 1
        by_mutation[kind][reason] += 1
        unguarded[pillow_unguarded(data)] += 1
    t_direct = time.perf_counter()

    codes = collections.Counter()
    stride = CASES // THROUGH_WORKER
    for i in range(0, CASES, stride):
        code, details = create(stub, cases[i][2])
        codes[code.name] += 1
        if i in messages:
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details == messages[i], (SEED, i, cases[i][:2], code, details)
        else:
            assert code == grpc.StatusCode.OK, (SEED, i, cases[i][:2], code, details)
    t_worker = time.perf_counter()
    assert serving(health) == "SERVING"
    assert create(stub, corpus(np.random.default_rng(SEED))["png-rgba"])[0] == grpc.StatusCode.OK  # still takes a good image

    reports["fuzz"] = {
        "seed": SEED, "cases": CASES, "outcomes": dict(counts), "by_mutation": {k: dict(v) for k, v in sorted(by_mutation.items())},
        "pillow_alone": dict(unguarded), "through_worker": dict(codes),
        "seconds": {"make": round(t_made - t0, 2), "direct": round(t_direct - t_made, 2), "worker": round(t_worker - t_direct, 2)},
    }
    print(f"images fuzz: seed {SEED}: {reports['fuzz']}")
    # The fuzz reaches every kind of answer, and cases where Pillow alone raises what was UNKNOWN before.
    assert {"ok", "damaged", "format", "too_many_pixels"} <= set(counts), counts
    assert sum(v for k, v in unguarded.items() if k not in ("ok", "pixels", "UnidentifiedImageError", "OSError", "ValueError")) > 0, unguarded
    assert sum(codes.values()) == THROUGH_WORKER and codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0, codes
