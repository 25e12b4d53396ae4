"""Where jobs, tasks, trials, rounds and cost models live: `open_store`, the one factory.

`open_store(url)` migrates the database to the current schema and returns a
`db.sql_store.SQLResultStore`, which serves SQLite and Postgres alike. The contract,
`ResultStore`, is in `db.base`; it is importable from here too, as every caller does.
"""

from __future__ import annotations

from db.base import TASK_KEYS, TRIAL_COLUMNS, ResultStore
from db.migrate import upgrade
from db.sql_store import SQLResultStore

__all__ = ["TASK_KEYS", "TRIAL_COLUMNS", "ResultStore", "SQLResultStore", "open_store"]


def open_store(url: str | None = None) -> ResultStore:
    """The store at `url` (None: ``$FARM_DB``, else ``sqlite:///farm.db``), schema migrated to head.

    Raises FarmError, with one line saying what to do, if the database cannot be opened.
    """
    store = SQLResultStore(url)
    upgrade(store.engine)
    return store
