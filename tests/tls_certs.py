"""Test certificates, made with trustme when a test runs: a job CA, an agent
certificate naming 127.0.0.1, operators' client certificates (two with a
common name), and the same from a second, unrelated CA."""

from __future__ import annotations

import dataclasses
import os

import trustme


@dataclasses.dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclasses.dataclass(frozen=True)
class Certs:
    ca: str  # the job's CA bundle
    agent: Pair  # names 127.0.0.1 and localhost, signed by ``ca``
    operator: Pair  # a client certificate signed by ``ca``
    other_ca: str  # an unrelated CA
    stranger: Pair  # a certificate naming 127.0.0.1, signed by ``other_ca``
    named: Pair  # names only "elasticd.test" (for --tls-server-name), signed by ``ca``
    # Client certificates signed by ``ca`` with common names "ops-alice" and
    # "ops-mallory" (for --tls-allowed-cn).
    alice: Pair | None = None
    mallory: Pair | None = None


def _write(cert: trustme.LeafCert, directory: str, name: str) -> Pair:
    pair = Pair(os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}-key.pem"))
    with open(pair.cert, "wb") as f:
        f.write(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(pair.key)
    os.chmod(pair.key, 0o600)
    return pair


def make_certs(directory: str) -> Certs:
    """Write the certificates under ``directory`` (which exists)."""
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(os.path.join(directory, "ca.pem"))
    other.cert_pem.write_to_path(os.path.join(directory, "other-ca.pem"))
    return Certs(
        ca=os.path.join(directory, "ca.pem"),
        agent=_write(ca.issue_cert("127.0.0.1", "localhost"), directory, "agent"),
        operator=_write(ca.issue_cert("operator@example.test"), directory, "operator"),
        other_ca=os.path.join(directory, "other-ca.pem"),
        stranger=_write(other.issue_cert("127.0.0.1", "localhost"), directory, "stranger"),
        named=_write(ca.issue_cert("elasticd.test"), directory, "named"),
        alice=_write(ca.issue_cert("alice@example.test", common_name="ops-alice"), directory,
                     "alice"),
        mallory=_write(ca.issue_cert("mallory@example.test", common_name="ops-mallory"),
                       directory, "mallory"),
    )
