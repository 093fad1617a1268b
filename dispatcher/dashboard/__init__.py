"""The live dashboard: a small aiohttp app that shows each run from Valkey alone (never PostgreSQL).

view.py reads the keys (contract.keys: the shims' progress and budgets, the dispatcher's live view and pool
pacing) into pydantic views; app.py serves them as JSON, as server-sent events and as one page.
`python -m dispatcher dashboard`, or with a run when backend.dashboard = true.
"""
