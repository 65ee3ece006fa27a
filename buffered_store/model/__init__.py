"""The thread-run data model, shared by the inner stores (`buffered_store.stores`) and the
thread-run front-end (`buffered_store.threadrun`): records and the `ThreadRunStore`
protocol (`records`, `protocol`), canonical messages and snapshot deltas (`messages`),
checkpoint validation and the change a checkpoint makes (`checkpointing`, `changes`),
coalescing changes against a stored watermark (`planning`), and the `FlushTarget` seam an
inner store implements (`target`). Pure: no I/O, no client library, no front-end.
"""
