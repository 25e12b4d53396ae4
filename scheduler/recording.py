"""How the jobs of a scheduler ended, recorded in the store: `JobEnds`.

A job ends finished (done, failed, cancelled) or given back (queued again). When the database is
unavailable past the outage bound (db.outage), the end is kept and recorded once it is back.
"""

from __future__ import annotations

import logging
import threading

from db.outage import DatabaseUnavailable
from db.store import ResultStore

log = logging.getLogger("farm.scheduler")


class JobEnds:
    """The ends of scheduler `scheduler_id`'s jobs, recorded in `store` or kept in `unrecorded`
    (job id -> (status, error)) until the database is back. Thread safe: job threads and the
    service's own record."""

    def __init__(self, store: ResultStore, scheduler_id: str) -> None:
        self.store, self.scheduler_id = store, scheduler_id
        # Jobs that ended while the database was unavailable: job id -> (status, error) to record.
        self.unrecorded: dict[int, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def record(self, job_id: int, status: str, error: str) -> None:
        """Record how a job of this scheduler ended: finished, or queued again (given back). If the
        database is unavailable past the outage bound, keep it for `record_unrecorded`."""
        with self._lock:
            self.unrecorded[job_id] = (status, error)
        try:
            self.record_unrecorded()
        except DatabaseUnavailable:
            log.info("job %d ended %s; it is recorded once the database is back", job_id, status)

    def record_unrecorded(self) -> None:
        """Record the ends of jobs kept by `record`; DatabaseUnavailable if it is still unavailable
        (the job kept), any other error as it comes (the job dropped: retrying would not help)."""
        with self._lock:  # job threads and the service's own
            self._record_unrecorded_locked()

    def _record_unrecorded_locked(self) -> None:
        for job_id, (status, error) in list(self.unrecorded.items()):
            del self.unrecorded[job_id]
            try:
                if status == "queued":
                    self.store.give_back(job_id, self.scheduler_id)
                    log.info("job %d given back (queued, its trials kept)", job_id)
                else:
                    # Only while it is still ours: requeued and claimed by another meanwhile, it is theirs.
                    self.store.finish_job(job_id, status, error, scheduler_id=self.scheduler_id)
            except DatabaseUnavailable:
                self.unrecorded[job_id] = (status, error)
                raise
