"""Give a job its own etcd user, and turn etcd's authentication on: idempotently.

``python -m elastic.store.provision --etcd URL --job-id ID --user NAME
--password-file FILE --root-password-file FILE [--cacert FILE]`` makes sure
that, on that etcd:

* a ``root`` user exists with the ``root`` role (etcd needs it before
  authentication can be turned on);
* a role named like the job's user grants readwrite on ``/elastic/v1/<job>/``
  and nothing else, and the user has that role and the password in the file;
* authentication is on: from then on every request needs a user.

Run it again and nothing changes (a password that changed is set anew), so
it suits a Kubernetes Job that may be retried (``deploy/kubernetes/base``).
Passwords come from files (a mounted Secret), never from arguments. Exit
codes: 0 done, 2 bad arguments, 3 etcd unreachable or refusing (the root
password is wrong, say).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import grpc

from elastic.errors import EXIT_BAD_INPUT, EXIT_STORE, ConfigError
from elastic.keyspace import JobKeys
from elastic.records import validate_id
from elastic.store.etcd_convert import key_range
from elastic.store.etcdpb import auth_pb2, rpc_pb2, rpc_pb2_grpc
from elastic.store.security import read_password_file

log = logging.getLogger(__name__)

ROOT = "root"
_TIMEOUT_S = 10.0
# "etcdserver: user name already exists", "role name already exists".
_EXISTS = "already exists"
_NOT_ENABLED = "authentication is not enabled"


def job_prefix(job_id: str) -> str:
    """The keys the job's role may read and write: ``/elastic/v1/<job>/``."""
    return JobKeys(job_id).prefix


class Provisioner:
    """The Auth calls of one etcd, as root once authentication is on."""

    def __init__(self, channel: grpc.Channel, root_password: str):
        self._auth = rpc_pb2_grpc.AuthStub(channel)
        self._root_password = root_password
        self._metadata: tuple | None = None

    def _call(self, method: str, request, *, exists_ok: bool = False):
        try:
            return getattr(self._auth, method)(request, timeout=_TIMEOUT_S,
                                               metadata=self._metadata)
        except grpc.RpcError as exc:
            if exists_ok and _EXISTS in (exc.details() or ""):
                return None
            raise

    def login(self) -> bool:
        """Authenticate as root; False when authentication is not on yet."""
        try:
            resp = self._auth.Authenticate(
                rpc_pb2.AuthenticateRequest(name=ROOT, password=self._root_password),
                timeout=_TIMEOUT_S)
        except grpc.RpcError as exc:
            if _NOT_ENABLED in (exc.details() or ""):
                return False
            raise
        self._metadata = (("token", resp.token),)
        return True

    def ensure_user(self, name: str, password: str, prefixes: list[str]) -> None:
        """User ``name`` with ``password`` and a role of the same name that
        grants readwrite on ``prefixes`` (each a key prefix)."""
        self._call("RoleAdd", rpc_pb2.AuthRoleAddRequest(name=name), exists_ok=True)
        for prefix in prefixes:
            start, end = key_range(prefix, True)
            self._call("RoleGrantPermission", rpc_pb2.AuthRoleGrantPermissionRequest(
                name=name, perm=auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE,
                                                    key=start, range_end=end)))
        if self._call("UserAdd", rpc_pb2.AuthUserAddRequest(name=name, password=password),
                      exists_ok=True) is None:
            self._call("UserChangePassword",
                       rpc_pb2.AuthUserChangePasswordRequest(name=name, password=password))
        self.grant_role(name, name)

    def grant_role(self, user: str, role: str) -> None:
        self._call("UserGrantRole", rpc_pb2.AuthUserGrantRoleRequest(user=user, role=role))

    def enable(self) -> None:
        self._call("AuthEnable", rpc_pb2.AuthEnableRequest())


def provision(channel: grpc.Channel, *, job_id: str, user: str, password: str,
              root_password: str) -> None:
    """Make the job's user and turn authentication on (see the module docstring).
    Raises grpc.RpcError when etcd refuses (a wrong root password)."""
    validate_id("job id", job_id)
    p = Provisioner(channel, root_password)
    enabled = p.login()
    if not enabled:
        p.ensure_user(ROOT, root_password, [])  # its role of the same name: etcd's root
    p.ensure_user(user, password, [job_prefix(job_id)])
    if not enabled:
        p.enable()


def _channel(endpoint: str, cacert: str | None) -> grpc.Channel:
    target = endpoint.split("://", 1)[-1].rstrip("/")
    if not endpoint.startswith("https://"):
        return grpc.insecure_channel(target)
    ca = None
    if cacert:
        with open(cacert, "rb") as f:
            ca = f.read()
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s provision %(message)s")
    p = argparse.ArgumentParser(prog="python -m elastic.store.provision",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--etcd", required=True, help="one etcd endpoint, http:// or https://")
    p.add_argument("--cacert", help="CA bundle of etcd's server certificate (https)")
    p.add_argument("--job-id", required=True)
    p.add_argument("--user", required=True, help="the job's etcd user")
    p.add_argument("--password-file", required=True, help="the job user's password")
    p.add_argument("--root-password-file", required=True, help="etcd's root password")
    p.add_argument("--wait", type=float, default=300.0,
                   help="wait this long for etcd to answer (seconds)")
    args = p.parse_args(argv)
    try:
        password = read_password_file(args.password_file)
        root_password = read_password_file(args.root_password_file)
        validate_id("job id", args.job_id)
    except ConfigError as exc:
        print(f"provision: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    deadline = time.monotonic() + args.wait
    while True:
        try:
            with _channel(args.etcd, args.cacert) as channel:
                provision(channel, job_id=args.job_id, user=args.user, password=password,
                          root_password=root_password)
            break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                print(f"provision: etcd at {args.etcd} refused: {exc.code().name}: "
                      f"{exc.details()}", file=sys.stderr)
                return EXIT_STORE
            log.info("etcd at %s is not up yet (%s); trying again.", args.etcd, exc.details())
            time.sleep(2.0)
    log.info("etcd at %s: user %s may read and write %s only; authentication is on.",
             args.etcd, args.user, job_prefix(args.job_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
