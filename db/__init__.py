"""The farm's database layer: models, engine from a URL, migrations, result store and writer.

Start with `open_store(url)`; see `ResultStore` for the contract.
"""

from db.engine import make_engine, session_factory
from db.migrate import upgrade
from db.store import ResultStore, SQLResultStore, open_store
from db.writer import ResultWriter

__all__ = [
    "ResultStore",
    "ResultWriter",
    "SQLResultStore",
    "make_engine",
    "open_store",
    "session_factory",
    "upgrade",
]
