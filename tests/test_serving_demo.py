"""`make demo`'s command on this checkout: worker + decoder + client, small config."""

import json
import subprocess
import sys

from characters_jax.client.mp4 import probe_mp4
from characters_jax.processes import child_env


def test_demo_writes_the_mp4_and_report(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "characters_jax.cli", "demo", "--config", "small", "--out", str(out)], env=child_env(4), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "demo: OK" in proc.stdout and "sustained fps" in proc.stdout
    report = json.loads((out / "demo_report.json").read_text())
    probe = probe_mp4(out / "demo.mp4")
    assert probe["video_frames"] == report["expected_frames"] == 72  # 3 s of speech = 18 steps x 4 frames
    assert probe["audio_streams"] == 1 and abs(probe["audio_seconds"] - 3.0) < 0.1
    assert (probe["width"], probe["height"]) == (96, 64)
    assert report["session_state"] == "COMPLETED" and report["worker_exit_code"] == 0
