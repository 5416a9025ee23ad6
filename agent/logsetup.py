"""elasticd's process around the agent: its one log handler, and what it
hides once the configuration is read."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

from agent import hardening
from agent.config import AgentConfig
from agent.tls import etcd_bypass_warning
from elastic.joblog import JobLogger, JsonFormatter
from elastic.store import PASSWORD_ENV


class LogSetup:
    """The agent's one log handler (stderr). Until the configuration is read
    (which itself logs, e.g. the advertised address) lines are held, then
    written in the format it asks for: text, or with ``--log-format json`` one
    JSON object per line (:class:`elastic.joblog.JsonFormatter`). The level
    comes from ELASTIC_LOG_LEVEL."""

    def __init__(self) -> None:
        self.stream = logging.StreamHandler(sys.stderr)
        self.stream.setFormatter(logging.Formatter(
            "%(asctime)s elasticd %(levelname)s: %(message)s"))
        self.held = logging.handlers.MemoryHandler(capacity=10_000,
                                                   flushLevel=logging.CRITICAL + 1)
        root = logging.getLogger()
        root.addHandler(self.held)
        level = os.environ.get("ELASTIC_LOG_LEVEL", "INFO").upper()
        root.setLevel(level if level in logging.getLevelNamesMapping() else logging.INFO)

    def configured(self, config: AgentConfig | None) -> None:
        """Write the held lines and all later ones in ``config``'s format
        (text when there is no valid configuration). Idempotent."""
        if self.held is None:
            return
        if config is not None and config.log_format == "json":
            self.stream.setFormatter(JsonFormatter(config.job_id, config.node_id))
        root = logging.getLogger()
        root.addHandler(self.stream)
        root.removeHandler(self.held)
        self.held.setTarget(self.stream)
        self.held.close()  # flushes to the target
        self.held = None

    def follow_round(self, round_of) -> None:
        """JSON lines that do not name their round get ``round_of()``."""
        if isinstance(self.stream.formatter, JsonFormatter):
            self.stream.formatter.round_of = round_of

    def close(self) -> None:
        logging.getLogger().removeHandler(self.stream)


def keep_secrets(config: AgentConfig, hidden: bool, log: JobLogger) -> None:
    """Once the config is read: the workers (user code) inherit our environment and
    must not get the etcd password (it is in ``config.etcd_security`` now); an agent
    that holds one is non-dumpable (``hidden``: made so before the config was read);
    mutual TLS over an etcd anyone may write is warned about."""
    os.environ.pop(PASSWORD_ENV, None)
    if config.etcd_security.password is not None and (hidden or hardening.make_non_dumpable()):
        log.info("The etcd password is held in memory: the agent is non-dumpable, so no "
                 "process of this user (the workers included) can read it from /proc/%d.",
                 os.getpid())
    bypass = etcd_bypass_warning(config.tls, config.etcd,
                                 etcd_tls_client=config.etcd_security.cert is not None,
                                 etcd_user=config.etcd_security.user is not None)
    if bypass is not None:
        log.warning("%s", bypass)
