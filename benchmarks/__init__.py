"""The benchmark harness: the buffered store against the direct Postgres store, side by side.

Run ``bufstore bench SCENARIO`` (or ``python -m benchmarks SCENARIO``); see
`benchmarks.cli` and ``docs/benchmarks.md``.
"""
