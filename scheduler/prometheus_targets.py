"""Where Prometheus finds the worker actors' metrics: `publish_targets`, a file_sd file per scheduler."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from scheduler.pool import WorkerPool


def publish_targets(pools: Sequence[WorkerPool]) -> None:
    """Where Prometheus finds the worker actors' metrics: with FARM_PROMETHEUS_TARGETS (a folder
    that a Prometheus file_sd_config reads, deploy/prometheus/local.yml), one JSON file per
    scheduler listing every actor's metrics address (of `pools`), rewritten when its pools change."""
    folder = os.environ.get("FARM_PROMETHEUS_TARGETS")
    if not folder:
        return
    targets = [{"targets": [i["metrics_address"] for pool in pools
                            for i in getattr(pool, "infos", [])], "labels": {"role": "worker"}}]
    path = Path(folder) / f"workers-{os.getpid()}.json"
    tmp = path.with_suffix(f".{threading.get_ident()}.tmp")  # job threads publish too
    tmp.write_text(json.dumps(targets))
    tmp.replace(path)  # Prometheus never reads half a file
