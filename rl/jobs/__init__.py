"""Queue-decoupled agent jobs: an HTTP API, a Redis Streams broker, a SQLite database, autoscaled agent workers.

A job is one multi-turn episode of an environment task, run asynchronously by an agent worker
against the served policy; its turn-by-turn events and token-level episode go to the database,
where clients poll or stream them and training can read them (docs/jobs.md).
"""
