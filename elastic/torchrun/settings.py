"""What torchrun's command line means to the ``etcd3`` rendezvous: one validated, frozen value.

torchrun hands a rendezvous backend ``--rdzv-endpoint``, ``--rdzv-id``,
``--nnodes MIN:MAX``, ``--local-addr`` and the ``key=value`` pairs of
``--rdzv-conf``; :func:`settings_from_conf` turns them into
:class:`HandlerSettings` or raises one :class:`~elastic.errors.ConfigError`
line naming the option. The ``--rdzv-conf`` keys, and what each sets, are
those of :mod:`elastic.torchrun.conf`, the table elasticd reads a torchrun
command line with too: a key means the same thing to both. The TLS and user
keys go through :mod:`elastic.store.security`, as elasticd's ``--etcd-*``
flags do.

No torch here: the handler (:mod:`elastic.torchrun.handler`) passes plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from elastic.errors import ConfigError
from elastic.records import cap_text, valid_host, validate_id
from elastic.rendezvous.config import (
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_SETTLE_S,
    RendezvousConfig,
)
from elastic.store.api import DEFAULT_CONNECT_TIMEOUT_S
from elastic.store.etcd_endpoints import parse_endpoint_urls
from elastic.store.security import EtcdSecurity, security_from_options
from elastic.torchrun.conf import Setting, c10d_refusal, read_rdzv_conf, with_protocol

BACKEND = "etcd3"  # the --rdzv-backend name, and what get_backend() answers
DEFAULT_CLOSE_TIMEOUT_S = 30.0  # torch's c10d default


@dataclass(frozen=True)
class HandlerSettings:
    """Everything the ``etcd3`` handler needs, validated.

    ``host``: where this node's workers can be reached by the others (rank 0's
    is the workers' MASTER_ADDR). ``endpoints``: the etcd endpoints as given,
    bare ones with ``protocol://`` when ``--rdzv-conf protocol`` is.
    """

    run_id: str
    endpoints: str
    min_nodes: int
    max_nodes: int
    host: str
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    last_call_s: float = DEFAULT_SETTLE_S
    close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    security: EtcdSecurity = EtcdSecurity()

    def rendezvous_config(self) -> RendezvousConfig:
        """The job's :class:`RendezvousConfig`: ``--rdzv-id`` is the job id.

        Restart requests from the handler never count as failures, so the
        budget fields keep their defaults: torchrun's ``--max-restarts`` owns it.
        """
        return RendezvousConfig(job_id=self.run_id, min_nodes=self.min_nodes,
                                max_nodes=self.max_nodes, settle_s=self.last_call_s,
                                lease_ttl_s=self.lease_ttl_s, join_timeout_s=self.join_timeout_s)


def settings_from_conf(*, run_id: str, endpoint: str, min_nodes: int, max_nodes: int,
                       local_addr: str | None, conf: Mapping[str, Any], default_host: str,
                       environ: Mapping[str, str] | None = None) -> HandlerSettings:
    """Validate torchrun's rendezvous arguments (see the module docstring).

    ``default_host`` is this node's address when ``--local-addr`` is not
    given; ``environ`` (default ``os.environ``) may hold the etcd password.

    Raises:
        ConfigError: what :func:`~elastic.torchrun.conf.read_rdzv_conf`
            refuses (an unknown or malformed ``--rdzv-conf`` key), c10d's keys,
            an invalid ``--rdzv-id``, no or a malformed ``--rdzv-endpoint``
            (or one ``protocol`` contradicts), a bad ``--local-addr``,
            ``--nnodes`` out of order, or TLS and user options that
            :mod:`elastic.store.security` refuses.
    """
    given = read_rdzv_conf(conf)
    refusal = c10d_refusal(conf)
    if refusal is not None:
        raise refusal

    def value(setting: Setting, default: Any = None) -> Any:
        return given[setting].value if setting in given else default

    validate_id("--rdzv-id", run_id)
    if not str(endpoint or "").strip():
        raise ConfigError(f"the {BACKEND} rendezvous needs --rdzv-endpoint "
                          "HOST[:PORT][,HOST[:PORT]...]: the etcd cluster's client endpoints")
    endpoints = with_protocol(endpoint, value(Setting.PROTOCOL))
    try:
        parse_endpoint_urls(endpoints)
    except ConfigError as exc:
        raise ConfigError(f"--rdzv-endpoint: {exc}") from None
    host = local_addr or default_host
    if not valid_host(host):
        what = "--local-addr" if local_addr else "this machine's name (no --local-addr given)"
        raise ConfigError(f"{what} {cap_text(host, 64)!r}: expected a host name or an IP "
                          "address the other nodes can reach; give --local-addr")
    if not 1 <= min_nodes <= max_nodes:
        raise ConfigError(f"--nnodes {min_nodes}:{max_nodes}: need 1 <= MIN <= MAX")
    try:
        security = security_from_options(
            cacert=value(Setting.CACERT), cert=value(Setting.CERT), key=value(Setting.KEY),
            user=value(Setting.USER), password_file=value(Setting.PASSWORD_FILE),
            environ=environ)
    except ConfigError as exc:
        raise ConfigError(f"--rdzv-conf: {exc} (here --etcd-cacert, --etcd-cert, --etcd-key, "
                          "--etcd-user and --etcd-password-file are --rdzv-conf cacert=, "
                          "cert=, key=, user= and password_file=)") from None
    return HandlerSettings(
        run_id=run_id, endpoints=endpoints, min_nodes=min_nodes, max_nodes=max_nodes,
        host=host, join_timeout_s=value(Setting.JOIN_TIMEOUT, DEFAULT_JOIN_TIMEOUT_S),
        last_call_s=value(Setting.LAST_CALL, DEFAULT_SETTLE_S),
        close_timeout_s=value(Setting.CLOSE_TIMEOUT, DEFAULT_CLOSE_TIMEOUT_S),
        lease_ttl_s=value(Setting.LEASE_TTL, DEFAULT_LEASE_TTL_S),
        connect_timeout_s=value(Setting.CONNECT_TIMEOUT, DEFAULT_CONNECT_TIMEOUT_S), security=security)
