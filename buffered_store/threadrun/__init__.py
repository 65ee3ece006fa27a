"""The `ThreadRunStore` front-end: threads, runs and message snapshots on the engine.

Records and the protocol (`records`, `protocol`), the WAL entry of a checkpoint and its
codec (`entry`, `messages`, `checkpointing`), coalescing entries into one change per
thread (`planning`), the flush target a store implements (`target`, or `generic` for
any other store) and the buffered decorator itself (`store`).
"""
