"""torchrun's ``--rdzv-conf`` keys: the one table of what each means, and its one reader.

torchrun hands ``--rdzv-conf KEY=VALUE,...`` to its rendezvous backend as
written; torch's backends each read their own keys and ignore the rest. Two
of ours read them: elasticd, from a torchrun command line
(:mod:`agent.torchrun_cli` maps each :class:`Setting` onto an elasticd
option), and the ``etcd3`` handler torchrun itself loads
(:mod:`elastic.torchrun.settings`). Both go through :func:`read_rdzv_conf`,
so a key means the same thing, and a mistake gets the same line, through
either.

The keys keep torch 2.13's spellings (``torch/distributed/elastic/rendezvous/``):

- ``join_timeout`` (the dynamic rendezvous of the c10d and etcd-v2
  backends), ``timeout`` (the etcd backend's; torchrun also passes it always,
  900 s unless given): how long a node waits to be in a round. When both are
  given, ``join_timeout`` wins, as in torch's dynamic rendezvous.
- ``last_call_timeout``: once MIN nodes are present, the round closes when
  no node arrived for this long.
- ``keep_alive_interval``, ``keep_alive_max_attempt``: torch's dead-node
  rule, no keep-alive for interval x attempts (defaults 5 s and 3): our lease
  TTL is their product.
- ``read_timeout`` (the etcd-v2 and c10d backends' client timeout): how long
  reaching etcd may take.
- ``close_timeout``: how long marking the rendezvous closed may take.
- ``heartbeat_timeout`` (how long one of torch's keep-alive writes may take):
  accepted, nothing to set: our lease keep-alives carry their own deadlines.
- ``cacert``/``ca_cert``, ``cert``/``ssl_cert``, ``key``/``ssl_cert_key``:
  the etcd TLS files, in the etcd and the etcd-v2 backend's spellings;
  ``user`` and ``password_file`` are ours (torch's backends have no etcd
  user); ``protocol``: ``http`` or ``https`` for bare endpoints.
- :data:`C10D_KEYS`: the c10d backend's TCP store, which an etcd replaces.

Anything else is refused, never ignored: a typo in a timeout would otherwise
run the job with the default. ``heartbeat``, listed in torch's docstring but
read by no torch code (it reads ``heartbeat_timeout``), is refused with what
to write for the lease TTL.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

from elastic.errors import ConfigError
from elastic.options import Parser, non_negative, positive
from elastic.records import cap_text
from elastic.rendezvous.config import MIN_LEASE_TTL_S
from elastic.store.security import PASSWORD_ENV


class Setting(enum.Enum):
    """What a key sets; the value is how a line names it."""

    JOIN_TIMEOUT = "the join timeout"
    LAST_CALL = "the last call (settle) window"
    LEASE_TTL = "the lease TTL"
    CONNECT_TIMEOUT = "the etcd connect timeout"
    CLOSE_TIMEOUT = "the close timeout"
    CACERT = "the etcd CA bundle"
    CERT = "the etcd client certificate"
    KEY = "the etcd client key"
    USER = "the etcd user"
    PASSWORD_FILE = "the etcd password file"
    PROTOCOL = "the scheme of bare etcd endpoints"


def _text(name: str, raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigError(f"--{name} {cap_text(repr(raw), 80)}: expected text")
    return raw.strip()


def _protocol(name: str, raw: Any) -> str:
    text = str(raw).strip().lower()
    if text not in ("http", "https"):
        raise ConfigError(f"--{name} {cap_text(repr(raw), 80)}: expected http or https")
    return text


@dataclass(frozen=True)
class ConfKey:
    """One key: torch's spelling, what it sets (None: nothing), how its value
    is parsed, and what it means. ``fallback``: it sets its setting only when
    no other key of that setting is given (torchrun passes ``timeout`` always)."""

    name: str
    setting: Setting | None
    parse: Parser
    help: str
    fallback: bool = False


KEEP_ALIVE = ("keep_alive_interval", "keep_alive_max_attempt")
KEEP_ALIVE_DEFAULTS = (5.0, 3)  # torch's: a node is dead after 15 s without a keep-alive

CONF_KEYS: tuple[ConfKey, ...] = (
    ConfKey("join_timeout", Setting.JOIN_TIMEOUT, positive(float),
            "seconds a node waits for a round that includes it"),
    ConfKey("timeout", Setting.JOIN_TIMEOUT, positive(float),
            "torch's etcd spelling of join_timeout, which torchrun always passes (900 s "
            "unless given); join_timeout wins", fallback=True),
    ConfKey("last_call_timeout", Setting.LAST_CALL, non_negative(float),
            "once MIN nodes are present, the round closes when no node arrived for this "
            "many seconds"),
    ConfKey(KEEP_ALIVE[0], Setting.LEASE_TTL, positive(float),
            "seconds between keep-alives; the lease TTL is interval x attempts (torch's "
            f"dead-node rule; {KEEP_ALIVE_DEFAULTS[0]:g} when only the other is given)"),
    ConfKey(KEEP_ALIVE[1], Setting.LEASE_TTL, positive(int),
            "keep-alives missed before a node is gone; the lease TTL is interval x attempts "
            f"({KEEP_ALIVE_DEFAULTS[1]} when only the other is given)"),
    ConfKey("read_timeout", Setting.CONNECT_TIMEOUT, positive(float),
            "seconds reaching etcd may take"),
    ConfKey("close_timeout", Setting.CLOSE_TIMEOUT, positive(float),
            "seconds marking the rendezvous closed may take"),
    ConfKey("heartbeat_timeout", None, positive(float),
            "seconds one of torch's keep-alive writes may take: nothing to set, the lease "
            "keep-alives carry their own deadlines"),
    ConfKey("cacert", Setting.CACERT, _text,
            "PEM bundle of the CAs that sign etcd's certificate"),
    ConfKey("ca_cert", Setting.CACERT, _text, "torch's etcd-v2 spelling of cacert"),
    ConfKey("cert", Setting.CERT, _text, "PEM client certificate for etcd, with key="),
    ConfKey("ssl_cert", Setting.CERT, _text, "torch's etcd-v2 spelling of cert"),
    ConfKey("key", Setting.KEY, _text, "the client certificate's private key"),
    ConfKey("ssl_cert_key", Setting.KEY, _text, "torch's etcd-v2 spelling of key"),
    ConfKey("user", Setting.USER, _text,
            f"etcd user; its password from {PASSWORD_ENV} or password_file="),
    ConfKey("password_file", Setting.PASSWORD_FILE, _text,
            "file holding the etcd user's password"),
    ConfKey("protocol", Setting.PROTOCOL, _protocol,
            "http or https: the scheme of endpoints given without one"),
)
# torch's c10d backend's own keys: its TCP store, which an etcd replaces.
C10D_KEYS = ("is_host", "store_type", "use_libuv")
_BY_NAME = {k.name: k for k in CONF_KEYS}
KNOWN_KEYS = tuple(sorted([*_BY_NAME, *C10D_KEYS]))
# Keys users bring along that no torch backend we follow reads here: what to write instead.
_HINTS = {
    "heartbeat": "not read by torch: the lease TTL is keep_alive_interval x "
                 "keep_alive_max_attempt",
    "etcd_prefix": "the rendezvous keeps its keys under /elastic/v1/<job id>/: separate "
                   "jobs by --rdzv-id",
}
_MAX_UNKNOWN_SHOWN = 8


@dataclass(frozen=True)
class Given:
    """A setting as the conf gave it: the key(s) as written (``join_timeout``,
    ``keep_alive_interval*keep_alive_max_attempt``) and the parsed value."""

    spelling: str
    value: Any


def read_rdzv_conf(conf: Mapping[str, Any]) -> dict[Setting, Given]:
    """Each setting ``conf`` gives, with its parsed value.

    Every key's value is parsed, also of keys that set nothing, so a value is
    refused the same way wherever it goes. The lease TTL is the product of the
    keep-alive keys (torch's default for one not given). :data:`C10D_KEYS`
    are accepted here and set nothing: whether they may be given is the
    caller's (:func:`c10d_refusal`).

    Raises:
        ConfigError: an unknown key (the line lists the known ones), a value
            its key refuses (naming ``--rdzv-conf KEY``), two spellings of one
            setting (``cacert`` and ``ca_cert``), or a lease TTL under
            :data:`~elastic.rendezvous.config.MIN_LEASE_TTL_S`.
    """
    unknown = sorted((str(k) for k in conf if k not in _BY_NAME and k not in C10D_KEYS))
    if unknown:
        shown = [cap_text(repr(k), 64) + (f" ({_HINTS[k]})" if k in _HINTS else "")
                 for k in unknown[:_MAX_UNKNOWN_SHOWN]]
        more = unknown[_MAX_UNKNOWN_SHOWN:]
        raise ConfigError(f"--rdzv-conf: unknown key(s) {', '.join(shown)}"
                          f"{f' and {len(more)} more' if more else ''}; "
                          f"known: {', '.join(KNOWN_KEYS)}")
    parsed = {k.name: k.parse(f"rdzv-conf {k.name}", conf[k.name])
              for k in CONF_KEYS if k.name in conf}
    given: dict[Setting, Given] = {}
    for setting in Setting:
        keys = [k for k in CONF_KEYS if k.setting is setting and k.name in conf]
        if setting is Setting.LEASE_TTL:
            if keys:
                given[setting] = _lease_ttl(parsed)
            continue
        chosen = [k for k in keys if not k.fallback] or keys
        if len(chosen) > 1:
            raise ConfigError(f"--rdzv-conf {' and '.join(k.name for k in chosen)} both set "
                              f"{setting.value}: give one")
        if chosen:
            given[setting] = Given(chosen[0].name, parsed[chosen[0].name])
    return given


def _lease_ttl(parsed: Mapping[str, Any]) -> Given:
    interval, attempts = (parsed.get(k, d) for k, d in zip(KEEP_ALIVE, KEEP_ALIVE_DEFAULTS))
    ttl = interval * attempts
    spelling = "*".join(KEEP_ALIVE)
    if ttl < MIN_LEASE_TTL_S:
        raise ConfigError(f"--rdzv-conf {spelling} {interval:g}*{attempts}: the lease TTL "
                          f"must be at least {MIN_LEASE_TTL_S:g} s (etcd's smallest)")
    return Given(spelling, float(ttl))


def c10d_refusal(conf: Mapping[str, Any]) -> ConfigError | None:
    """The error for :data:`C10D_KEYS` in ``conf`` when the job meets through
    etcd (they configure the TCP store etcd replaces), or None without them."""
    keys = [k for k in C10D_KEYS if k in conf]
    if not keys:
        return None
    return ConfigError(f"--rdzv-conf {', '.join(keys)}: settings of torch's c10d rendezvous, "
                       "not of an etcd one: drop them")


def with_protocol(endpoints: str, protocol: str | None) -> str:
    """``endpoints`` with ``protocol://`` before each bare ``host:port``.

    Raises ConfigError for an endpoint whose own scheme is another."""
    if protocol is None:
        return endpoints
    parts = [p.strip() for p in endpoints.split(",") if p.strip()]
    for p in parts:
        if "://" in p and not p.lower().startswith(protocol + "://"):
            raise ConfigError(f"--rdzv-conf protocol={protocol} but the endpoint "
                              f"{cap_text(repr(p), 80)} says otherwise: give one")
    return ",".join(p if "://" in p else f"{protocol}://{p}" for p in parts)
