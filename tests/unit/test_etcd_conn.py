"""The etcd connection's rules, without an etcd: call-with-token (a refused
token is renewed once, then the call is made once more), error translation,
counting, and calls after close."""

from __future__ import annotations

import grpc
import pytest

from elastic.errors import StoreAuthError, StoreError, StoreTimeoutError, StoreUnavailableError
from elastic.store.api import OpCounter
from elastic.store.etcd_conn import EtcdConnection, call_with_token
from elastic.store.etcdpb import rpc_pb2


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = ""):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


REFUSED = FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")
DOWN = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")


class Tokens:
    """A token source that hands out t1, t2, ... on each refresh."""

    def __init__(self) -> None:
        self.token = "t1"
        self.refreshed: list[str | None] = []

    def refresh(self, refused: str | None) -> None:
        self.refreshed.append(refused)
        self.token = f"t{len(self.refreshed) + 1}"


def _run(answers, tokens: Tokens):
    """call_with_token over an attempt that answers from ``answers`` (an
    exception is raised); returns (result, tokens the attempts carried)."""
    seen: list[str | None] = []

    def attempt(token):
        seen.append(token)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    result = call_with_token(attempt, current_token=lambda: tokens.token,
                             token_refused=lambda exc: exc is REFUSED, refresh=tokens.refresh)
    return result, seen


def test_an_accepted_token_is_used_once():
    tokens = Tokens()
    assert _run(["ok"], tokens) == ("ok", ["t1"])
    assert tokens.refreshed == []


def test_a_refused_token_is_renewed_once_and_the_call_made_again_with_the_fresh_one():
    tokens = Tokens()
    assert _run([REFUSED, "ok"], tokens) == ("ok", ["t1", "t2"])
    assert tokens.refreshed == ["t1"]  # the refused token, so concurrent callers share one renewal


def test_a_second_refusal_is_raised_not_renewed_again():
    tokens = Tokens()
    with pytest.raises(grpc.RpcError) as info:
        _run([REFUSED, REFUSED, "never"], tokens)
    assert info.value is REFUSED and tokens.refreshed == ["t1"]


def test_other_errors_are_raised_without_a_renewal():
    tokens = Tokens()
    with pytest.raises(grpc.RpcError) as info:
        _run([DOWN, "never"], tokens)
    assert info.value is DOWN and tokens.refreshed == []


def test_a_failed_renewal_is_raised():
    def refuse(_token):
        raise StoreAuthError("etcd refused user trainer")

    with pytest.raises(StoreAuthError, match="refused user trainer"):
        call_with_token(lambda token: (_ for _ in ()).throw(REFUSED), current_token=lambda: None,
                        token_refused=lambda exc: True, refresh=refuse)


@pytest.fixture
def conn():
    # No call reaches the address: the methods below are fakes; the channel
    # connects only when a real call is made.
    c = EtcdConnection("http://127.0.0.1:9", request_timeout_s=1.0, connect_timeout_s=1.0,
                       security=None, ops=OpCounter())
    yield c
    c.close()


def _raising(exc):
    def method(request, timeout=None, metadata=None):
        raise exc

    return method


@pytest.mark.parametrize("exc, error, text", [
    (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED), StoreTimeoutError,
     "did not complete txn within 1.0 s"),
    (FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: user name is empty"),
     StoreAuthError, "requires authentication"),
    (FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "permission denied"), StoreAuthError,
     "permission denied for txn of '/k'"),
    (FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "nope"), StoreError, "failed txn"),
])
def test_errors_are_translated_with_the_cause_chained(conn, exc, error, text):
    request = rpc_pb2.TxnRequest(compare=[rpc_pb2.Compare(key=b"/k")])
    with pytest.raises(error, match=text) as info:
        conn.call("txn", _raising(exc), request, timeout_s=None, retry=False)
    assert info.value.__cause__ is exc


def test_without_a_user_a_refused_token_is_not_renewed(conn):
    assert not conn.uses_auth and not conn.token_refused(REFUSED)
    with pytest.raises(StoreAuthError, match="requires authentication"):
        conn.refresh_token(None)


def test_unavailable_is_retried_within_the_deadline_and_counted(conn):
    answers = [DOWN, DOWN, rpc_pb2.RangeResponse()]

    def method(request, timeout=None, metadata=None):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    conn.call("get", method, rpc_pb2.RangeRequest(key=b"/k"), timeout_s=5.0, retry=True)
    assert conn.ops.snapshot() == {"get": 1, "retry": 2}


def test_unavailable_is_not_retried_when_the_call_may_have_been_applied(conn):
    with pytest.raises(StoreUnavailableError, match=r"unavailable \(txn\)"):
        conn.call("txn", _raising(DOWN), rpc_pb2.TxnRequest(), timeout_s=None, retry=False)
    assert conn.ops.snapshot() == {"txn": 1}


def test_a_closed_connection_refuses_calls(conn):
    conn.close()
    with pytest.raises(StoreError, match="is closed"):
        conn.call("get", _raising(DOWN), rpc_pb2.RangeRequest(), timeout_s=None, retry=True)
