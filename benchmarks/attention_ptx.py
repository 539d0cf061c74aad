"""What ptxas sees between the attention kernel's wgmmas: a condensed PTX timeline.

ptxas serializes wgmmas when non-wgmma instructions define or read the registers of a
wgmma between the start and end of a pipeline stage (its notes C7513 / C7514; BUILD_NOTES,
GPU runs 8-12). This script compiles one kernel variant at the model's shape with Mosaic
GPU's PTX and ptxas dumps on, then prints the PTX in program order as a timeline of wgmma
events (fence, mma_async, commit_group, wait_group) and, between consecutive events, the
count of every other instruction by opcode: the instructions that sit inside a pipeline
stage show up between an mma_async and the next wait_group.

  python3 benchmarks/attention_ptx.py --variant kv_split_s2_lpv_fast_oq --out $OUT/ptx
  python3 benchmarks/attention_ptx.py --source 5a249ec --variant-kw overlap=pv --out $OUT/ptx
  python3 benchmarks/attention_ptx.py --sass out/ptx/fp8_attention_0.ptx   # any machine

--sass takes a PTX file that a GPU run dumped (or a cuobjdump -sass listing) and prints
the SASS as the same kind of timeline (QGMMA, warpgroup arrive / wait, mbarrier waits,
each with its address, and the instructions between them counted by opcode): ptxas
(-arch=sm_90a) and cuobjdump need no GPU, so the machine code of a kernel variant can be
read without device time (cuobjdump: on PATH, or --cuobjdump; PyPI's
nvidia-cuda-cuobjdump wheel carries one).

--source REV loads ``pallas_kernels/fp8_attention.py`` as of git revision REV (e.g. a kernel
option since removed) instead of the working tree's. Writes the dumps and timeline.txt
under --out. Needs an NVIDIA Hopper GPU; ``--parse FILE`` only parses a saved PTX file.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TQ, S, D, BLOCK_KV = 757, 5788, 128, 128
_WGMMA = re.compile(r"\bwgmma\.(fence|mma_async|commit_group|wait_group)\S*(?:\s+(\d+))?")
_OPCODE = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)")
# SASS: '/*2760*/  @P0 QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR56], RZ, !UPT ;'
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)(.*?);")
_SASS_EVENT = (("QGMMA", "mma"), ("HGMMA", "mma"), ("WARPGROUP.ARRIVE", "fence"),
               ("WARPGROUP.DEPBAR", "wait"), ("SYNCS.PHASECHK", "mbarrier_wait"))


def _condense(items) -> list[str]:
    """The timeline of a stream of (event, opcode, address) items in program order: one
    line per run of one event ('mma_async x4', with its first address when it has one)
    and, between events, one line counting the other instructions by opcode. An item is
    an event (opcode None) or another instruction (event None)."""
    out: list[str] = []
    others: collections.Counter = collections.Counter()
    last, repeat, addr = None, 0, None

    def flush_event():
        nonlocal last, repeat
        if last is not None:
            out.append((f"0x{addr} " if addr else "") + last
                       + (f" x{repeat}" if repeat > 1 else ""))
        last, repeat = None, 0

    def flush_others():
        if others:
            out.append("    " + ", ".join(f"{n} {op}" for op, n in others.most_common()))
            others.clear()

    for event, opcode, where in items:
        if event is None:
            flush_event()
            others[opcode] += 1
            continue
        if event != last or others:
            flush_event()
            flush_others()
            addr = where
        last, repeat = event, repeat + 1
    flush_event()
    flush_others()
    return out


def _ptx_items(ptx: str):
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line.startswith((".", "{", "}")) or line.endswith(":"):
            continue
        m = _WGMMA.search(line)
        if m:
            yield m.group(1) + (f" {m.group(2)}" if m.group(1) == "wait_group" else ""), None, None
        elif op := _OPCODE.match(line):
            yield None, op.group(1), None


def _sass_items(sass: str):
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if not m:
            continue
        a, op, rest = m.groups()
        kind = next((k for prefix, k in _SASS_EVENT if op.startswith(prefix)), None)
        if kind == "mma":
            kind = f"mma {op.split('.')[1]}"
        elif kind == "wait":
            kind = "wait " + rest.strip().replace(",", "").replace("  ", " ")
        yield kind, None if kind else op, a


def timeline(ptx: str) -> list[str]:
    """Condensed program-order view of a PTX text: one line per run of consecutive wgmma
    events of one kind ('mma_async x4', 'wait_group 1', ...) and, between them, one line
    with the other instructions counted by opcode (labels, directives, comments and
    braces skipped)."""
    return _condense(_ptx_items(ptx))


def sass_timeline(sass: str) -> list[str]:
    """The timeline of a cuobjdump -sass listing: one line per run of consecutive events
    ('0x2760 mma 64x128x32 x8', '0x28e0 wait gsb0 0x0', fence, mbarrier_wait), each with
    the address of its first instruction, and between them the other instructions
    counted by opcode (predicates stripped)."""
    return _condense(_sass_items(sass))


def sass_of(path: str, cuobjdump: str = "cuobjdump") -> str:
    """SASS text of a PTX file (ptxas -arch=sm_90a, then cuobjdump -sass) or of a saved
    listing (any other suffix)."""
    if not path.endswith(".ptx"):
        return open(path).read()
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run(["ptxas", "-arch=sm_90a", path, "-o", cubin], check=True)
        return subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True,
                              text=True).stdout


def load_attention_module(source: str | None):
    """pallas_kernels.fp8_attention from the working tree, or as of git revision source."""
    if not source:
        from pallas_kernels import fp8_attention
        return fp8_attention
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(["git", "show", f"{source}:pallas_kernels/fp8_attention.py"],
                          cwd=root, check=True, capture_output=True, text=True).stdout
    path = os.path.join("/tmp", f"fp8_attention_{source}.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"fp8_attention_{source}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_variant(out: str, kw: dict, source: str | None, heads: int) -> None:
    """Compiles the kernel at the model's shape with the PTX and ptxas dumps on."""
    os.makedirs(out, exist_ok=True)
    import jax
    import jax.numpy as jnp

    fa = load_attention_module(source)
    q = jax.ShapeDtypeStruct((TQ, heads, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((S, heads, D), fa.F8)
    sc = jax.ShapeDtypeStruct((heads,), jnp.float32)
    va = jax.ShapeDtypeStruct((S,), jnp.bool_)
    fa.attention_pallas.trace(q, k, k, sc, sc, va, **kw).lower().compile()


def parse_kw(items: list[str]) -> dict:
    """['overlap=pv', 'bit_exp2=1'] -> {'overlap': 'pv', 'bit_exp2': True}."""
    kw = {}
    for item in items:
        name, _, value = item.partition("=")
        low = value.lower()
        kw[name] = (True if low in ("1", "true") else False if low in ("0", "false")
                    else int(value) if value.isdigit() else value)
    return kw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/attention_ptx")
    ap.add_argument("--variant", default=None,
                    help="a bench_attention.py variant name (working tree only)")
    ap.add_argument("--variant-kw", nargs="*", default=[],
                    help="attention_pallas keyword arguments, name=value")
    ap.add_argument("--source", default=None, help="git revision of fp8_attention.py")
    ap.add_argument("--heads", type=int, default=18)
    ap.add_argument("--parse", default=None, help="only print the timeline of this PTX file")
    ap.add_argument("--sass", default=None,
                    help="print the SASS timeline of this PTX file (ptxas + cuobjdump, no "
                         "GPU needed) or cuobjdump -sass listing")
    ap.add_argument("--cuobjdump", default="cuobjdump")
    args = ap.parse_args()
    if args.parse:
        print("\n".join(timeline(open(args.parse).read())))
        return 0
    if args.sass:
        print("\n".join(sass_timeline(sass_of(args.sass, args.cuobjdump))))
        return 0
    # Read by Mosaic GPU when it compiles (set before jax is imported, to be safe).
    os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1",
                      MOSAIC_GPU_DUMP_TO=os.path.abspath(args.out))
    kw = parse_kw(args.variant_kw)
    if args.variant:
        from benchmarks.bench_attention import _Variants
        kw = {**_Variants()[args.variant], **kw}
    compile_variant(args.out, kw, args.source, args.heads)
    files = sorted(glob.glob(os.path.join(args.out, "**", "*.ptx"), recursive=True))
    if not files:
        print(f"no .ptx under {args.out}: {os.listdir(args.out)}")
        return 1
    lines = timeline(open(files[-1]).read())
    with open(os.path.join(args.out, "timeline.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{files[-1]}: {len(lines)} timeline lines (timeline.txt); the wgmma regions:")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
