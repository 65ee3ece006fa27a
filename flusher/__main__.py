"""``python -m flusher``: the same as ``bufstore flusher``."""

from __future__ import annotations

from flusher.cli import flusher_command

if __name__ == "__main__":
    flusher_command(prog_name="python -m flusher")
