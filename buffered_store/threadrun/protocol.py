"""Moved to `buffered_store.model.protocol` (the thread-run data model the inner stores share
with this front-end); kept so that imports from here keep working."""

from buffered_store.model.protocol import *  # noqa: F403
