"""Checkpoints of a training stage: orbax for the train state, JSON for the host's record.

A stage directory holds `step-NNNNNNN/` (orbax: the TrainState as a tree) with its
`step-NNNNNNN.json` (the stage's host record: planned steps, loss history, elapsed time,
...) written after the orbax commit; the newest complete pair is what a rerun resumes from,
and only the last `keep` pairs stay. `done.json` marks a finished stage.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil

import jax

_STEP = re.compile(r"^step-(\d{7})\.json$")


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def write_json(path: pathlib.Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class StageStore:
    """Saves and restores one stage's train state under `directory`."""

    def __init__(self, directory, keep: int = 2):
        self.dir = pathlib.Path(directory).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint (orbax directory and record), oldest first."""
        out = []
        for p in self.dir.iterdir():
            m = _STEP.match(p.name)
            if m and (self.dir / f"step-{m.group(1)}").is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def save(self, step: int, state, record: dict) -> None:
        path = self.dir / f"step-{step:07d}"
        if path.exists():
            shutil.rmtree(path)
        ckpt = _checkpointer()
        ckpt.save(path, state)
        ckpt.wait_until_finished()
        write_json(self.dir / f"step-{step:07d}.json", {**record, "step": step})
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.dir / f"step-{old:07d}", ignore_errors=True)
            (self.dir / f"step-{old:07d}.json").unlink(missing_ok=True)

    def restore_latest(self, like) -> tuple[object, dict] | None:
        """(state, record) of the newest checkpoint, restored onto the structure, shapes and
        dtypes of `like` (a state or its abstract tree); None when there is none."""
        steps = self.steps()
        if not steps:
            return None
        step = steps[-1]
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
        state = _checkpointer().restore(self.dir / f"step-{step:07d}", target)
        record = json.loads((self.dir / f"step-{step:07d}.json").read_text())
        return state, record

    @property
    def done(self) -> dict | None:
        p = self.dir / "done.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def mark_done(self, record: dict) -> None:
        write_json(self.dir / "done.json", record)
