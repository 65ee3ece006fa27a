"""How a configuration is made of role settings, and read from the environment.

A role (`Role`: connection, WAL layout, flush policy, writer, a front-end's own) is a
frozen keyword-only dataclass that validates its own fields. A configuration
(`Composed`) is a frozen dataclass whose fields are role objects, e.g.
``BufferedStoreConfig(connection=..., wal=..., flush=..., writer=..., threadrun=...)``.
Code that needs one role takes that role (``config.connection``); the flat keywords and
attributes of earlier versions keep working: ``BufferedStoreConfig(nats_url=...,
recent_window=...)`` routes each keyword to its role, and every role field is also a
plain attribute of the configuration (``config.recent_window``), copied at construction
(the configuration is frozen, so the copy cannot drift), so reading one on the write
path costs what reading any attribute does.

Every role field can come from an environment variable ``BUFSTORE_<FIELD>`` (upper case)
through `Composed.from_env`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from enum import Enum
from typing import Any, ClassVar, Self, get_type_hints

from buffered_store.errors import ConfigError

ENV_PREFIX = "BUFSTORE_"


class Role:
    """Base of the role settings (each a frozen keyword-only dataclass)."""

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        """The role's fields, in order."""
        return tuple(item.name for item in dataclasses.fields(cls))  # type: ignore[arg-type]

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Build from ``BUFSTORE_*`` variables; explicit keyword overrides win."""
        env = os.environ if environ is None else environ
        return cls(**{**env_values(cls, env), **overrides})


def env_values(role: type[Role], env: Mapping[str, str]) -> dict[str, Any]:
    """The fields of `role` that ``BUFSTORE_<FIELD>`` variables in `env` set, parsed."""
    hints = get_type_hints(role)
    values: dict[str, Any] = {}
    for name in role.knob_names():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = parse(raw, hints[name], name)
    return values


def parse(raw: str, hint: Any, name: str) -> Any:
    """The value of variable ``BUFSTORE_<NAME>`` for a field typed `hint`."""
    text = raw.strip()
    try:
        if hint is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        optional = {int | None: int, float | None: float}.get(hint)
        if optional is not None:
            return None if text.lower() in ("", "none", "off") else optional(text)
        if isinstance(hint, type) and issubclass(hint, Enum):
            return hint(text.lower())
        if text == "" and "None" in str(hint):
            return None
        return text
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {name}") from None


def check_positive(role: object, *names: str) -> None:
    """`ConfigError` unless each named field is a number above 0."""
    for name in names:
        value = getattr(role, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ConfigError(f"{name} must be positive, got {value!r}")


def check_positive_int(role: object, *names: str) -> None:
    """`ConfigError` unless each named field is an integer of at least 1."""
    for name in names:
        value = getattr(role, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


class Composed:
    """Base of the configurations: frozen dataclasses whose fields are role objects.

    Subclasses are ``@dataclass(frozen=True, init=False)`` with one field per role,
    annotated with the role's class; `ROLE_DEFAULTS` changes a role's defaults (e.g.
    the LangGraph saver's own stream names). The flat attributes are declared (for type
    checkers) on plain, non-dataclass classes the configuration also derives from.
    """

    ROLE_DEFAULTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    """Role field name -> defaults of that role that differ in this configuration."""

    def __init__(self, **settings: Any) -> None:
        """Each role from its object if given (``wal=WalLayout(...)``), else from its
        defaults; flat keywords (``stream_name=...``) change the field of their role."""
        flat = dict(settings)
        values: dict[str, Any] = {}
        for attr, role in self.roles().items():
            given = flat.pop(attr, None)
            mine = {name: flat.pop(name) for name in role.knob_names() if name in flat}
            if given is None:
                values[attr] = role(**{**self.ROLE_DEFAULTS.get(attr, {}), **mine})
            elif not isinstance(given, role):
                raise TypeError(f"{attr} must be a {role.__name__}, got {type(given).__name__}")
            else:
                values[attr] = given.replace(**mine) if mine else given
        if flat:
            unknown = ", ".join(sorted(flat))
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments: {unknown}")
        for attr, obj in values.items():
            object.__setattr__(self, attr, obj)
            for name in obj.knob_names():
                object.__setattr__(self, name, getattr(obj, name))
        self.check()

    def check(self) -> None:
        """Rules across roles (`ConfigError`); each role checked its own already."""

    @classmethod
    def roles(cls) -> dict[str, type[Role]]:
        """Role field name -> role class, in order."""
        found = cls.__dict__.get("_roles_cache")
        if found is None:
            hints = get_type_hints(cls)
            found = {
                item.name: hints[item.name]
                for item in dataclasses.fields(cls)  # type: ignore[arg-type]
            }
            cls._roles_cache = found  # type: ignore[attr-defined]
        return dict(found)

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        """Every flat keyword (and attribute): the fields of all roles, in order."""
        return tuple(name for role in cls.roles().values() for name in role.knob_names())

    def knobs(self) -> Iterator[tuple[str, Any]]:
        """(flat name, value) of every role field."""
        for name in self.knob_names():
            yield name, getattr(self, name)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Build from ``BUFSTORE_*`` variables; explicit keyword overrides (flat
        keywords or role objects) win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for attr, role in cls.roles().items():
            if attr not in overrides:
                values.update(env_values(role, env))
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields (flat or roles) changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]
