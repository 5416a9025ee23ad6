"""elastic.store.provision on a real etcd: the job's user is limited to its
prefix, authentication is on, and running it again changes nothing (the
Kubernetes base runs it as a Job that may be retried)."""

from __future__ import annotations

import uuid

import pytest

from elastic.errors import StoreError
from elastic.store import EtcdSecurity, open_store
from elastic.store.provision import main as provision_main
from elastic.store.server import EtcdServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

AUTH_ARGS = ("--auth-token", "simple", "--bcrypt-cost", "4")


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(data_dir=str(tmp_path / "data"), log_path=str(tmp_path / "etcd.log"),
                        unsafe_no_fsync=True, extra_args=AUTH_ARGS).start()
    try:
        yield server
    finally:
        server.stop()


def test_the_jobs_user_gets_its_prefix_only_and_a_second_run_changes_nothing(etcd, tmp_path):
    job_password, root_password = uuid.uuid4().hex, uuid.uuid4().hex
    (tmp_path / "job").write_text(job_password + "\n")
    (tmp_path / "root").write_text(root_password + "\n")
    argv = ["--etcd", etcd.endpoint, "--job-id", "train", "--user", "elasticd-train",
            "--password-file", str(tmp_path / "job"), "--root-password-file",
            str(tmp_path / "root"), "--wait", "5"]
    assert provision_main(argv) == 0
    assert provision_main(argv) == 0  # authentication on already: as root, nothing new

    user = EtcdSecurity(user="elasticd-train", password=job_password)
    with open_store(etcd.endpoint, connect_timeout_s=5, security=user) as store:
        store.put("/elastic/v1/train/requests/x", b"1")
        assert store.get("/elastic/v1/train/requests/x").value == b"1"
        with pytest.raises(StoreError, match="permission denied"):
            store.put("/elastic/v1/other-job/requests/x", b"1")
    # Without a user: what drained nodes through an open etcd.
    with pytest.raises(StoreError):
        with open_store(etcd.endpoint, connect_timeout_s=3) as anonymous:
            anonymous.put("/elastic/v1/train/requests/drain/n1", b"{}")
    # A wrong root password: refused, exit 3.
    (tmp_path / "root").write_text("wrong\n")
    assert provision_main(argv) == 3


def test_a_missing_password_file_is_bad_input(tmp_path):
    assert provision_main(["--etcd", "http://127.0.0.1:1", "--job-id", "train", "--user", "u",
                           "--password-file", str(tmp_path / "none"),
                           "--root-password-file", str(tmp_path / "none")]) == 2
