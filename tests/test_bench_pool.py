"""`bench` sizes the GPU pool from the memory plan before JAX starts its backend (the pool
is fixed when the backend starts): checked on the CPU, where the plan sets no pool, by
asserting the order in a fresh process."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    from jax._src import xla_bridge
    from characters_jax.serving import placement
    from characters_jax.measure import bench
    from characters_jax.cli import main

    original = placement.size_generator_pool
    calls = []

    def checked(*args, **kwargs):
        calls.append(xla_bridge.backends_are_initialized())
        return original(*args, **kwargs)

    placement.size_generator_pool = checked
    rc = main(["bench", "--config", "tiny", "--steps", "2", "--set", "bench.warmup=1", "--set", "bench.quiet=true", "--json", sys.argv[1]])
    print("CALLS", calls)
    sys.exit(rc)
""")


def test_bench_sizes_the_pool_before_the_backend_starts(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CALLS [False]" in proc.stdout, proc.stdout  # called once, with no backend yet
    assert json.loads(out.read_text())["step_ms"]["p50"] > 0
