"""The farm's database layer: models, engine from a URL, migrations, result store and writer.

Start with `db.store.open_store(url)`; see `db.store.ResultStore` for the contract. The package
imports nothing itself, so `python -m db.migrate` runs its module once, cleanly.
"""
