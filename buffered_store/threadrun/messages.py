"""Moved to `buffered_store.model.messages` (the thread-run data model the inner stores share
with this front-end); kept so that imports from here keep working."""

from buffered_store.model.messages import *  # noqa: F403
