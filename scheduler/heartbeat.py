"""A running job's heartbeat: `heartbeat`, the thread body that tells the store, every few seconds,
that the job is still its scheduler's, and notices when it is not (cancelled, or taken over)."""

from __future__ import annotations

import logging
import threading

from db.outage import DatabaseUnavailable
from db.store import ResultStore
from farm.core import metrics
from farm.core.errors import one_line

log = logging.getLogger("farm.scheduler")


def heartbeat(store: ResultStore, scheduler_id: str, job_id: int, every: float, done: threading.Event,
              lost: threading.Event) -> None:
    """Every `every` seconds until `done`: say the job is still scheduler `scheduler_id`'s. When the
    store says it is not (cancelled, or requeued after heartbeats that did not arrive and then
    claimed by another scheduler), set `lost`: the job stops here, so that it does not run twice."""
    while not done.wait(every):
        try:
            if not store.heartbeat(job_id, scheduler_id) and not lost.is_set():
                log.warning("job %d is no longer this scheduler's (cancelled, or requeued and taken over): "
                            "stopping it here", job_id)
                lost.set()
            metrics.heartbeat()
            # While a job runs too, or the jobs-by-state panel and the no-trials alert see it queued.
            metrics.set_jobs(store.job_counts())
        except DatabaseUnavailable as e:  # past the outage bound: the job's own calls fail too, and say so
            log.debug("heartbeat for job %d skipped: %s", job_id, e)
        except Exception as e:  # a database hiccup must not kill the job
            log.warning("heartbeat for job %d failed: %s", job_id, one_line(e))
