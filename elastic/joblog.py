"""One log adapter that carries the job, the node and the round on every line.

Messages are whole sentences; the adapter prefixes ``job J node N round R:``
so no caller formats that by hand. :class:`JsonFormatter` writes the same
lines as JSON objects (``elasticd --log-format json``).
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from typing import Callable


class JobLogger(logging.LoggerAdapter):
    """``log.info("workers stopped")`` logs ``job j node n round 4: workers stopped``.

    ``round_of`` is called for each line (the round moves on); the fields are
    also set on the record (``job``, ``node``, ``round``) for structured handlers.
    """

    def __init__(self, logger: logging.Logger, job_id: str, node_id: str,
                 round_of: Callable[[], int] = lambda: 0):
        super().__init__(logger, {"job": job_id, "node": node_id})
        self._round_of = round_of

    def at_round(self, number: int) -> "JobLogger":
        """This logger for lines about round ``number``, whichever is current."""
        return JobLogger(self.logger, self.extra["job"], self.extra["node"], lambda: number)

    def process(self, msg, kwargs):
        number = self._round_of()
        kwargs["extra"] = {**self.extra, "round": number, **kwargs.get("extra", {})}
        return f"job {self.extra['job']} node {self.extra['node']} round {number}: {msg}", kwargs


_PREFIX = re.compile(r"job (?P<job>\S+) node (?P<node>\S+)(?: round (?P<round>\d+))?: ")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``job``, ``node``, ``round``, ``message`` and, for an exception, ``exc``.

    Lines from a :class:`JobLogger` carry their own job, node and round (and
    lose the ``job J node N round R:`` prefix, which the fields repeat); other
    lines get ``job`` and ``node`` given here and the round ``round_of``
    returns at the time of the line (or the one a hand-formatted ``job J node
    N round R:`` prefix names; the prefix is dropped).
    """

    def __init__(self, job_id: str, node_id: str, round_of: Callable[[], int] = lambda: 0):
        super().__init__()
        self._job = job_id
        self._node = node_id
        self.round_of = round_of  # may be set later: the agent that knows it is built after

    def format(self, record: logging.LogRecord) -> str:
        job = getattr(record, "job", self._job)
        node = getattr(record, "node", self._node)
        number = getattr(record, "round", None)
        message = record.getMessage()
        # Lines formatted by hand ("job J node N [round R]: ...") say it once, in the fields.
        prefix = _PREFIX.match(message)
        if prefix and prefix["job"] == job and prefix["node"] == node:
            message = message[prefix.end():]
            if number is None and prefix["round"]:
                number = int(prefix["round"])
        if number is None:
            number = self.round_of()
        line = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "level": record.levelname, "logger": record.name, "job": job, "node": node,
                "round": number, "message": message}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)
