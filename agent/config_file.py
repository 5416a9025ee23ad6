"""elasticd's YAML file of options (``--config``): read as text, checked for size and keys.

The file's scalars are read as the text they were written as, whatever they
look like, and each option parses its own (:mod:`agent.config`), exactly as it
parses a flag: YAML 1.1 would otherwise read ``nnodes: 2:4`` as the base-60
integer 124, ``job_id: 0123`` as 83 and ``node_id: 1e3`` as 1000.0.
"""

from __future__ import annotations

from typing import Any, Collection

import yaml

from elastic.errors import ConfigError
from elastic.records import cap_text

# A file of options is a few hundred bytes; this much is already no such file.
MAX_CONFIG_FILE_BYTES = 1 << 20


class _TextLoader(yaml.SafeLoader):
    """A SafeLoader that reads every plain scalar as a string, except an empty
    one or ``null``/``~`` (None: the option is not given); see the module docstring."""


_TextLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag in ("tag:yaml.org,2002:null", "tag:yaml.org,2002:merge")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def read_file(path: str, known: Collection[str]) -> dict[str, Any]:
    """The options in the YAML file at ``path``, keys in snake case, values as
    written (strings, lists of strings); keys left empty are dropped. Raises
    ConfigError when it cannot be read, is larger than MAX_CONFIG_FILE_BYTES,
    is not UTF-8 text, not YAML (or nested too deeply to parse), is not a
    mapping or has keys not in ``known`` (snake case)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc.strerror}") from exc
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(f"cannot read config file {path!r}: {exc}") from exc
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"config file {path!r} is larger than {MAX_CONFIG_FILE_BYTES} bytes; "
                          "a file of options is a few hundred")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_TextLoader) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: "
                          f"{cap_text(str(exc), 500)}") from exc
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"config file {path!r} is nested too deeply to be a file of "
                          "options") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r}: expected a mapping of options, got "
                          f"{type(data).__name__}")
    allowed = set(known)
    unknown = sorted(cap_text(repr(str(k).replace("-", "_")), 64) for k in data
                     if str(k).replace("-", "_") not in allowed)
    if unknown:
        shown = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if unknown[10:]
                                           else "")
        raise ConfigError(f"config file {path!r}: unknown option(s) {shown}; "
                          f"known: {', '.join(sorted(allowed))}")
    return {str(k).replace("-", "_"): v for k, v in data.items() if v is not None}
