"""The error family of the project: every error we raise derives from `StoreError`.

Each class says whether retrying the same call may succeed (`retriable`). Foreign errors
(nats, SQLAlchemy, psycopg) are translated at the adapter that met them and re-raised
``from`` the original, so callers only ever catch this family.
"""

from __future__ import annotations


class StoreError(Exception):
    """The store failed."""

    retriable: bool = False

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or type(self).__name__).strip())


class ValidationError(StoreError, ValueError):
    """The input is invalid; nothing was written."""


class PayloadTooLargeError(ValidationError):
    """The checkpoint entry is larger than the WAL accepts; nothing was written."""


class RunOwnershipError(ValidationError):
    """The run id already belongs to another thread; nothing was written.

    Runs are keyed by id alone, so a run id checkpointed on a second thread would
    silently move the run. `owner_thread_id` names the thread that owns it.
    """

    def __init__(
        self, message: str | None = None, *, run_id: str = "", owner_thread_id: str = ""
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.owner_thread_id = owner_thread_id


class ThreadOwnershipError(StoreError):
    """Another writer claimed the thread; this one may no longer write to it.

    Raised by the LangGraph checkpointer (`BufferedCheckpointSaver.claim`) before
    anything is written. `owner` names the writer holding the claim.
    """

    def __init__(self, message: str | None = None, *, thread_id: str = "", owner: str = ""):
        super().__init__(message)
        self.thread_id = thread_id
        self.owner = owner


class StoreClosedError(StoreError):
    """The store is closed."""


class ConfigError(StoreError):
    """The configuration is invalid or conflicts with the existing server objects."""


class BackendUnavailableError(StoreError):
    """A backing service could not be reached; the call may succeed later."""

    retriable = True


class WalUnavailableError(BackendUnavailableError):
    """NATS JetStream could not be reached or did not answer in time."""


class WalAccessDeniedError(WalUnavailableError):
    """NATS refused this client: wrong credentials, or a TLS certificate that does not
    verify. Retrying cannot help; fix the configuration."""

    retriable = False


class WalRefusedError(StoreError):
    """JetStream or the NATS client refused a request for a reason that is none of the
    others (not unavailability, a conflict, a full WAL, a payload too large or a missing
    object): the same request fails the same way; the message says what was refused."""


class WalFullError(StoreError):
    """The WAL is full (`wal_max_bytes`): nothing was written. Retry once the flushers
    have drained the backlog; nothing acknowledged before was lost."""

    retriable = True


class WalEntriesExpiredError(StoreError):
    """Entries of the thread that were acknowledged are gone from the WAL without having
    been flushed (they expired at `max_age_s`, or an operator removed them): nothing was
    written, since a new entry could never be applied after them.

    `thread_id` names the thread, `flushed_seq` is where the inner store holds it and
    `latest_seq` the last seq that was acknowledged.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        thread_id: str = "",
        flushed_seq: int = 0,
        latest_seq: int = 0,
    ) -> None:
        super().__init__(message)
        self.thread_id = thread_id
        self.flushed_seq = flushed_seq
        self.latest_seq = latest_seq


class DatabaseUnavailableError(BackendUnavailableError):
    """The database could not be reached or did not answer in time."""


class DatabaseRefusedError(StoreError):
    """The database refused a statement for a reason that is not the data (a missing
    privilege, a server-side limit, an internal error): no thread is to blame, and the
    same statement fails the same way until an operator acts."""


class ConflictError(StoreError):
    """Another writer changed the same thread concurrently; retry with fresh state."""

    retriable = True


class CommitUnknownError(StoreError):
    """The checkpoint reached the WAL but its acknowledgement failed afterwards.

    The entry is durable and will be flushed; readers may not see it until a later
    checkpoint of the same thread or a flush. Do not blindly retry with a new snapshot
    expecting the old one to be absent.
    """

    def __init__(self, message: str | None = None, *, thread_id: str = "", thread_seq: int = 0):
        super().__init__(message)
        self.thread_id = thread_id
        self.thread_seq = thread_seq


class FlushTimeoutError(StoreError):
    """A flush did not complete within its timeout.

    `thread_id` names the thread of a `force_flush`; after a `force_flush_all`,
    `flushed` counts the threads it flushed and `not_flushed` lists the others (those
    whose flush was cut short may still have committed: their next flush finds them
    done).
    """

    retriable = True

    def __init__(
        self,
        message: str | None = None,
        *,
        thread_id: str | None = None,
        flushed: int = 0,
        not_flushed: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.thread_id = thread_id
        self.flushed = flushed
        self.not_flushed = not_flushed


class SchemaError(StoreError):
    """The database schema is missing or at an unexpected revision."""


class CorruptEntryError(StoreError):
    """A WAL payload could not be decoded into an entry."""


class WalEntriesMissingError(StoreError):
    """Entries of a thread are no longer in the WAL: the chain after `reached` up to
    `upto` cannot be read back (they expired before they were flushed, or an operator
    removed them). The thread cannot be applied in order from the stream any more.

    Raised by reads of a thread's unflushed entries (`ThreadLog.entries_between`); a
    flusher quarantines the thread, a read falls back to what the database holds.
    """

    def __init__(
        self, message: str | None = None, *, thread_id: str = "", reached: int = 0, upto: int = 0
    ) -> None:
        super().__init__(message)
        self.thread_id = thread_id
        self.reached = reached
        self.upto = upto


class FlushFailedError(StoreError):
    """The store behind the buffer refused a thread's entries (`ApplyStatus.FAILED`).

    `retriable` is the refusal's own: True when the same entries may apply later (a
    watermark not recorded, a store briefly refusing), False for data it never accepts.
    """

    def __init__(
        self, message: str | None = None, *, thread_id: str = "", retriable: bool = False
    ) -> None:
        super().__init__(message)
        self.thread_id = thread_id
        self.retriable = retriable


class WalObjectMissingError(StoreError):
    """A JetStream object this process needs (the stream, the durable consumer, a KV
    bucket) does not exist: check its configured name, or let a store or a flusher
    create it."""


class FlusherStateError(StoreError):
    """The flusher is not in the state the call needs."""


class FlusherNotStartedError(FlusherStateError):
    """The flusher is not started: call `start()` first."""


class FlusherStartedError(FlusherStateError):
    """The flusher was started already."""
