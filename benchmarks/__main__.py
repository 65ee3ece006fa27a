"""`python -m benchmarks SCENARIO [options]`: the same as `bufstore bench`."""

from benchmarks.cli import bench

bench(prog_name="python -m benchmarks")
