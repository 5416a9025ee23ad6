"""Conversions between the store's types and etcd's protobuf messages.

Part of the etcd backend (:mod:`elastic.store.etcd`). Pure functions, no I/O.
Keys are str in the store and bytes in etcd; they round-trip through UTF-8
with surrogateescape, so keys that are not valid UTF-8 survive too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.store.api import (
    Compare,
    CompareTarget,
    Delete,
    EventType,
    Get,
    KeyValue,
    Op,
    Put,
    WatchEvent,
)
from elastic.store.etcdpb import kv_pb2, rpc_pb2

if TYPE_CHECKING:
    import grpc

_COMPARE_RESULT = {
    "==": rpc_pb2.Compare.EQUAL,
    "!=": rpc_pb2.Compare.NOT_EQUAL,
    "<": rpc_pb2.Compare.LESS,
    ">": rpc_pb2.Compare.GREATER,
}
_COMPARE_TARGET = {
    CompareTarget.VERSION: (rpc_pb2.Compare.VERSION, "version"),
    CompareTarget.CREATE_REVISION: (rpc_pb2.Compare.CREATE, "create_revision"),
    CompareTarget.MOD_REVISION: (rpc_pb2.Compare.MOD, "mod_revision"),
    CompareTarget.VALUE: (rpc_pb2.Compare.VALUE, "value"),
}


def key_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def key_range(key: str, prefix: bool) -> tuple[bytes, bytes]:
    """(key, range_end) for one key or, by etcd's rule, every key under a prefix."""
    raw = key_bytes(key)
    if not prefix:
        return raw, b""
    end = bytearray(raw)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return raw, bytes(end)
        end.pop()
    # "" or all 0xff bytes: everything from the key on ("\0" means "no end").
    return raw or b"\0", b"\0"


def to_kv(m: kv_pb2.KeyValue) -> KeyValue:
    return KeyValue(
        key=m.key.decode("utf-8", "surrogateescape"),
        value=bytes(m.value),
        create_revision=m.create_revision,
        mod_revision=m.mod_revision,
        version=m.version,
        lease=m.lease,
    )


def to_event(m: kv_pb2.Event) -> WatchEvent:
    kind = EventType.DELETE if m.type == kv_pb2.Event.DELETE else EventType.PUT
    return WatchEvent(kind, to_kv(m.kv))


def range_request(key: str, prefix: bool) -> rpc_pb2.RangeRequest:
    """Read one key, or every key under a prefix sorted by key."""
    start, end = key_range(key, prefix)
    return rpc_pb2.RangeRequest(
        key=start,
        range_end=end,
        sort_order=rpc_pb2.RangeRequest.ASCEND if prefix else rpc_pb2.RangeRequest.NONE,
        sort_target=rpc_pb2.RangeRequest.KEY,
    )


def put_request(key: str, value: bytes, lease: int) -> rpc_pb2.PutRequest:
    return rpc_pb2.PutRequest(key=key_bytes(key), value=bytes(value), lease=lease)


def delete_request(key: str, prefix: bool) -> rpc_pb2.DeleteRangeRequest:
    start, end = key_range(key, prefix)
    return rpc_pb2.DeleteRangeRequest(key=start, range_end=end)


def compare_pb(c: Compare) -> rpc_pb2.Compare:
    """Raises TypeError: the operand's type does not fit the compare's target."""
    c.check_operand()
    target, field = _COMPARE_TARGET[c.target]
    m = rpc_pb2.Compare(key=key_bytes(c.key), target=target, result=_COMPARE_RESULT[c.op])
    if c.target is CompareTarget.VALUE:
        m.value = bytes(c.operand)
    else:
        # Setting the oneof member, even to 0, is what tells etcd the operand.
        setattr(m, field, c.operand)
    return m


def op_pb(op: Op) -> rpc_pb2.RequestOp:
    """Raises TypeError: ``op`` is not a Put, Delete or Get."""
    if isinstance(op, Put):
        return rpc_pb2.RequestOp(request_put=put_request(op.key, op.value, op.lease))
    if isinstance(op, Delete):
        return rpc_pb2.RequestOp(request_delete_range=delete_request(op.key, op.prefix))
    if isinstance(op, Get):
        return rpc_pb2.RequestOp(request_range=range_request(op.key, op.prefix))
    raise TypeError(f"not a transaction op: {op!r}")


def op_result(r: rpc_pb2.ResponseOp):
    """One entry of :attr:`TxnResult.results`: KeyValues, a deleted count, or None."""
    which = r.WhichOneof("response")
    if which == "response_range":
        return [to_kv(kv) for kv in r.response_range.kvs]
    if which == "response_delete_range":
        return r.response_delete_range.deleted
    return None


def rpc_error_text(exc: grpc.RpcError) -> str:
    """``"CODE: details"`` of a failed call, for error messages and logs."""
    code = exc.code()
    name = code.name if code is not None else "UNKNOWN"
    return f"{name}: {exc.details()}"
