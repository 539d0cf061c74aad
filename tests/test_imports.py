"""The import graph of ``characters_jax`` and ``pallas_kernels``, read from the sources with
``ast`` (every import, those inside functions too): no cycle between modules nor between
packages; the kernels import jax, numpy and each other only, and no single-device kernel
imports the collective one; the worker (serving/) and its clients (client/, viewer/) never
reach each other through any chain of imports, only the neutral wire/; the quality gate,
the measures and the data never reach the trainer (train/ builds on them, not the reverse)."""

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("characters_jax", "pallas_kernels")
# What pallas_kernels may import besides itself: jax, numpy and a few small modules of
# the standard library.
KERNEL_IMPORTS = {"jax", "jaxlib", "numpy", "__future__", "dataclasses", "functools", "math",
                  "operator", "types", "typing"}
# The collective kernel: the single-device kernels must not import it.
COLLECTIVE_KERNELS = {"pallas_kernels.fp8_gemm_allreduce"}
# The programs that share the service, and what none of their modules may reach through any
# chain of imports: the worker and its clients meet in characters_jax.wire only.
APART = {
    "characters_jax.serving": ("characters_jax.client", "characters_jax.viewer", "characters_jax.demo"),
    "characters_jax.client": ("characters_jax.serving", "characters_jax.viewer", "characters_jax.demo"),
    "characters_jax.viewer": ("characters_jax.serving",),
    "characters_jax.wire": ("characters_jax.serving", "characters_jax.client", "characters_jax.viewer", "characters_jax.demo"),
}
# Layers below the trainer: what the gate, the measures and the data reach must not include it.
BELOW_TRAINER = {package: ("characters_jax.train",) for package in
                 ("characters_jax.gate", "characters_jax.lipsync", "characters_jax.data")}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for base in PACKAGES:
        for path in (ROOT / base).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods) -> set[str]:
    """Every dotted name ``name``'s source imports (relative ones resolved): for
    ``from X import Y`` the module X.Y where Y is a submodule, else X (a name of X)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names)
    return out


def _graph():
    """{module: {modules of this tree it imports}} and {module: {top-level names}}."""
    mods = _modules()

    def resolve(dotted):
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    edges, tops = {}, {}
    for name, path in mods.items():
        names = _imports(name, path, mods)
        tops[name] = {n.split(".")[0] for n in names if n}
        edges[name] = {r for r in map(resolve, names) if r and r != name}
    return edges, tops


def _package(module: str) -> str:
    """The package a module belongs to: pallas_kernels, characters_jax.<subpackage>, or the
    module itself (characters_jax.config, ...)."""
    parts = module.split(".")
    if parts[0] == "pallas_kernels":
        return "pallas_kernels"
    if len(parts) > 1 and (ROOT / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_import_cycles():
    edges, _ = _graph()
    assert len(edges) > 40  # the walk found the tree
    assert _cycles(edges) == []


def test_no_package_import_cycles():
    edges, _ = _graph()
    packages = collections.defaultdict(set)
    for a, bs in edges.items():
        packages[_package(a)].update(_package(b) for b in bs if _package(b) != _package(a))
    cycles = {frozenset(c) for c in _cycles(packages)}
    assert not cycles, sorted(map(sorted, cycles))


def test_kernels_import_jax_numpy_and_each_other_only():
    edges, tops = _graph()
    kernels = [m for m in edges if m.startswith("pallas_kernels")]
    assert len(kernels) >= 8
    for m in kernels:
        assert tops[m] <= KERNEL_IMPORTS | {"pallas_kernels"}, (m, tops[m] - KERNEL_IMPORTS)
        assert not {e for e in edges[m] if e.startswith("characters_jax")}, m
        if m not in COLLECTIVE_KERNELS:
            assert not edges[m] & COLLECTIVE_KERNELS, (m, "imports the collective kernel")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _crossings(edges: dict[str, set[str]], apart=APART) -> list[tuple[str, str]]:
    """(module, forbidden module it reaches) for every module of `apart`'s packages."""
    out = []
    for package, forbidden in apart.items():
        for start in sorted(m for m in edges if _within(m, package)):
            seen, todo = set(), [start]
            while todo:
                for nxt in edges.get(todo.pop(), ()):
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            out += [(start, m) for m in sorted(seen) if any(_within(m, f) for f in forbidden)]
    return out


def test_the_worker_and_its_clients_never_reach_each_other():
    edges, _ = _graph()
    for package in APART:
        assert any(_within(m, package) for m in edges), package
    assert _crossings(edges) == []
    # The check sees a chain: client -> wire -> serving would be a crossing.
    chained = {**edges, "characters_jax.wire.service": edges["characters_jax.wire.service"] | {"characters_jax.serving.worker"}}
    assert ("characters_jax.client.character_client", "characters_jax.serving.worker") in _crossings(chained)


def test_the_gate_the_measures_and_the_data_never_reach_the_trainer():
    edges, _ = _graph()
    for package in BELOW_TRAINER:
        assert any(_within(m, package) for m in edges), package
    assert _crossings(edges, BELOW_TRAINER) == []
    # A chain is seen: the measures' validation through the trainer's evaluation would be one.
    chained = {**edges, "characters_jax.lipsync.generate": edges["characters_jax.lipsync.generate"]
               | {"characters_jax.train.evaluate"}}
    assert ("characters_jax.gate.sessions", "characters_jax.train.evaluate") in _crossings(chained, BELOW_TRAINER)
