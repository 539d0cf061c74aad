"""`bin/characters-jax` runs the CLI with the repository's .venv, as the README's commands
are written, and says what to do where there is none; each package registers its commands."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from characters_jax.cli import COMMAND_MODULES, build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
WRAPPER = ROOT / "bin" / "characters-jax"
# The commands of the programs that share the service, and the package that registers each.
COMMANDS = {"serve": "serving", "decode-serve": "decoder", "talk": "client", "view": "viewer", "demo": "demo"}


def test_the_wrapper_runs_the_cli_of_the_repositorys_venv():
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("this checkout has no .venv (make test creates it)")
    assert os.access(WRAPPER, os.X_OK)
    out = subprocess.run([str(WRAPPER), "talk", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--server" in out.stdout and "--credentials" in out.stdout


def test_without_a_venv_the_wrapper_says_how_to_make_one(tmp_path):
    (tmp_path / "bin").mkdir()
    copy = tmp_path / "bin" / "characters-jax"
    shutil.copy2(WRAPPER, copy)
    out = subprocess.run([str(copy), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert "run make demo or make test first" in out.stderr and str(tmp_path) in out.stderr


def test_each_package_registers_its_commands():
    for package in COMMANDS.values():
        assert f"characters_jax.{package}.commands" in COMMAND_MODULES, package
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices)
    out = subprocess.run([sys.executable, "-m", "characters_jax.cli", "decode-serve", "--listen", "0.0.0.0:1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "stays on this machine" in out.stderr  # decode-serve refuses an address off the machine
