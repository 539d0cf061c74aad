"""espeak-ng (GPL-3) stays out of the serving path, and the lip-sync measure loads without it."""

import json
import subprocess
import sys

_PROBE = r"""
import importlib, json, pkgutil, sys
import characters_jax
loaded = []
for pkg in PACKAGES:
    mod = importlib.import_module(pkg)
    loaded.append(pkg)
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), pkg + "."):
        importlib.import_module(info.name)
        loaded.append(info.name)
EXTRA
maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
print(json.dumps({"loaded": loaded, "jax_loaded": "jax" in sys.modules, "espeak_modules": sorted(m for m in sys.modules if "espeak" in m),
                  "speech_modules": sorted(m for m in sys.modules if m.startswith("characters_jax.data.")),
                  "libespeak_mapped": "libespeak" in maps}))
"""


def _run(packages, extra=""):
    code = _PROBE.replace("PACKAGES", repr(packages)).replace("EXTRA", extra)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_serving_engine_and_decoder_never_load_espeak():
    r = _run(["characters_jax.serving", "characters_jax.client", "characters_jax.wire", "characters_jax.engine", "characters_jax.decoder"])
    assert "characters_jax.serving.server" in r["loaded"] and "characters_jax.engine.step" in r["loaded"]
    assert r["espeak_modules"] == [] and not r["libespeak_mapped"]
    assert r["speech_modules"] == []


def test_the_lipsync_measure_loads_and_scores_without_espeak():
    extra = """
import numpy as np
from characters_jax.lipsync.probe import load_probe
from characters_jax.lipsync.score import score
from characters_jax.lipsync.identity import describe
frames = np.full((40, 64, 96, 3), 128, np.uint8)
s = score(frames, np.zeros(40), load_probe("mouth"))
assert s.peak == 0.0 and s.lag == 0
describe(frames[:2], load_probe("identity"))
"""
    r = _run(["characters_jax.lipsync.probe"], extra)
    assert r["espeak_modules"] == [] and not r["libespeak_mapped"]
    assert "characters_jax.data.speech" not in r["speech_modules"]


def test_data_workers_do_not_load_jax():
    """The planning side of the data (what the writer's worker processes import) needs no jax, so
    the workers never touch an accelerator and may fork espeak-ng children."""
    r = _run(["characters_jax.data.shards", "characters_jax.data.clips", "characters_jax.data.speech"])
    assert not r["jax_loaded"]
