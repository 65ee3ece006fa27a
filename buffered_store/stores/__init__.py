"""The inner stores a `BufferedThreadRunStore` writes through to: in memory and Postgres."""
