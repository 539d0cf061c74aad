"""A client-only environment for a voice-agent framework whose protobuf range excludes the
worker's (pipecat-ai 1.14 needs protobuf >=5.29.6,<7; the worker pins 7.36.2).

    python -m characters_jax.integrations.client_env .venv-pipecat pipecat

makes a virtual environment at the path with the framework and the client's own
requirements (`REQUIREMENTS[name]`, resolved by pip together, its report in
`pip-install.log` there), and puts the client library on its path: a tree
`client/characters_jax/` of links to this checkout's client-side packages (client, wire,
config, audio, integrations; no worker, engine or model code) and `protos_gen` generated
there by that environment's grpcio-tools 1.69.0, whose code declares protobuf 5.29.0 and so
loads on every protobuf runtime from 5.29 to 7.x. A `.pth` file adds the tree to the
environment. The environment is made once: `.ready` there holds the requirements it was
made with and a digest of protos/, and a change remakes it (the stubs alone when only the
protos changed). Exit code 0 when ready; otherwise a message on stderr
(pip's own, for a registry that cannot be reached) and exit code 1.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "characters_jax"
CLIENT_PACKAGES = ("client", "wire", "config", "audio", "integrations")
PROTO_TOOLS = "grpcio-tools==1.69.0"  # protoc 29: the code it writes declares protobuf 5.29.0
# pipecat: with what its SmallWebRTCTransport needs (its `webrtc` extra less opencv, which only
# its video input uses), at the viewer's pins (pyproject's `view` extra).
REQUIREMENTS = {
    "pipecat": ("pipecat-ai==1.14.0", "grpcio==1.84.0", PROTO_TOOLS, "numpy>=2.1,<2.6",
                "aiortc==1.16.0", "aioice==0.13.0", "av>=14,<20"),
}
READY = ".ready"


def python_of(venv: pathlib.Path) -> pathlib.Path:
    return venv / "bin" / "python"


def _protos_digest() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted((ROOT / "protos").glob("*.proto")))).hexdigest()


def _stamp(name: str) -> str:
    return "\n".join(REQUIREMENTS[name]) + f"\nprotos {_protos_digest()}"


def is_ready(venv: pathlib.Path, name: str) -> bool:
    stamp = venv / READY
    return stamp.exists() and stamp.read_text() == _stamp(name)


def _installed(venv: pathlib.Path, name: str) -> bool:
    """The requirements are installed (the stubs may be older than the protos)."""
    stamp = venv / READY
    return stamp.exists() and stamp.read_text().rpartition("\nprotos ")[0] == "\n".join(REQUIREMENTS[name])


def _generate_stubs(venv: pathlib.Path) -> None:
    out = venv / "client" / "characters_jax" / "protos_gen"
    subprocess.run([str(python_of(venv)), str(PACKAGE / "protos_build.py"), "--out", str(out)], check=True, stdout=subprocess.DEVNULL)


def _site_packages(py: pathlib.Path) -> pathlib.Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    return pathlib.Path(out)


def build(venv: pathlib.Path, name: str) -> None:
    """Makes (or remakes) the environment. Raises RuntimeError with what failed."""
    requirements = REQUIREMENTS[name]
    if venv.exists():
        shutil.rmtree(venv)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    py = python_of(venv)
    log = venv / "pip-install.log"
    with open(log, "w") as f:
        done = subprocess.run([str(py), "-m", "pip", "install", "--progress-bar", "off", *requirements], stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-6:])
        raise RuntimeError(f"pip could not install {' '.join(requirements)} (exit {done.returncode}; {log}):\n{tail}")
    tree = venv / "client" / "characters_jax"
    tree.mkdir(parents=True)
    shutil.copy(PACKAGE / "__init__.py", tree / "__init__.py")
    for pkg in CLIENT_PACKAGES:
        (tree / pkg).symlink_to(PACKAGE / pkg, target_is_directory=True)
    _generate_stubs(venv)
    (_site_packages(py) / "characters_jax_client.pth").write_text(str(venv / "client") + "\n")
    (venv / READY).write_text(_stamp(name))


def ensure(venv: pathlib.Path, name: str) -> pathlib.Path:
    """The environment's interpreter, made first when missing or stale."""
    if is_ready(venv, name):
        return python_of(venv)
    if _installed(venv, name):  # only the protos changed
        _generate_stubs(venv)
        (venv / READY).write_text(_stamp(name))
    else:
        build(venv, name)
    return python_of(venv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[1] not in REQUIREMENTS:
        print(f"usage: python -m characters_jax.integrations.client_env VENV {{{','.join(REQUIREMENTS)}}}", file=sys.stderr)
        return 2
    try:
        ensure(pathlib.Path(argv[0]).resolve(), argv[1])
    except (RuntimeError, subprocess.CalledProcessError) as err:
        print(f"client environment {argv[0]}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
