"""Structured logs: ``key=value`` text or one JSON object a line.

Messages are written as ``what key=value key=value`` already; the JSON form
splits those pairs into fields. Nothing is logged per block at INFO.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_PAIR = re.compile(r"(\w+)=('(?:[^']*)'|\S+)")


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = f"ts={ts} level={record.levelname.lower()} logger={record.name} msg={record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": message,
        }
        first = _PAIR.search(message)
        if first is not None:
            out["msg"] = message[: first.start()].strip()
        for key, value in _PAIR.findall(message):
            out.setdefault(key, value.strip("'"))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
