"""Alembic environment and revisions of the Postgres schema of `buffered_store`.

Run them with ``bufstore db upgrade`` or `buffered_store.stores.migrate.upgrade`; no
``alembic.ini`` is needed. Revisions create their objects in the configured schema.
"""
