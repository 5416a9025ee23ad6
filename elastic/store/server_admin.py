"""Users, roles and authentication of the embedded etcd, for security tests.

Part of :mod:`elastic.store.server`: :meth:`EtcdServer.add_user` and
:meth:`EtcdServer.enable_auth` call these on a channel to the server. Every
call has a 10 s deadline; gRPC errors are raised as they are (a test fixture
wants etcd's own words).
"""

from __future__ import annotations

from typing import Sequence

import grpc

from elastic.store.etcd_convert import key_range
from elastic.store.etcdpb import auth_pb2, rpc_pb2, rpc_pb2_grpc

_TIMEOUT_S = 10


def _root_metadata(auth: rpc_pb2_grpc.AuthStub, root_password: str | None):
    """The metadata of a call as root (None: authentication is off)."""
    if root_password is None:
        return None
    resp = auth.Authenticate(rpc_pb2.AuthenticateRequest(name="root", password=root_password),
                             timeout=_TIMEOUT_S)
    return (("token", resp.token),)


def add_user(channel: grpc.Channel, name: str, password: str, prefixes: Sequence[str],
             root_password: str | None) -> None:
    """Create user ``name`` and a role of the same name that grants readwrite
    on each of ``prefixes`` (every key that starts with it) and nothing else;
    as root once authentication is on (``root_password`` given)."""
    auth = rpc_pb2_grpc.AuthStub(channel)
    md = _root_metadata(auth, root_password)
    auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name=name), timeout=_TIMEOUT_S, metadata=md)
    for prefix in prefixes:
        start, end = key_range(prefix, True)
        perm = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE,
                                   key=start, range_end=end)
        auth.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(name=name, perm=perm),
                                 timeout=_TIMEOUT_S, metadata=md)
    auth.UserAdd(rpc_pb2.AuthUserAddRequest(name=name, password=password),
                 timeout=_TIMEOUT_S, metadata=md)
    auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=name, role=name),
                       timeout=_TIMEOUT_S, metadata=md)


def enable_auth(channel: grpc.Channel, root_password: str) -> None:
    """Create the root user (with the root role) and turn authentication on."""
    auth = rpc_pb2_grpc.AuthStub(channel)
    auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name="root"), timeout=_TIMEOUT_S)
    auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="root", password=root_password),
                 timeout=_TIMEOUT_S)
    auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"),
                       timeout=_TIMEOUT_S)
    auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=_TIMEOUT_S)
