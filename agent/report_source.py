"""Read a job's report inputs from etcd, in one read, and build its report (I/O).

One ``get_prefix`` of the job's keys (one consistent revision): its events,
its round record, its latest checkpoint commit and its agents' status
records, then :func:`agent.report.build_report`. A record that cannot be
parsed is skipped and named in the report's history, never an error.
"""

from __future__ import annotations

import logging

from agent.report import build_report
from agent.report_model import JobReport
from agent.status_record import StatusRecord
from elastic import events
from elastic.checkpoint.etcd_log import decode_latest
from elastic.errors import MalformedRecordError
from elastic.keyspace import JobKeys
from elastic.rendezvous import round_record
from elastic.store.api import Store

log = logging.getLogger(__name__)


def read_report(store: Store, job_id: str, now: float) -> JobReport:
    """The report of ``job_id`` as etcd holds it, made at wall time ``now``.
    Raises the store's errors (StoreError)."""
    keys = JobKeys(job_id)
    kvs, _ = store.get_prefix(keys.prefix)
    parsed, unreadable = events.parse_events(
        keys, [kv for kv in kvs if kv.key.startswith(keys.events)])
    current = latest = None
    statuses: list[StatusRecord] = []
    for kv in kvs:
        try:
            if kv.key == keys.round:
                current = round_record.from_reads(keys, [kv], kvs)
            elif kv.key == keys.checkpoint_latest:
                latest = decode_latest(kv.key, kv.value)
            elif kv.key.startswith(keys.status):
                statuses.append(StatusRecord.from_json(kv.key, kv.value))
        except MalformedRecordError as exc:
            log.warning("Job %s: skipping an unreadable record in the report: %s", job_id, exc)
            unreadable.append(kv.key)
    return build_report(job_id, [event for _, event in parsed], now, current=current,
                        latest=latest, statuses=statuses, unreadable=unreadable)
