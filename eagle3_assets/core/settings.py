"""One declaration per setting, and the machinery that reads, validates and documents it (Dagster-free).

Every setting is declared exactly once, as a pydantic field made by ``setting(...)`` on the Dagster-free settings
model of the room that uses it (``SettingsModel`` subclasses: ``core.data_settings.DataStoreSettings``,
``prompts.dataset_settings``, ``generation.inference_settings``, ``local.verifier_settings``,
``evaluation.evaluation_settings``; ``eagle3_assets.environment`` lists them all). The field carries the typed
default, the bounds, the description, the ``EAGLE3_*`` environment variable (if any) and an optional semantic check.
The Dagster resources (``defs/resources.py``, ``defs/inference.py``) inherit those models and add only Dagster's
lifecycle, so the CLI, the demo and the benchmarks read a setting without importing Dagster. From that one
declaration come:

- the launchpad's defaults: ``from_environ`` reads the environment variables when the definitions load
  and binds the valid values, so the UI shows the effective values and can override them per run (a value
  holding a URL's password is bound by its variable's name instead, so Dagster never stores or shows it:
  ``SettingsResource.for_definitions`` in ``defs/resources.py``);
- launch-time failure instead of load-time failure: a bad ``EAGLE3_*`` value is left out at load (the
  code location always loads) and ``check_environ`` raises the same ``ConfigError`` naming the key when a
  run that uses the resource starts (``SettingsResource.setup_for_execution``);
- the same message for a bad launchpad value: ``SettingsModel`` wraps pydantic's validation of every
  declared field (``validate_field``) and re-raises with the variable's name, the value and what it must be;
- ``eagle3 config`` and ``eagle3 config --markdown`` (the README's configuration table): ``markdown_table``.

Adding a setting is a one-place change: add ``name: type = setting(default, env="EAGLE3_NAME", gt=0, ...)`` and
its description as the docstring under it to the settings model that uses it (or to a new ``SettingsModel`` listed in
``eagle3_assets.environment.settings_classes`` with its resource in ``defs/registry.py``), read ``self.name`` where
it is needed, and regenerate the README table with ``eagle3 config --markdown``. Nothing else lists settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# the source checkout (or site-packages) holding the package: children put it on PYTHONPATH, git reads it
REPO_ROOT = PACKAGE_DIR.parent
SAMPLE_PROMPTS_PATH = PACKAGE_DIR / "data" / "sample_prompts.jsonl"
# How long every server may stay down before a run gives up (generation's EAGLE3_OUTAGE_BUDGET_S and the extraction
# client's EAGLE3_HIDDEN_STATES_OUTAGE_BUDGET_S): long enough for a server restart, far short of hours of probing.
OUTAGE_BUDGET_S = 900.0
# The API key of every server the project talks to (generation, extraction, evaluation). No config field names it: a
# launchpad user could otherwise send any variable of the run's process as a bearer token. Read when a run needs it.
API_KEY_ENV = "EAGLE3_API_KEY"


def read_api_key() -> str | None:
    """The secret in ``EAGLE3_API_KEY`` (never config, never logged or stored)."""
    return os.environ.get(API_KEY_ENV, "").strip() or None


# The API key is no field (see API_KEY_ENV), so the configuration table gets its row from here.
API_KEY_TABLE_ROW = (
    f"| `{API_KEY_ENV}` | (empty) | secret, read when a run starts; never logged or stored | "
    "API key for the server(s) (generation, extraction, online training and evaluation); never logged or stored. | "
    "`settings.API_KEY_ENV` |"
)


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the key and the offending value."""


def fail(key: str, value: object, why: str) -> ConfigError:
    """The one error shape for a bad value: ``KEY=value: what it must be``."""
    return ConfigError(f"{key}={value!r}: {why}")


# ------------------------------------------------------------------------------------------ semantic checks


_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
# Everything from a scheme to the LAST "@" before whitespace or the next URL's scheme: a password may hold "@", ","
# or (wrongly unencoded) "/", "?" or "#", and all of it is hidden. Over-hiding text after a URL is harmless.
_URL_USERINFO = re.compile(rf"(?P<scheme>{_SCHEME})(?:(?!{_SCHEME})\S)*@")
# A comma separates two URLs only where the next URL (or nothing) follows it: a password may hold a comma.
_URL_LIST_COMMA = re.compile(rf",(?=\s*(?:{_SCHEME}|,|$))")


def redact_url_credentials(text: str) -> str:
    """``http://user:pw@host/v1`` -> ``http://***@host/v1`` in any text (a URL's credentials never reach a log line,
    an error, metadata or a manifest), whatever the password holds (``@``, ``,``, ``%40``)."""
    return _URL_USERINFO.sub(r"\g<scheme>***@", text)


