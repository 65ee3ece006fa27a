"""The benchmark harness: the buffered store against the direct Postgres store, side by side.

Run ``bufstore bench SCENARIO`` (or ``python -m buffered_store.benchmarks SCENARIO``); see
`buffered_store.benchmarks.cli` and ``docs/benchmarks.md``. The repository keeps this
package in the top-level ``benchmarks/`` folder; it is installed as
``buffered_store.benchmarks``, so its modules import each other relatively.
"""

PACKAGE = __name__
"""The name this package was imported under (``buffered_store.benchmarks`` when installed),
for the modules it starts in subprocesses (``python -m``) and imports lazily."""
