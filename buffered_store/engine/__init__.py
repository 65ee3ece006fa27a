"""The engine: what buffering a thread's writes means, whatever the writes are.

The append with a per-thread compare-and-set (`appender`), reading a thread's entries
back (`threadlog`), the pending-thread index (`pending`), what a flush asks of the store
behind it (`flushing`), and the names of things on the WAL (`keys`). It imports no
client library and no front-end: the stream and the key-value bucket reach it through
the ports it is given.
"""
