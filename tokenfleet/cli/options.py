"""Command-line options made from settings fields (`tokenfleet.config`): a flag's
option, default and help all come from its field, so none is written twice.

`option(Settings, "redis_url")` is one field's typer option, for a hand-written
signature. `settings_command(WorkerSettings)` makes a command whose options are every
field of the class with a `Flag` (the fleet's `--redis-url` and `--prefix` last) and
hands its body the settings built from them. A flag left out is not given: the
environment or the default applies. `load` builds the settings; a value it refuses
is `error: WHERE: why` and exit code 2, WHERE the flag or variable it came from.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Annotated, Any, TypeVar, Union, cast, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from tokenfleet.config import Env, Flag, FleetConfig
from tokenfleet.config.common import GivenOverEnvironment, is_sequence, marker

S = TypeVar("S", bound=BaseSettings)


def fail(message: str) -> typer.Exit:
    """Print `error: MESSAGE` to stderr; raise the result to exit with code 2."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def option(cls: type[BaseModel], name: str) -> Any:
    """The typer option of the field `name` of `cls`, for a hand-written signature whose
    default is None (not given): the field's default is shown as `[default: (...)]`."""
    field = cls.model_fields[name]
    return _typer_option(field, _flag(cls, name), shown_default(field))


def shown_default(field: FieldInfo) -> str | bool:
    """The field's default as help shows it; nothing for an unset or a False one."""
    default = field.default
    return False if default is None or default is False or default == () else str(default)


def help_text(field: FieldInfo) -> str:
    """The description, then the variables it is also read from."""
    text = field.description or ""
    env = marker(field, Env)
    if env is None:
        return text
    names = " or ".join(f"${name}" for name in env.names)
    if is_sequence(field):
        names += ", comma-separated"
    return f"{text} ({'also ' if env.merged else ''}{names})"


def settings_command(cls: type[S]) -> Callable[[Callable[[S], None]], Callable[..., None]]:
    """Decorate `body(settings)` into a typer command taking `cls`'s flags. Each flag's
    default is its field's (so help shows it as typer does); only the flags the command
    line gives are passed on, the environment filling the rest."""

    def make(body: Callable[[S], None]) -> Callable[..., None]:
        def command(ctx: typer.Context, **flags: Any) -> None:
            given = {name: value for name, value in flags.items() if _given(ctx, name)}
            body(load(cls, **given))

        context = inspect.Parameter(
            "ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
        )
        parameters = [context, *(_parameter(cls, name) for name in flagged(cls))]
        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__name__, command.__qualname__ = body.__name__, body.__qualname__
        command.__doc__, command.__module__ = body.__doc__, body.__module__
        return command

    return make


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the command line gave the flag (not typer, with the field's default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _parameter(cls: type[BaseModel], name: str) -> inspect.Parameter:
    field = cls.model_fields[name]
    default = None if field.default == () else field.default
    show = default is not None
    annotation = cast(Any, Annotated)[
        cli_type(field) | None, _typer_option(field, _flag(cls, name), show)
    ]
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def _flag(cls: type[BaseModel], name: str) -> Flag:
    flag = marker(cls.model_fields[name], Flag)
    assert flag is not None, f"{cls.__name__}.{name} has no Flag"
    return flag


def _typer_option(field: FieldInfo, flag: Flag, show_default: str | bool) -> Any:
    return typer.Option(
        *flag.decls, help=help_text(field), show_default=show_default, hidden=flag.hidden
    )


def flagged(cls: type[BaseModel]) -> list[str]:
    """The fields of `cls` with a flag: its own first, then those it inherits, the
    fleet's (`--redis-url`, `--prefix`) last as in every command."""
    inherited = {name for base in cls.__mro__[1:] for name in getattr(base, "model_fields", {})}
    names = [name for name, field in cls.model_fields.items() if marker(field, Flag)]
    fleet = FleetConfig.model_fields.keys()
    return (
        [n for n in names if n not in inherited]
        + [n for n in names if n in inherited and n not in fleet]
        + [n for n in names if n in fleet]
    )


def cli_type(field: FieldInfo) -> Any:
    """The type typer parses the flag as: the field's without None; a tuple as a list
    (a repeatable flag)."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) in (tuple, list):
        return list[get_args(annotation)[0]]  # type: ignore[misc]
    return annotation


def load(cls: type[S], **flags: Any) -> S:
    """`cls` from the flags given (None or an empty list: not given) over the environment."""
    given = {name: value for name, value in flags.items() if value not in (None, [], ())}
    try:
        return cls(**given)
    except ValidationError as exc:
        raise fail(refusal(cls, exc, given)) from None


def refusal(cls: type[BaseSettings], exc: ValidationError, given: dict[str, Any]) -> str:
    """Each problem as `WHERE: why`; never the value (it may be a key or a password)."""
    problems = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        why = error["msg"].removeprefix("Value error, ")
        problems.append(f"{origin(cls, name, given)}: {why}" if name else why)
    return "; ".join(problems)


def origin(cls: type[BaseSettings], name: str, given: dict[str, Any]) -> str:
    """Where a field's value came from: its flag if given, and/or the variable set."""
    field = cls.model_fields.get(name)
    if field is None:
        return name
    flag = marker(field, Flag)
    sources = [flag.name if flag else name] if name in given else []
    from_env, variable, _ = GivenOverEnvironment(cls, {}).get_field_value(field, name)
    env = marker(field, Env)
    if from_env is not None and (not sources or (env is not None and env.merged)):
        sources.append(f"${variable}")
    return " and ".join(sources) or name
