"""Log formats for the command line: one line per event, with job, step, stage and micro-batch.

Code logs context as ``extra={"job": ..., "step": ..., "rank": ..., "microbatch": ...}``; the
formatters show whichever are present. Only ``pipesvc.cli`` installs them.
"""

from __future__ import annotations

import json
import logging
import time

CONTEXT_FIELDS = ("job", "step", "rank", "microbatch", "stage")


def _context(record: logging.LogRecord) -> dict[str, object]:
    return {k: getattr(record, k) for k in CONTEXT_FIELDS if hasattr(record, k)}


class TextFormatter(logging.Formatter):
    """``time level logger [pid] message key=value ...``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = _context(record)
        if context:
            line += " " + " ".join(f"{k}={v}" for k, v in context.items())
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, pid, message, context, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
            **_context(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def install(level: str, fmt: str) -> None:
    """Sends the root logger's records to stderr in ``fmt`` (``text`` or ``json``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