def has_url_credentials(text: str) -> bool:
    """Whether ``text`` holds a URL with ``user:password@`` (a value Dagster may only know by its variable's name)."""
    return _URL_USERINFO.search(text) is not None


def check_base_urls(key: str, value: str | Sequence[str]) -> list[str]:
    """OpenAI-compatible base URL(s) (``http(s)://host:port/v1``): a comma-separated string or a sequence.

    A URL may carry credentials (``http://user:pw@host/v1``: sent as an Authorization header, see
    ``net.credentials.split_credentials``); an error never repeats them. A comma splits the list only before the
    next URL, so a password may hold one (``http://user:p,w@host/v1``).
    """
    parts = _URL_LIST_COMMA.split(value) if isinstance(value, str) else list(value)
    urls = [str(part).strip().rstrip("/") for part in parts if str(part).strip()]
    shown = redact_url_credentials(value) if isinstance(value, str) else [redact_url_credentials(u) for u in urls]
    if not urls:
        raise fail(key, shown, "needs at least one http(s) URL")
    for url in urls:
        try:
            parsed = urlparse(url)
            parsed.port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            parsed = None
        if parsed is None or parsed.scheme not in {"http", "https"} or not parsed.hostname:
            why = f"{redact_url_credentials(url)!r} is not an http(s) URL like http://127.0.0.1:8000/v1"
            raise fail(key, shown, why)
        if "@" in parsed.path + parsed.params + parsed.query + parsed.fragment:
            # a password's unencoded "/", "?" or "#" ends the host early: the rest of it would be taken for a host
            # name and a path, sent to a server and shown in errors
            why = (
                f"{redact_url_credentials(url)!r}: a password holding '/', '?' or '#' must be percent-encoded "
                "(%2F, %3F, %23)"
            )
            raise fail(key, shown, why)
        if "," in parsed.netloc.rpartition("@")[2] + parsed.path + parsed.params + parsed.query + parsed.fragment:
            # only a password may hold a comma: elsewhere it is a list item without its scheme (host:port/v1)
            why = f"{redact_url_credentials(url)!r}: every URL of a comma-separated list needs its http(s)://"
            raise fail(key, shown, why)
    if len(set(urls)) != len(urls):
        raise fail(key, shown, "lists the same URL twice")
    return urls


check_base_urls.allowed = "http(s) URLs, comma-separated"  # type: ignore[attr-defined]


def check_server_targets(key: str, value: object) -> tuple[int, ...]:
    """Requests to keep each server at: positive integers, comma-separated (one for every server or one per base
    URL), or empty (the default target)."""
    text = str(value).strip()
    if not text:
        return ()
    try:
        targets = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise fail(key, value, "must be positive integers, comma-separated (e.g. 128 or 256,64)") from None
    if not targets or any(t <= 0 for t in targets):
        raise fail(key, value, "must be positive integers, comma-separated (e.g. 128 or 256,64)")
    return targets


check_server_targets.allowed = "positive integers, comma-separated, or empty"  # type: ignore[attr-defined]


def check_optional_base_urls(key: str, value: str) -> list[str]:
    """Like ``check_base_urls``, but empty means "none" (e.g. start a local server instead)."""
    return check_base_urls(key, value) if str(value).strip() else []


check_optional_base_urls.allowed = "http(s) URL, or empty"  # type: ignore[attr-defined]


