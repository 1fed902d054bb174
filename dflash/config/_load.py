"""Reading and writing the config: TOML in, `--set` overrides, validation errors that name
the key path and the allowed values, and the resolved tree back out as TOML. Imported
through `dflash.config`."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from dflash.config._schema import MOVED, Config
from dflash.errors import ConfigError


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<config>"


def _section_type(ann: Any) -> type[BaseModel] | None:
    """The section model behind an annotation: `Model` or `list[Model]`."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    args = get_args(ann) if get_origin(ann) is list else ()
    if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    for part in loc:
        if isinstance(part, int):  # an index into a list of sections
            continue
        field = model.model_fields.get(part)
        sub = _section_type(field.annotation) if field else None
        if sub is None:
            break
        model = sub
    return sorted(model.model_fields)


def _format_validation(err: ValidationError, source: str) -> ConfigError:
    parts = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        if e["type"] == "extra_forbidden" and _loc(loc) in MOVED:
            parts.append(f"{_loc(loc)}: moved to {MOVED[_loc(loc)]}")
            continue
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(Config, loc[:-1]))
            parts.append(f"{_loc(loc)}: unknown key (allowed: {allowed})")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] not in ("model_type", "missing") and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        # A section's own check that names its keys in full needs no prefix ("loss: loss.labels ...").
        parts.append(msg if loc and msg.startswith(f"{_loc(loc)}.") else f"{_loc(loc)}: {msg}")
    return ConfigError(f"{source}: " + "; ".join(parts))


def parse_config(data: dict[str, Any], source: str = "config") -> Config:
    """Validate a plain dict (as read from TOML) into a Config, or raise ConfigError."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise _format_validation(err, source) from None


def moved_keys_mapped(data: dict[str, Any]) -> dict[str, Any]:
    """A raw config that names keys of `MOVED` (a checkpoint's `config.toml`) in the schema's
    layout: each old key placed at its new path. A key set at both places keeps the new one."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for old, new in MOVED.items():
        old_section, old_key = old.split(".")
        section = out.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        new_section, new_key = new.split(".")
        out.setdefault(new_section, {}).setdefault(new_key, value)
    return out


def _parse_value(raw: str) -> Any:
    """A `--set` value is a TOML value (2, 1e-3, true, ["cpu"], "x"); bare words are strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=v` overrides to a raw config dict; reject paths the schema does not have."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            msg = f"--set {item!r}: expected KEY=VALUE, e.g. drafter.num_layers=2"
            raise ConfigError(msg)
        if key in MOVED:
            msg = f"--set {key}: moved to {MOVED[key]}"
            raise ConfigError(msg)
        parts = key.split(".")
        model: type[BaseModel] = Config
        node = data
        for i, part in enumerate(parts):
            field = model.model_fields.get(part)
            if field is None:
                allowed = ", ".join(sorted(model.model_fields))
                where = ".".join(parts[:i]) or "top level"
                msg = f"--set {key}: unknown key {part!r} in {where} (allowed: {allowed})"
                raise ConfigError(msg)
            ann = field.annotation
            is_section = isinstance(ann, type) and issubclass(ann, BaseModel)
            if i == len(parts) - 1:
                if is_section:
                    msg = f"--set {key}: is a section; set one of its keys, e.g. {key}.{next(iter(ann.model_fields))}"
                    raise ConfigError(msg)
                node[part] = _parse_value(raw.strip())
            else:
                if not is_section:
                    msg = f"--set {key}: {'.'.join(parts[: i + 1])} is not a section"
                    raise ConfigError(msg)
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    msg = f"--set {key}: {'.'.join(parts[: i + 1])} is not a table in the file"
                    raise ConfigError(msg)
                node, model = child, ann
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or start from defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    source = "config"
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            with p.open("rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            msg = f"config file not found: {p}"
            raise ConfigError(msg) from None
        except IsADirectoryError:
            msg = f"config path is a folder, not a TOML file: {p}"
            raise ConfigError(msg) from None
        except tomllib.TOMLDecodeError as err:
            msg = f"{p}: not valid TOML: {err}"
            raise ConfigError(msg) from None
        except UnicodeDecodeError:
            msg = f"{p}: not a text (UTF-8) TOML file"
            raise ConfigError(msg) from None
        except OSError as err:
            msg = f"cannot read config file {p}: {err.strerror or err}"
            raise ConfigError(msg) from None
    if overrides:
        data = apply_overrides(data, overrides)
        source += " with --set"
    return parse_config(data, source)


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (keys left unset, i.e. None, are omitted)."""
    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True))


def _inline(value: Any) -> str:
    """A TOML value on one line (tomli_w spreads arrays over several)."""
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(_pair(k, v) for k, v in value.items()) + " }" if value else "{}"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")


def _pair(key: str, value: Any) -> str:
    return tomli_w.dumps({key: 0}).removesuffix(" = 0\n") + " = " + _inline(value)


def _default_value(field: FieldInfo) -> Any:
    return None if field.is_required() else to_jsonable_python(field.get_default(call_default_factory=True))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = _default_value(field)
    return "unset" if value is None else _inline(value)


def _table(out: list[str], path: str, model: type[BaseModel], field: FieldInfo, values: dict[str, Any] | None,
           *, array: bool = False) -> None:  # fmt: skip
    """One section: its keys, then its sub-sections. `values` None: an empty list of sections,
    shown commented out with each key's default."""
    mark = "" if values is not None else "# "
    out += ["", f"# {field.description}", f"{mark}[[{path}]]" if array else f"{mark}[{path}]"]
    subs = []
    for name, f in model.model_fields.items():
        sub = _section_type(f.annotation)
        if sub is not None:
            subs.append((name, f, sub))
            continue
        value = values[name] if values is not None else _default_value(f)
        out.append(f"# {f.description} (default: {_default(f)})")
        out.append(f"# {name} =" if value is None else mark + _pair(name, value))
    for name, f, sub in subs:
        value = values[name] if values is not None else None
        if get_origin(f.annotation) is list:
            for item in value or [None]:
                _table(out, f"{path}.{name}", sub, f, item, array=True)
        else:
            _table(out, f"{path}.{name}", sub, f, value)


def annotated_toml(cfg: Config) -> str:
    """The resolved config as TOML with every key of the schema, each under a comment giving
    its meaning and default; a key left unset (None) is a commented-out line. It reads back
    as the same config."""
    values = cfg.model_dump(mode="json")
    out = ["# dflash config: every key, with its meaning and default; unset keys are commented out"]
    for name, field in Config.model_fields.items():
        sub = _section_type(field.annotation)
        assert sub is not None  # the root holds sections only
        _table(out, name, sub, field, values[name])
    return "\n".join(out) + "\n"
