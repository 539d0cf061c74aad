"""Component breakdown of the step's device time from a JAX profiler trace.

`profile_steps` runs a compiled step a few times under `jax.profiler.trace`, reads the
trace's XSpace (`*.xplane.pb`, through `jax.profiler.ProfileData`) and splits the device
time of each step into components:

  cache_upkeep    ops under the "cache_upkeep" named scope (K/V write, RoPE, re-quantize, shift)
  attention       ops under the "attention" scope, or attention kernels by name (cuDNN fMHA, flash)
  gemm            GEMM kernels: dot / convolution, cuBLAS(Lt) custom calls, GEMM fusions, or
                  kernels named gemm / cublas / cutlass / xmma / sm90 / wgmma
  gemm_allreduce  the fused Pallas FP8 GEMM + all-reduce kernel (present only when used)
  collective      all-reduce / all-gather / reduce-scatter / collective-permute, NCCL kernels
  other           everything else: norms, GELU, activation quantization, casts, adds, copies

How an op is attributed: each device event of the trace names its HLO instruction (the
`hlo_op` stat, on GPU kernels and CPU thunks alike); the compiled program's HLO text maps
that name to its opcode, its fused computation and its `op_name` metadata, whose path holds
the `jax.named_scope`s of the step (e.g. ".../while/body/.../attention/exp"). Where an event
names no instruction of the program, the kernel name decides (and the scope is "unscoped").

Times: per device, the sum of event durations per component ("kernel time"; on GPU the NCCL
stream overlaps the compute stream, so the sum can exceed the busy time), the busy time
(union of the events' intervals), and the host wall time per step; the launch gap is wall
minus busy. All in ms per step, averaged over the devices of the mesh. Components always add
up to the kernel time.

Offline re-analysis of a saved trace:
    python -m characters_jax.measure.profile TRACE_DIR [--steps N]
(`profile_steps` writes the step's HLO text next to the trace as `step_hlo.txt`.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
import time

COMPONENTS = ("cache_upkeep", "attention", "gemm", "gemm_allreduce", "collective", "other")
SCOPES = ("cache_upkeep", "attention", "qkv_proj", "mlp_up", "out_down_reduce")

_COLLECTIVE_OPCODES = re.compile(
    r"^(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|collective-broadcast|send|recv|ragged-all-to-all)"
)
_CONTAINER_OPCODES = {"while", "conditional", "call"}
_GEMM_OPCODES = {"dot", "convolution", "scaled-dot", "ragged-dot"}
_COLLECTIVE_KERNEL = re.compile(r"nccl|all[-_]?reduce|allgather|all[-_]gather|reduce[-_]?scatter|sendrecv|collective", re.I)
_ATTENTION_KERNEL = re.compile(r"fmha|flash|attention|cudnn.*(sdpa|mha)", re.I)
_GEMM_KERNEL = re.compile(r"gemm|cublas|cutlass|xmma|sm90_|sm100_|wgmma|matmul", re.I)
_GEMM_TARGET = re.compile(r"cublas|gemm|matmul", re.I)
_ATTENTION_TARGET = re.compile(r"fmha|flash|attention", re.I)
_MOSAIC_TARGET = re.compile(r"mosaic", re.I)
# Pallas kernels carry their names into the trace ('<name>_mosaic_gpu_kernel'; see
# pallas_kernels.*.KERNEL_NAME); the fused GEMM + all-reduce is named before the collectives'
# pattern (which would take its 'allreduce') is tried.
_GEMM_ALLREDUCE_KERNEL = re.compile(r"gemm_?all_?reduce", re.I)
# Scopes whose unnamed Mosaic kernels are GEMMs (traces from before the kernels had names).
_GEMM_SCOPES = {"qkv_proj": "gemm", "mlp_up": "gemm", "out_down_reduce": "gemm_allreduce"}
# Lines of a GPU device plane that the profiler derives from the kernels (would double count).
_DERIVED_LINES = {
    "XLA Modules", "XLA Ops", "Steps", "TensorFlow Ops", "TensorFlow Name Scope", "Framework Ops",
    "Framework Name Scope", "Source code", "XLA TraceMe", "Launch Stats", "Host Threads",
}


# ------------------------------------------------------------------------------------------
# The compiled program's HLO: instruction name -> opcode, scope, what it computes
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One HLO instruction of the compiled program.

    opcode: e.g. 'fusion', 'custom-call', 'all-reduce-start'; op_name: its metadata path
    ('' if none); target: custom_call_target ('' if none); calls: called computations;
    fusion_kind: the backend fusion kind ('kLoop', '__triton_gemm', ...; '' if none).
    """

    name: str
    opcode: str
    op_name: str
    target: str
    calls: tuple[str, ...]
    fusion_kind: str


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^.*?\s([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?")
_FUSION_KIND = re.compile(r'"kind"\s*:\s*"([^"]+)"|kind=(k\w+)')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*(?:->.*)?\{\s*$")


def parse_hlo(hlo_text: str) -> tuple[dict[str, OpInfo], dict[str, list[str]]]:
    """Parses `compiled.as_text()`: ({instruction name: OpInfo}, {computation: [instruction names]})."""
    ops: dict[str, OpInfo] = {}
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            m = _COMPUTATION.match(line.strip())
            current = m.group(1) if m else None
            if current is not None:
                comps.setdefault(current, [])
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m or current is None:
            continue
        name, rest = m.group(1), " " + m.group(2)
        op = _OPCODE.match(rest)
        calls = []
        for c in _CALLS.findall(rest):
            calls.extend(x.strip().lstrip("%") for x in c.split(",") if x.strip())
        kind = _FUSION_KIND.search(rest)
        info = OpInfo(
            name=name,
            opcode=op.group(1) if op else "",
            op_name=(_OP_NAME.search(rest).group(1) if _OP_NAME.search(rest) else ""),
            target=(_TARGET.search(rest).group(1) if _TARGET.search(rest) else ""),
            calls=tuple(calls),
            fusion_kind=((kind.group(1) or kind.group(2)) if kind else ""),
        )
        ops[name] = info
        comps[current].append(name)
    return ops, comps


def _sanitize(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


def scope_of(op_name: str) -> str:
    """The innermost of the step's named scopes in an op_name path, else 'unscoped'."""
    for part in reversed(op_name.split("/")):
        if part in SCOPES:
            return part
    return "unscoped"


class HloIndex:
    """Classifies the program's instructions; built once from the HLO text."""

    def __init__(self, hlo_text: str):
        self.ops, self.comps = parse_hlo(hlo_text)
        first = hlo_text.split("\n", 1)[0]
        m = re.match(r"HloModule\s+([\w.\-]+)", first)
        self.module = m.group(1) if m else None
        self._fused_opcodes: dict[str, frozenset] = {}
        # GPU kernels of XLA fusions are named after the instruction with '.' and '-' as '_'.
        self._by_kernel_name = {_sanitize(n): info for n, info in self.ops.items()}

    def lookup(self, hlo_op: str | None, kernel: str) -> OpInfo | None:
        """The instruction an event ran: by its hlo_op stat, else by its kernel name."""
        return self.ops.get(hlo_op or "") or self.ops.get(kernel) or self._by_kernel_name.get(_sanitize(kernel))

    def fused_opcodes(self, info: OpInfo) -> frozenset:
        """Opcodes inside a fusion's called computations (recursively), incl. custom-call targets."""
        if info.name in self._fused_opcodes:
            return self._fused_opcodes[info.name]
        seen, out, todo = set(), set(), list(info.calls)
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            for n in self.comps.get(c, ()):
                o = self.ops[n]
                out.add(o.opcode)
                if o.target:
                    out.add("target:" + o.target)
                todo.extend(o.calls)
        self._fused_opcodes[info.name] = frozenset(out)
        return self._fused_opcodes[info.name]

    def is_container(self, hlo_op: str | None, kernel: str = "") -> bool:
        info = self.lookup(hlo_op, kernel)
        return info is not None and info.opcode in _CONTAINER_OPCODES

    def classify(self, hlo_op: str | None, kernel: str, stat_scope: str = "") -> tuple[str, str]:
        """(component, scope) of one device event.

        hlo_op: the event's HLO instruction name (or None); kernel: the event (kernel) name;
        stat_scope: an op_name-like path carried by the event itself, if any.
        """
        info = self.lookup(hlo_op, kernel)
        scope = scope_of(info.op_name if info is not None and info.op_name else stat_scope)
        opcode = info.opcode if info is not None else ""
        target = info.target if info is not None else ""
        fused = self.fused_opcodes(info) if info is not None and opcode == "fusion" else frozenset()
        fused_targets = " ".join(t for t in fused if t.startswith("target:"))

        if _GEMM_ALLREDUCE_KERNEL.search(kernel):
            return "gemm_allreduce", scope
        if _COLLECTIVE_OPCODES.match(opcode) or _COLLECTIVE_KERNEL.search(kernel) or any(_COLLECTIVE_OPCODES.match(o) for o in fused):
            return "collective", scope
        if scope == "cache_upkeep":
            return "cache_upkeep", scope
        if scope == "attention":
            return "attention", scope
        if _ATTENTION_TARGET.search(target) or _ATTENTION_TARGET.search(fused_targets) or (info is None and _ATTENTION_KERNEL.search(kernel)):
            return "attention", scope
        if _MOSAIC_TARGET.search(target + " " + fused_targets):
            if _GEMM_KERNEL.search(kernel):
                return "gemm", scope
            if scope in _GEMM_SCOPES:
                return _GEMM_SCOPES[scope], scope
        is_gemm = (
            opcode in _GEMM_OPCODES
            or (opcode == "custom-call" and _GEMM_TARGET.search(target))
            or bool(fused & _GEMM_OPCODES)
            or bool(_GEMM_TARGET.search(fused_targets))
            or "gemm" in (info.fusion_kind.lower() if info is not None else "")
            or _GEMM_KERNEL.search(kernel)
        )
        if is_gemm:
            return "gemm", scope
        return "other", scope


# ------------------------------------------------------------------------------------------
# Trace reading
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceEvent:
    """One op executed on a device: a GPU kernel or memcpy, or a CPU thunk.

    device: 'gpu:0', 'cpu:1', ...; line: the trace line (stream or thread) it ran on;
    start_ns / end_ns: float ns on the trace clock; kernel: the event name; hlo_op / hlo_module:
    from its stats (None when absent); scope_hint: an op_name-like stat ('' if none).
    """

    device: str
    line: str
    start_ns: float
    end_ns: float
    kernel: str
    hlo_op: str | None
    hlo_module: str | None
    scope_hint: str


def find_xplane(logdir: str | pathlib.Path) -> pathlib.Path:
    """The newest `*.xplane.pb` under a `jax.profiler.trace` directory."""
    files = sorted(pathlib.Path(logdir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {logdir}")
    return files[-1]


def _stats(ev) -> dict:
    out = {}
    try:
        for k, v in ev.stats:
            out.setdefault(k, v)
    except Exception:  # a stat type the binding cannot convert
        pass
    return out


def _scope_hint(stats: dict) -> str:
    for key in ("tf_op", "name", "long_name", "scope", "op_name"):
        v = stats.get(key)
        if isinstance(v, str) and "/" in v:
            return v
    return ""


def read_device_events(xplane_path: str | pathlib.Path, backend: str | None = None) -> list[DeviceEvent]:
    """Device events of a trace: kernels of GPU device planes (stream lines only), or, on
    CPU, the thunks of the host plane that name an HLO instruction. backend='gpu' with no GPU
    plane in the trace (no CUPTI) is an error: host-side events are not device time."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane_path))
    events: list[DeviceEvent] = []
    gpu_planes = [p for p in data.planes if re.match(r"^/device:(GPU|ROCM|CUDA)", p.name, re.I)]
    if gpu_planes:
        for plane in gpu_planes:
            dev = "gpu:" + plane.name.rsplit(":", 1)[-1]
            lines = list(plane.lines)
            stream_lines = [l for l in lines if l.name.startswith("Stream")]
            use = stream_lines or [l for l in lines if l.name not in _DERIVED_LINES]
            for line in use:
                for ev in line.events:
                    st = _stats(ev)
                    events.append(DeviceEvent(dev, line.name, float(ev.start_ns), float(ev.end_ns), ev.name,
                                              st.get("hlo_op"), st.get("hlo_module"), _scope_hint(st)))
        return events
    if backend not in (None, "cpu"):
        raise RuntimeError(f"no device plane in the trace for backend {backend!r} (is CUPTI available?)")
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                st = _stats(ev)
                if "hlo_op" not in st or ev.name.startswith("end:"):
                    continue
                dev = f"cpu:{st.get('device_ordinal', 0)}"
                events.append(DeviceEvent(dev, line.name, float(ev.start_ns), float(ev.end_ns), ev.name,
                                          st.get("hlo_op"), st.get("hlo_module"), _scope_hint(st)))
    return events


def _union_ns(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _self_times(events: list[DeviceEvent]) -> list[float]:
    """Duration of each event minus that of the events nested in it on the same line (ns)."""
    out = [e.end_ns - e.start_ns for e in events]
    by_line: dict[str, list[int]] = {}
    for i, e in enumerate(events):
        by_line.setdefault(e.line, []).append(i)
    for idx in by_line.values():
        idx.sort(key=lambda i: (events[i].start_ns, -events[i].end_ns))
        stack: list[int] = []
        for i in idx:
            while stack and events[stack[-1]].end_ns <= events[i].start_ns:
                stack.pop()
            if stack and events[i].end_ns <= events[stack[-1]].end_ns:
                out[stack[-1]] -= events[i].end_ns - events[i].start_ns
            stack.append(i)
    return [max(0.0, t) for t in out]


# ------------------------------------------------------------------------------------------
# The breakdown
# ------------------------------------------------------------------------------------------


def compute_breakdown(events: list[DeviceEvent], index: HloIndex, steps: int, wall_ms: list[float] | None = None,
                      top: int = 60) -> dict:
    """Component breakdown of `steps` steps' device events, in ms per step (mean over devices).

    Returns a JSON-able dict: components_ms / components_share (of the kernel time),
    kernel_ms (sum of components), busy_ms (union of intervals), overlap_ms (kernel - busy),
    span_ms (first event start to last end, per step), wall_ms (host, per step, if given),
    launch_gap_ms (wall - busy), by_scope {scope: {component: ms}}, per_device, top_ops (the
    `top` costliest instructions; the small ones are what elementwise work is made of),
    scoped_share (fraction of kernel time whose instruction was found in the program).
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    module = index.module
    if module is not None and any(e.hlo_module == module for e in events):
        events = [e for e in events if e.hlo_module in (module, None)]
    self_ns = _self_times(events)
    per_dev: dict[str, dict] = {}
    by_scope: dict[str, dict[str, float]] = {}
    ops: dict[tuple[str, str], list] = {}
    found_ns = 0.0
    total_ns = 0.0
    for e, t in zip(events, self_ns):
        d = per_dev.setdefault(e.device, {"components_ns": {c: 0.0 for c in COMPONENTS}, "intervals": [], "n": 0})
        if index.is_container(e.hlo_op, e.kernel):
            continue  # while / conditional / call: their bodies' ops are counted themselves
        comp, scope = index.classify(e.hlo_op, e.kernel, e.scope_hint)
        d["components_ns"][comp] += t
        d["intervals"].append((e.start_ns, e.end_ns))
        d["n"] += 1
        by_scope.setdefault(scope, {c: 0.0 for c in COMPONENTS})[comp] += t
        rec = ops.setdefault((e.hlo_op or e.kernel, comp), [0.0, 0, e.kernel, scope])
        rec[0] += t
        rec[1] += 1
        total_ns += t
        if index.lookup(e.hlo_op, e.kernel) is not None:
            found_ns += t
    per_dev = {k: v for k, v in per_dev.items() if v["n"]}
    ndev = max(1, len(per_dev))
    scale = 1e-6 / steps  # ns -> ms per step

    def dev_summary(d):
        comps = {c: d["components_ns"][c] * scale for c in COMPONENTS}
        kernel = sum(comps.values())
        busy = _union_ns(d["intervals"]) * scale
        span = (max(e for _, e in d["intervals"]) - min(s for s, _ in d["intervals"])) * scale
        return {"components_ms": comps, "kernel_ms": kernel, "busy_ms": busy, "span_ms": span, "events_per_step": d["n"] / steps}

    devices = {k: dev_summary(v) for k, v in sorted(per_dev.items())}

    def mean(key):
        return sum(v[key] for v in devices.values()) / ndev if devices else 0.0

    comps = {c: (sum(v["components_ms"][c] for v in devices.values()) / ndev if devices else 0.0) for c in COMPONENTS}
    kernel = sum(comps.values())
    busy = mean("busy_ms")
    wall = float(sorted(wall_ms)[len(wall_ms) // 2]) if wall_ms else None
    top_ops = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps,
        "devices": sorted(devices),
        "components_ms": comps,
        "components_share": {c: (comps[c] / kernel if kernel > 0 else 0.0) for c in COMPONENTS},
        "kernel_ms": kernel,
        "busy_ms": busy,
        "overlap_ms": kernel - busy,
        "span_ms": mean("span_ms"),
        "wall_ms": wall,
        "launch_gap_ms": (wall - busy) if wall is not None else None,
        "by_scope": {s: {c: v * scale / ndev for c, v in d.items() if v > 0} for s, d in sorted(by_scope.items())},
        "per_device": devices,
        "scoped_share": found_ns / total_ns if total_ns > 0 else 0.0,
        "top_ops": [
            {"op": k[0], "component": k[1], "kernel": v[2][:120], "scope": v[3], "ms": v[0] * scale / ndev, "calls": v[1] / steps / ndev}
            for k, v in top_ops
        ],
    }


def format_breakdown(b: dict) -> str:
    """A text table of a breakdown: one row per component, then busy / wall / gaps."""
    rows = [f"{'component':<16} {'ms/step':>9} {'share':>7}"]
    for c in COMPONENTS:
        ms = b["components_ms"][c]
        if c == "gemm_allreduce" and ms == 0:
            continue
        rows.append(f"{c:<16} {ms:9.2f} {100 * b['components_share'][c]:6.1f}%")
    rows.append(f"{'kernel total':<16} {b['kernel_ms']:9.2f}   (sum over streams; {len(b['devices'])} device(s), mean)")
    rows.append(f"{'device busy':<16} {b['busy_ms']:9.2f}   (union; overlap {b['overlap_ms']:.2f} ms)")
    if b.get("wall_ms") is not None:
        rows.append(f"{'wall (host)':<16} {b['wall_ms']:9.2f}   (launch gaps / idle {b['launch_gap_ms']:.2f} ms)")
    rows.append(f"{'attributed':<16} {100 * b['scoped_share']:8.1f}%  of kernel time matched to the program's HLO")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------
# Capture
# ------------------------------------------------------------------------------------------


def profile_steps(step_exe, params, state, audio, *, steps: int, logdir: str | pathlib.Path, hlo_text: str | None = None):
    """Runs `steps` steps under the profiler and computes their breakdown.

    step_exe: the compiled step, (params, state, audio) -> (state, latent), state donated;
    audio: [A_tok, F_a] f32 on the devices. Each step is waited on (as the bench times it).
    Writes the trace and `step_hlo.txt` under `logdir`. Returns (state, breakdown dict).
    """
    import jax

    logdir = pathlib.Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    hlo_text = hlo_text if hlo_text is not None else step_exe.as_text()
    (logdir / "step_hlo.txt").write_text(hlo_text)
    jax.block_until_ready(state)
    wall = []
    with jax.profiler.trace(str(logdir)):
        for _ in range(steps):
            t0 = time.perf_counter()
            state, latent = step_exe(params, state, audio)
            latent.block_until_ready()
            wall.append((time.perf_counter() - t0) * 1e3)
    xplane = find_xplane(logdir)
    b = compute_breakdown(read_device_events(xplane, jax.default_backend()), HloIndex(hlo_text), steps, wall)
    b["trace"] = str(xplane)
    b["note"] = ("kernel times while tracing; XLA runs command buffers op by op under the profiler, "
                 "so wall/gaps here can differ from the untraced step p50")
    return state, b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="component breakdown of a saved step trace")
    p.add_argument("trace_dir", help="a bench.profile_dir directory (holds the trace and step_hlo.txt)")
    p.add_argument("--steps", type=int, default=None, help="steps in the trace (default: from breakdown.json, else 1)")
    p.add_argument("--json", default=None, help="write the breakdown here")
    a = p.parse_args(argv)
    d = pathlib.Path(a.trace_dir)
    steps = a.steps
    if steps is None:
        saved = d / "breakdown.json"
        steps = json.loads(saved.read_text()).get("steps", 1) if saved.exists() else 1
    hlo = (d / "step_hlo.txt").read_text() if (d / "step_hlo.txt").exists() else ""
    b = compute_breakdown(read_device_events(find_xplane(d)), HloIndex(hlo), steps)
    print(format_breakdown(b))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(b, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
