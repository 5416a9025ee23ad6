"""One log adapter that carries the job, the node and the round on every line.

Messages are whole sentences; the adapter prefixes ``job J node N round R:``
so no caller formats that by hand.
"""

from __future__ import annotations

import logging
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

    def process(self, msg, kwargs):
        number = self._round_of()
        kwargs["extra"] = {**self.extra, "round": number, **kwargs.get("extra", {})}
        return f"job {self.extra['job']} node {self.extra['node']} round {number}: {msg}", kwargs
