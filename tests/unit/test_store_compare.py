"""Compare.holds: etcd's compare rule, written once for the etcd converter,
the fake store and the contract suite (which checks that etcd agrees)."""

from __future__ import annotations

import pytest

from elastic.store.api import Compare, CompareTarget, KeyValue

KV = KeyValue("/k", b"v2", create_revision=3, mod_revision=7, version=2)


@pytest.mark.parametrize("compare, expected", [
    (Compare.version("/k", "==", 2), True),
    (Compare.version("/k", ">", 2), False),
    (Compare.mod_revision("/k", "<", 8), True),
    (Compare.create_revision("/k", "!=", 3), False),
    (Compare.value("/k", "==", b"v2"), True),
    (Compare.value("/k", ">", b"v1"), True),
])
def test_a_present_key(compare, expected):
    assert compare.holds(KV) is expected


@pytest.mark.parametrize("target", [CompareTarget.VERSION, CompareTarget.CREATE_REVISION,
                                    CompareTarget.MOD_REVISION])
def test_an_absent_key_has_zeros(target):
    assert Compare("/k", target, "==", 0).holds(None)
    assert not Compare("/k", target, ">", 0).holds(None)


@pytest.mark.parametrize("op", ["==", "!=", "<", ">"])
def test_a_value_compare_on_an_absent_key_fails_whatever_the_operator(op):
    assert not Compare.value("/k", op, b"").holds(None)


@pytest.mark.parametrize("compare, text", [
    (Compare("/k", CompareTarget.VALUE, "==", 1), "a value compare needs bytes, got int"),
    (Compare("/k", CompareTarget.VERSION, "==", b"1"), "a version compare needs an int"),
    (Compare("/k", CompareTarget.MOD_REVISION, "==", True), "a mod_revision compare needs an int"),
])
def test_an_operand_of_the_wrong_type_is_refused(compare, text):
    with pytest.raises(TypeError, match=text):
        compare.holds(KV)


def test_an_unknown_operator_is_refused():
    with pytest.raises(ValueError, match="unknown compare operator"):
        Compare("/k", CompareTarget.VERSION, ">=", 1)