def parse_layer_ids(key: str, value: object) -> list[int] | None:
    """``""`` means the EAGLE-3 default [2, N//2, N-3]; otherwise comma-separated layer ids."""
    text = str(value).strip()
    if not text:
        return None
    try:
        ids = [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError:
        raise fail(key, value, "must be comma-separated integers, e.g. 1,2,3") from None
    if len(ids) < 1 or len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise fail(key, value, "must be distinct non-negative integers")
    return ids


parse_layer_ids.allowed = "comma-separated distinct layer ids, or empty"  # type: ignore[attr-defined]


def check_json_object(key: str, value: str) -> dict[str, Any]:
    """``""`` or a JSON object (extra request fields)."""
    if not str(value).strip():
        return {}
    try:
        body = json.loads(value)
    except ValueError as error:
        raise fail(key, value, f"invalid JSON ({error})") from None
    if not isinstance(body, dict):
        raise fail(key, value, "must be a JSON object")
    return body


check_json_object.allowed = "a JSON object, or empty"  # type: ignore[attr-defined]


def one_of(*choices: str) -> Callable[[str, object], object]:
    """A check that accepts only the listed strings."""

    def check(key: str, value: object) -> object:
        if value not in choices:
            raise fail(key, value, "must be " + " or ".join(repr(c) for c in choices))
        return value

    check.allowed = " or ".join(f"`{c}`" for c in choices)  # type: ignore[attr-defined]
    return check


def check_device(key: str, value: str) -> str:
    """A torch device name the project accepts: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    text = str(value).strip()
    if text in {"auto", "cpu", "cuda"} or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise fail(key, value, "must be auto, cpu, cuda or cuda:N")


check_device.allowed = "`auto`, `cpu`, `cuda` or `cuda:N`"  # type: ignore[attr-defined]


def check_not_blank(key: str, value: str) -> str:
    if not str(value).strip():
        raise fail(key, value, "must not be empty")
    return value


check_not_blank.allowed = "text, not empty"  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ declaration


def setting(
    default: Any,
    *,
    description: str | None = None,
    env: str | None = None,
    secret: bool = False,
    check: Callable[[str, Any], object] | None = None,
    **bounds: Any,
) -> Any:
    """A declared setting: a pydantic field with its default, description, bounds and environment variable.

    On a ``SettingsModel`` the description is the field's docstring (the string literal under it); elsewhere (an
    asset's run config) ``description``.

    ``bounds`` are pydantic's constraints (``gt``, ``ge``, ``le``, ``lt``); floats never accept NaN or
    infinity. ``check(key, value)`` raises ``ConfigError`` for values the type cannot rule out (URLs, JSON).
    ``secret``: the value is the *name* of the variable holding a secret (the secret is never config).
    """
    if isinstance(default, float) or any(isinstance(b, float) for b in bounds.values()):
        bounds.setdefault("allow_inf_nan", False)
    extra = {"env": env, "secret": secret, "check": check}
    return Field(default=default, description=description, json_schema_extra=extra, **bounds)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Declared:
    """One declared field, as read back from a settings class."""

    owner: str
    name: str
    env: str | None
    default: Any
    annotation: Any
    description: str
    secret: bool
    check: Callable[[str, Any], object] | None
    bounds: dict[str, Any]

    @property
    def key(self) -> str:
        """The name errors use: the environment variable when there is one, else the field name."""
        return self.env or self.name


def declared(cls: type) -> list[Declared]:
    """The fields of a pydantic settings class that were declared with ``setting``."""
    out = []
    for name, info in cls.model_fields.items():  # type: ignore[attr-defined]
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if "env" not in extra:
            continue
        bounds = {}
        for item in info.metadata:
            for bound in ("gt", "ge", "lt", "le"):
                if getattr(item, bound, None) is not None:
                    bounds[bound] = getattr(item, bound)
        out.append(
            Declared(
                owner=cls.__name__,
                name=name,
                env=extra.get("env"),  # type: ignore[arg-type]
                default=info.default,
                annotation=info.annotation,
                description=" ".join((info.description or "").split()),
                secret=bool(extra.get("secret")),
                check=extra.get("check"),  # type: ignore[arg-type]
                bounds=bounds,
            )
        )
    return out


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of ``T`` or ``T | None``."""
    args = get_args(annotation)
    if get_origin(annotation) in (Union, type(int | None)) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else annotation), True
    return annotation, False


