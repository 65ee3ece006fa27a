"""The `ThreadRunStore` conformance suite, shared by every store implementation.

Subclass `ThreadRunStoreContract` (in `suite`) in a test module and provide the two
fixtures it documents; every behaviour of the protocol then runs against your store.
"""
