"""`python -m buffered_store.benchmarks SCENARIO [options]`: the same as `bufstore bench`."""

from . import PACKAGE
from .cli import bench

bench(prog_name=f"python -m {PACKAGE}")
