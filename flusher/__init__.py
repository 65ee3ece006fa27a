"""The flusher: drains the WAL of the buffered store into its inner store.

Run it embedded (``async with Flusher(inner, config): ...``) or as its own process
(``bufstore flusher`` / ``python -m flusher``); any number of processes may share the
durable consumer.
"""

from __future__ import annotations

from flusher.config import FlusherConfig
from flusher.service import Flusher

__all__ = ["Flusher", "FlusherConfig"]
