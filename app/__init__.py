"""app: the service's shared pieces (settings, the job store, storage, sources,
submission, the scheduler, webhooks) and, on top of them, ``app.api``: the FastAPI routes,
auth, limits, docs, metrics and the /ui pages.

The HTTP process imports ``app.api`` and never torch; the worker imports the shared pieces
and never ``app.api`` (import contracts in pyproject.toml).
"""
