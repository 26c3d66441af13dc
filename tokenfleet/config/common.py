"""How a setting is declared, where its value comes from, and what every command reads.

A setting is one pydantic field: its type, default, constraints and description, and
in its `Annotated` metadata where else it may come from:

    Env("TOKENFLEET_X", ...)  the environment variables it is read from (the first set)
    Flag("--x")               its command-line flag (`tokenfleet.cli.options` builds the
                              option, its default and its help from the field)

A value given (a flag, or a keyword argument in code) wins over the environment, which
wins over the default; a field with no `Env` is never read from the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, get_origin

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from tokenfleet.connect import is_cluster_url
from tokenfleet.keys import DEFAULT_PREFIX, DEFAULT_QUEUE_CAP, MAX_PARTITIONS, Keys

T = TypeVar("T")


@dataclass(frozen=True, init=False)
class Env:
    """The environment variables a setting is read from, the first one set winning. A
    tuple setting's variable holds comma-separated items; with `merged`, a value given
    comes before the variable's items instead of replacing them."""

    names: tuple[str, ...]
    merged: bool

    def __init__(self, *names: str, merged: bool = False) -> None:
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "merged", merged)


@dataclass(frozen=True, init=False)
class Flag:
    """A setting's command-line flag, as typer declares it: `--name`, `--name`, `-n`, or
    `--on/--off` for a bool that may be set either way."""

    decls: tuple[str, ...]
    hidden: bool

    def __init__(self, *decls: str, hidden: bool = False) -> None:
        object.__setattr__(self, "decls", decls)
        object.__setattr__(self, "hidden", hidden)

    @property
    def name(self) -> str:
        """The flag as an error message names it: `--name` (of `--name/--no-name`)."""
        return self.decls[0].split("/")[0]


def marker(field: FieldInfo, kind: type[T]) -> T | None:
    """The field's `Env` or `Flag`, if it has one."""
    return next((m for m in field.metadata if isinstance(m, kind)), None)


def is_sequence(field: FieldInfo) -> bool:
    return get_origin(field.annotation) in (tuple, list)


class GivenOverEnvironment(PydanticBaseSettingsSource):
    """A settings class's input: every value given, and for each field not given the
    variable its `Env` names (matched without regard to case); a `merged` field given
    gets the given items, then the variable's."""

    def __init__(self, settings_cls: type[BaseSettings], given: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self.given = given
        self.environ = {name.upper(): value for name, value in os.environ.items()}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        env = marker(field, Env)
        for name in env.names if env else ():
            raw = self.environ.get(name.upper())
            if raw is not None:
                return (raw.split(",") if is_sequence(field) else raw), name, False
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values = dict(self.given)  # unknown names too: the model refuses them
        for name, field in self.settings_cls.model_fields.items():
            from_env, _, _ = self.get_field_value(field, name)
            env = marker(field, Env)
            if from_env is None:
                continue
            if name not in values:
                values[name] = from_env
            elif env is not None and env.merged:
                given = values[name]
                values[name] = [*(given.split(",") if isinstance(given, str) else given), *from_env]
        return values


class FromEnvironment(BaseSettings):
    """A settings class read from what is given over the environment (see the module
    docstring); no `.env` file, no secrets directory."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        assert isinstance(init_settings, InitSettingsSource)
        return (GivenOverEnvironment(settings_cls, init_settings.init_kwargs),)


class FleetConfig(BaseModel):
    """Which fleet a process belongs to. The input of a password-bearing URL is never
    shown in a validation error."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    redis_url: Annotated[
        str,
        Env("TOKENFLEET_REDIS_URL", "REDIS_URL"),
        Flag("--redis-url"),
        Field(
            description="the fleet's Redis URL, with its password: redis://, rediss:// or"
            " redis+cluster://HOST:PORT,HOST:PORT"
        ),
    ] = "redis://127.0.0.1:6379/0"
    prefix: Annotated[
        str,
        Env("TOKENFLEET_PREFIX"),
        Flag("--prefix"),
        Field(min_length=1, max_length=64, description="key prefix of the fleet"),
    ] = DEFAULT_PREFIX
    queue_cap: Annotated[
        int,
        Env("TOKENFLEET_QUEUE_CAP"),
        Field(ge=1, description="the cap of a jobs stream that has none set yet"),
    ] = DEFAULT_QUEUE_CAP
    partitions: Annotated[
        int,
        Env("TOKENFLEET_PARTITIONS"),
        Field(
            ge=1,
            le=MAX_PARTITIONS,
            description="parts each model's queue is split into (Redis Cluster: one hash "
            "slot each); every process of a fleet must say the same",
        ),
    ] = 1

    def keys(self) -> Keys:
        """The fleet's key names: its prefix, its partitions, hash tags on a cluster."""
        return Keys(self.prefix, self.partitions, tagged=is_cluster_url(self.redis_url))


class Settings(FromEnvironment, FleetConfig):
    """What every command reads: the fleet's Redis URL, key prefix and default queue cap."""

    model_config = FromEnvironment.model_config  # FleetConfig's, and read as settings
