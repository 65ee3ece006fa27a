"""Helper programs the end-to-end tests start as separate OS processes."""
