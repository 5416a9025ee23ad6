"""Reading the small secret files an operator points an option at: PEM bundles, passwords.

One reader for the agents' TLS files (``--tls-*``) and etcd's (``--etcd-*``):
a bounded read (these files are never large; a huge one is a mistake, not
something to hold in memory) and one clear :class:`~elastic.errors.ConfigError`
naming the file, its option and what it was meant to be.
"""

from __future__ import annotations

from elastic.errors import ConfigError

MAX_FILE_BYTES = 1 << 20  # a PEM bundle or a password, never more than this


def read_small_file(path: str, flag: str, what: str) -> bytes:
    """The content of ``path``, given with ``flag`` as ``what`` (e.g. "etcd CA bundle").

    Raises:
        ConfigError: it cannot be read, or is larger than :data:`MAX_FILE_BYTES`.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path} ({flag}): "
                          f"{exc.strerror or exc}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"the {what} {path} ({flag}) is larger than 1 MiB")
    return data


def read_pem(path: str | None, flag: str, what: str) -> bytes | None:
    """The PEM content of ``path``, or None when no path was given.

    Raises:
        ConfigError: as :func:`read_small_file`, or the file holds no PEM block.
    """
    if path is None:
        return None
    data = read_small_file(path, flag, what)
    if b"-----BEGIN " not in data:
        raise ConfigError(f"the {what} {path} ({flag}) is not a PEM file")
    return data