def expectation(field: Declared) -> str:
    """What a value of this field must be, in words ("must be a positive integer")."""
    kind, optional = _base_type(field.annotation)
    b = field.bounds
    if kind is bool:
        text = "must be true or false"
    elif kind is int and (b.get("gt") == 0 or b.get("ge") == 1) and len(b) == 1:
        text = "must be a positive integer"
    elif kind is float and b.get("gt") == 0 and len(b) == 1:
        text = "must be a positive number"
    elif kind in (int, float) and "ge" in b and "le" in b:
        text = f"must be a number between {b['ge']:g} and {b['le']:g}"
    else:
        noun = {int: "an integer", float: "a number", str: "text"}.get(kind, getattr(kind, "__name__", str(kind)))
        limits = [f"{op} {b[k]:g}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if k in b]
        text = f"must be {noun}" + (f" {' and '.join(limits)}" if limits else "")
    return text + (" (or empty)" if optional else "")


def validate_field(cls: type, value: Any, handler: Callable[[Any], Any], field_name: str) -> Any:
    """Body of the settings classes' wrap validator: pydantic's checks, then ``check``, one message shape."""
    field = next((f for f in declared(cls) if f.name == field_name), None)
    if field is None:
        return handler(value)
    try:
        result = handler(value)
    except ValidationError:
        raise fail(field.key, value, expectation(field)) from None
    if field.check is not None and result is not None:
        field.check(field.key, result)
    return result


class SettingsModel(BaseModel):
    """A Dagster-free model whose fields are declared settings: a bad value raises
    ``ConfigError("KEY=value: what it must be")`` (never pydantic's text, which repeats the value's secrets). Each
    field's docstring is its description (the launchpad's, ``eagle3 config``'s and the README table's)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    @field_validator("*", mode="wrap")
    @classmethod
    def _name_the_key(cls, value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
        return validate_field(cls, value, handler, str(info.field_name))

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise as_config_error(error) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Any:
        """The model with the environment's valid values (invalid ones are reported by ``check_environ``)."""
        values, _errors = from_environ(cls, environ)
        return cls(**{**values, **overrides})


# ------------------------------------------------------------------------------------------ environment


def _raw_for(field: Declared, raw: str) -> Any:
    _kind, optional = _base_type(field.annotation)
    return None if optional and raw.strip() == "" else raw


def from_environ(cls: type, environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], list[ConfigError]]:
    """(field values for the set and valid ``EAGLE3_*`` variables of ``cls``, errors for the invalid ones)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    errors: list[ConfigError] = []
    for field in declared(cls):
        if field.env is None or field.secret or field.env not in env:
            continue
        try:
            values[field.name] = getattr(cls(**{field.name: _raw_for(field, env[field.env])}), field.name)
        except (ValidationError, ConfigError) as error:
            errors.append(as_config_error(error))
    return values, errors


def as_config_error(error: Exception) -> ConfigError:
    """The ConfigError inside a pydantic ValidationError (raised by ``validate_field``), else its text."""
    if isinstance(error, ConfigError):
        return error
    if isinstance(error, ValidationError):
        for item in error.errors():
            cause = (item.get("ctx") or {}).get("error")
            if isinstance(cause, ConfigError):
                return cause
    return ConfigError(redact_url_credentials(str(error)))  # pydantic's text repeats the input value


def check_environ(cls: type, environ: Mapping[str, str] | None = None) -> None:
    """Raise the first bad ``EAGLE3_*`` value of ``cls``'s settings (the run-launch check)."""
    _values, errors = from_environ(cls, environ)
    if errors:
        raise errors[0]


def effective_value(classes: Iterable[type], key: str, environ: Mapping[str, str] | None = None) -> Any:
    """The effective value of one environment setting: the variable's (validated) value, else the default."""
    env = os.environ if environ is None else environ
    for cls in classes:
        for field in declared(cls):
            if field.env == key:
                values, errors = from_environ(cls, {key: env[key]} if key in env else {})
                if errors:
                    raise errors[0]
                return values.get(field.name, field.default)
    raise KeyError(f"{key} is not a declared setting")


Core = TypeVar("Core")


def core_config(core: type[Core], source: object, **explicit: Any) -> Core:
    """The core's config dataclass ``core`` from the settings declared on ``source`` (a resource or run config).

    Every field of ``core`` that ``source``'s class declares as a setting of the same name is taken from
    ``source``; ``explicit`` gives the others (values from another resource, or converted ones). A setting that
    shares a core field's name declares its default as that field's (``setting(GenerationConfig.max_tokens, ...)``),
    so each default is written once (``tests/unit/test_one_default.py``).
    """
    names = {f.name for f in dataclasses.fields(core)}  # type: ignore[arg-type]
    shared = {f.name: getattr(source, f.name) for f in declared(type(source)) if f.name in names}
    return core(**{**shared, **explicit})


# ------------------------------------------------------------------------------------------ documentation


def _default_text(field: Declared) -> str:
    if field.secret:
        return "(empty)"
    if field.default == str(SAMPLE_PROMPTS_PATH):
        return "the shipped sample (`eagle3_assets/data/sample_prompts.jsonl`)"
    if field.default is None or field.default == "":
        return "(empty)"
    if isinstance(field.default, bool):
        return f"`{str(field.default).lower()}`"
    return f"`{field.default}`"


def markdown_table(classes: Iterable[type]) -> str:
    """The configuration table of every ``EAGLE3_*`` variable, generated from the declarations."""
    lines = ["| Variable | Default | Allowed | Meaning | Field |", "|---|---|---|---|---|"]
    secrets_listed = set()
    for cls in classes:
        for field in declared(cls):
            if (field.env is None and not field.secret) or (field.secret and field.default in secrets_listed):
                continue
            if field.secret:
                secrets_listed.add(field.default)
            if field.secret:
                key, allowed = str(field.default), "secret, read when a run starts; never logged or stored"
            else:
                allowed = getattr(field.check, "allowed", None) or expectation(field).removeprefix("must be ")
                key = field.env
            where = f"`{cls.__name__}.{field.name}`"
            lines.append(f"| `{key}` | {_default_text(field)} | {allowed} | {field.description} | {where} |")
    return "\n".join(lines)
