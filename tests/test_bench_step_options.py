"""tools/bench_step_options.py on CPU: the step compiled under two option sets from one
lowering, the same latent from the same state, its report and JSON; bad sets rejected."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import bench_step_options  # noqa: E402


def test_two_option_sets_on_the_tiny_share(tmp_path, capsys):
    out = tmp_path / "options.json"
    rc = bench_step_options.main(["--config", "tiny", "--share", "2", "--sets", "default,cb_min1",
                                  "--steps", "1", "--rounds", "1", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["config"] == "tiny-share-of-tp2"
    assert r["latent_equal_to_first"] == {"default": True, "cb_min1": True}
    assert all(r["latent_finite"].values())
    assert [len(v) for v in r["step_ms"].values()] == [1, 1]
    assert r["ratio_to_first"]["default"] == 1.0
    assert "cb_min1" in capsys.readouterr().out


def test_unknown_sets_and_uneven_shares_are_refused(capsys):
    assert bench_step_options.main(["--config", "tiny", "--sets", "default,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert bench_step_options.main(["--config", "tiny", "--share", "5"]) == 2
    assert "--share 5" in capsys.readouterr().err
