"""What torchrun's command line means to the ``etcd3`` rendezvous: one validated, frozen value.

torchrun hands a rendezvous backend ``--rdzv-endpoint``, ``--rdzv-id``,
``--nnodes MIN:MAX``, ``--local-addr`` and the ``key=value`` pairs of
``--rdzv-conf``; :func:`settings_from_conf` turns them into
:class:`HandlerSettings` or raises one :class:`~elastic.errors.ConfigError`
line naming the option. The ``--rdzv-conf`` keys are :data:`CONF_KEYS`, the
one table of them: the timeouts keep the names torch's c10d backend gives them,
the TLS and user keys the names of our ``--etcd-*`` flags
(:mod:`elastic.store.security`, whose validation they go through). Unknown keys
are refused, never ignored: a typo in a timeout would otherwise run the job
with the default.

No torch here: the handler (:mod:`elastic.torchrun.handler`) passes plain values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from elastic.errors import ConfigError
from elastic.rendezvous.api import (
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_SETTLE_S,
    RendezvousConfig,
    cap_text,
    valid_host,
    validate_id,
)
from elastic.store.etcd_endpoints import parse_endpoint_urls
from elastic.store.security import PASSWORD_ENV, EtcdSecurity, security_from_options

BACKEND = "etcd3"  # the --rdzv-backend name, and what get_backend() answers
DEFAULT_CLOSE_TIMEOUT_S = 30.0  # torch's c10d default


@dataclass(frozen=True)
class ConfKey:
    """One ``--rdzv-conf`` key: its name, what it sets, and whether it is seconds."""

    name: str
    help: str
    seconds: bool = False


CONF_KEYS: tuple[ConfKey, ...] = (
    ConfKey("join_timeout", "seconds next_rendezvous waits for a round that includes this "
                            "node (default: torchrun's --rdzv-timeout)", seconds=True),
    ConfKey("timeout", "torchrun's --rdzv-timeout, which torchrun always passes (900 s "
                       "unless given); the join timeout when join_timeout is not given",
            seconds=True),
    ConfKey("last_call_timeout", f"once MIN nodes are present, the round closes when no node "
                                 f"arrived for this long (default {DEFAULT_SETTLE_S:g} s)",
            seconds=True),
    ConfKey("close_timeout", "seconds set_closed and shutdown may take to mark the rendezvous "
                             f"closed (default {DEFAULT_CLOSE_TIMEOUT_S:g} s)", seconds=True),
    ConfKey("heartbeat", "the TTL of each node's etcd lease: a node whose keep-alives stop is "
                         f"out of the rendezvous this long after (default "
                         f"{DEFAULT_LEASE_TTL_S:g} s, at least 1)", seconds=True),
    ConfKey("cacert", "PEM bundle of the CAs that sign etcd's certificate (as --etcd-cacert)"),
    ConfKey("cert", "PEM client certificate for etcd, with key= (as --etcd-cert)"),
    ConfKey("key", "the client certificate's private key (as --etcd-key)"),
    ConfKey("user", f"etcd user; its password comes from {PASSWORD_ENV} or password_file= "
                    "(as --etcd-user)"),
    ConfKey("password_file", "file holding the etcd user's password (as --etcd-password-file)"),
)
_KNOWN = {k.name: k for k in CONF_KEYS}
# Keys of torch's other backends that users bring along, and what to write instead.
_INSTEAD = {
    "keep_alive_interval": "heartbeat=SECONDS (the lease TTL)",
    "keep_alive_max_attempt": "heartbeat=SECONDS (the lease TTL)",
    "ca_cert": "cacert=", "ssl_cert": "cert=", "ssl_cert_key": "key=",
    "protocol": "https:// endpoints (or cacert=, which makes bare endpoints TLS)",
}


@dataclass(frozen=True)
class HandlerSettings:
    """Everything the ``etcd3`` handler needs, validated.

    ``host``: where this node's workers can be reached by the others (rank 0's
    is the workers' MASTER_ADDR). ``endpoints``: the etcd endpoints as given.
    """

    run_id: str
    endpoints: str
    min_nodes: int
    max_nodes: int
    host: str
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    last_call_s: float = DEFAULT_SETTLE_S
    close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S
    heartbeat_s: float = DEFAULT_LEASE_TTL_S
    security: EtcdSecurity = EtcdSecurity()

    def rendezvous_config(self) -> RendezvousConfig:
        """The job's :class:`RendezvousConfig`: ``--rdzv-id`` is the job id.

        Restart requests from the handler never count as failures, so the
        budget fields keep their defaults: torchrun's ``--max-restarts`` owns it.
        """
        return RendezvousConfig(job_id=self.run_id, min_nodes=self.min_nodes,
                                max_nodes=self.max_nodes, settle_s=self.last_call_s,
                                lease_ttl_s=self.heartbeat_s, join_timeout_s=self.join_timeout_s)


def _seconds(name: str, value: Any) -> float:
    text = value if isinstance(value, str) else repr(value)
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"--rdzv-conf {name}={cap_text(text, 64)}: expected a number of "
                          "seconds >= 0")
    return seconds


def settings_from_conf(*, run_id: str, endpoint: str, min_nodes: int, max_nodes: int,
                       local_addr: str | None, conf: Mapping[str, Any], default_host: str,
                       environ: Mapping[str, str] | None = None) -> HandlerSettings:
    """Validate torchrun's rendezvous arguments (see the module docstring).

    ``default_host`` is this node's address when ``--local-addr`` is not
    given; ``environ`` (default ``os.environ``) may hold the etcd password.

    Raises:
        ConfigError: an unknown or malformed ``--rdzv-conf`` key, an invalid
            ``--rdzv-id``, no or a malformed ``--rdzv-endpoint``, a bad
            ``--local-addr``, ``--nnodes`` out of order, or TLS and user
            options that :mod:`elastic.store.security` refuses.
    """
    unknown = sorted(set(conf) - set(_KNOWN), key=str)
    if unknown:
        name = cap_text(str(unknown[0]), 64)
        hint = (f"; write {_INSTEAD[name]} instead" if name in _INSTEAD
                else f"; the {BACKEND} backend takes {', '.join(sorted(_KNOWN))}")
        raise ConfigError(f"--rdzv-conf: unknown key {name!r}{hint}")
    validate_id("--rdzv-id", run_id)
    if not str(endpoint or "").strip():
        raise ConfigError(f"the {BACKEND} rendezvous needs --rdzv-endpoint "
                          "HOST[:PORT][,HOST[:PORT]...]: the etcd cluster's client endpoints")
    try:
        parse_endpoint_urls(endpoint)
    except ConfigError as exc:
        raise ConfigError(f"--rdzv-endpoint: {exc}") from None
    host = local_addr or default_host
    if not valid_host(host):
        what = "--local-addr" if local_addr else "this machine's name (no --local-addr given)"
        raise ConfigError(f"{what} {cap_text(host, 64)!r}: expected a host name or an IP "
                          "address the other nodes can reach; give --local-addr")
    if not 1 <= min_nodes <= max_nodes:
        raise ConfigError(f"--nnodes {min_nodes}:{max_nodes}: need 1 <= MIN <= MAX")

    seconds = {k: _seconds(k, v) for k, v in conf.items() if _KNOWN[k].seconds}
    join_key = "join_timeout" if "join_timeout" in seconds else "timeout"
    join = seconds.get(join_key, DEFAULT_JOIN_TIMEOUT_S)
    close = seconds.get("close_timeout", DEFAULT_CLOSE_TIMEOUT_S)
    heartbeat = seconds.get("heartbeat", DEFAULT_LEASE_TTL_S)
    for name, value in ((join_key, join), ("close_timeout", close)):
        if value <= 0:
            raise ConfigError(f"--rdzv-conf {name}={value:g}: must be more than 0 seconds")
    if heartbeat < 1:
        raise ConfigError(f"--rdzv-conf heartbeat={heartbeat:g}: the lease TTL must be at "
                          "least 1 second (etcd's smallest)")
    try:
        security = security_from_options(
            cacert=conf.get("cacert"), cert=conf.get("cert"), key=conf.get("key"),
            user=conf.get("user"), password_file=conf.get("password_file"), environ=environ)
    except ConfigError as exc:
        raise ConfigError(f"--rdzv-conf: {exc} (in --rdzv-conf: cacert=, cert=, key=, user=, "
                          "password_file=)") from None
    return HandlerSettings(
        run_id=run_id, endpoints=endpoint, min_nodes=min_nodes, max_nodes=max_nodes, host=host,
        join_timeout_s=join,
        last_call_s=seconds.get("last_call_timeout", DEFAULT_SETTLE_S),
        close_timeout_s=close,
        heartbeat_s=heartbeat, security=security)
