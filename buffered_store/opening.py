"""`Opening`: what the front-ends' ``connect()`` returns, to await or to use as an async
context manager (which closes what it opened on exit)."""

from __future__ import annotations

from collections.abc import Awaitable, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar


class Closable(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


class Opening(Generic[C]):
    """``await connect(...)`` gives the opened object; ``async with connect(...) as x``
    also closes it on exit."""

    def __init__(self, opening: Awaitable[C]) -> None:
        self._opening = opening
        self._opened: C | None = None

    def __await__(self) -> Generator[Any, None, C]:
        return self._opening.__await__()

    async def __aenter__(self) -> C:
        self._opened = await self._opening
        return self._opened

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._opened is not None:
            await self._opened.close()
