"""The etcd store while its server does not answer: a real etcd, frozen with SIGSTOP."""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic.errors import StoreError
from elastic.store.api import DEFAULT_REQUEST_TIMEOUT_S
from elastic.store.etcd import EtcdStore
from tests.proctable import stopped
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration]

LEASE_TTL_S = 3.0


def test_probing_a_lease_to_resume_gives_up_after_a_third_of_its_ttl(own_etcd):
    # After an outage, a node resumes its lease only if etcd kept it. The probe
    # must not hold the rendezvous loop for the store's whole request timeout:
    # the loop asks again on its next pass, and the first answer after etcd is
    # back must come before the peers conclude this node is the one cut off.
    store = EtcdStore(own_etcd.endpoint)
    try:
        session = store.session(LEASE_TTL_S)
        os.kill(own_etcd.pid, signal.SIGSTOP)
        # Else, on a loaded machine, a thread of etcd still running could answer.
        wait_until(lambda: stopped(own_etcd.pid), 5, "etcd stopped")

        started = time.monotonic()
        with pytest.raises(StoreError):
            store.resume_session(session.lease_id, LEASE_TTL_S)
        waited = time.monotonic() - started

        # Its own short timeout (a third of the TTL), not the default request timeout.
        assert LEASE_TTL_S / 3 * 0.9 <= waited < DEFAULT_REQUEST_TIMEOUT_S, waited
        os.kill(own_etcd.pid, signal.SIGCONT)
        resumed = store.resume_session(session.lease_id, LEASE_TTL_S)
        assert resumed is not None and resumed.lease_id == session.lease_id
        resumed.close()
    finally:
        os.kill(own_etcd.pid, signal.SIGCONT)  # a frozen etcd would not stop
        store.close()
