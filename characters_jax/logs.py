"""Structured logs: one JSON object per line on stderr.

`log.info("msg", extra={"fields": {...}})` adds the fields to the object; every line has
ts (unix seconds), level, logger, process and msg.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class JsonFormatter(logging.Formatter):
    def __init__(self, process_name: str):
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(time.time(), 3), "level": record.levelname.lower(), "logger": record.name, "process": self.process_name, "pid": os.getpid(), "msg": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(process_name: str, level: str = "info") -> None:
    """Routes the `characters_jax` loggers to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process_name))
    root = logging.getLogger("characters_jax")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
