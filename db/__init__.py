"""The farm's database layer: models, engine from a URL, migrations, result store and writer.

Start with `db.store.open_store(url)`; see `db.base.ResultStore` for the contract and
`db.sql_store.SQLResultStore` for its implementation.
The package imports nothing itself, so `python -m db.migrate` runs its module once, cleanly.
"""
