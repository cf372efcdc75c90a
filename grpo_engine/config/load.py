"""Defaults <- YAML file <- `a.b=value` overrides, type-checked by OmegaConf, range-checked by the sections.

OmegaConf does the merging and type checking (structured configs); this module turns its errors and the
sections' own ValueErrors into a `ConfigError` that names the dotted field, the file and the closest valid
name, BEFORE any model is loaded, so a typo costs a second, not a model load.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Hashable, Mapping
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from .fields import ConfigError
from .run import Config
from .safe_yaml import MAX_YAML_CHARS, load_yaml
from .trust import mark_stored_code, unmarked


def _dotted_names(cls=Config, prefix: str = "") -> list[str]:
    """Every key a user may write, an inline section's fields at its parent's level (fields.inline)."""
    names = []
    for f in dataclasses.fields(cls):
        sub = _section_class(f)
        if sub is not None and f.metadata.get("inline"):
            names += _dotted_names(sub, prefix)
            continue
        names.append(prefix + f.name)
        if sub is not None:
            names += _dotted_names(sub, prefix + f.name + ".")
    return names


def _nested(data, cls=Config):
    """A user's mapping with the keys of each inline section moved under its field, as the schema has them."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for f in dataclasses.fields(cls):
        sub = _section_class(f)
        if sub is not None and f.metadata.get("inline"):
            moved = {g.name: out.pop(g.name) for g in dataclasses.fields(sub) if g.name in out}
            out[f.name] = {**(out.get(f.name) or {}), **moved}
        if sub is not None and f.name in out:
            out[f.name] = _nested(out[f.name], sub)
    return out


def _flat(data, cls=Config):
    """The schema's mapping with each inline section's keys back at its parent's level: what a user writes."""
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        f = next((f for f in dataclasses.fields(cls) if f.name == key), None)
        sub = _section_class(f) if f is not None else None
        if sub is not None and f.metadata.get("inline"):
            out.update(_flat(value, sub))
        else:
            out[key] = _flat(value, sub) if sub is not None else value
    return out


def _user_key(full_key: str, cls=Config, prefix: str = "") -> str:
    """An OmegaConf key as the user wrote it: an inline section's name left out (algorithm.policy_loss.beta ->
    algorithm.beta)."""
    for f in dataclasses.fields(cls):
        sub, path = _section_class(f), prefix + f.name + "."
        if sub is None or not full_key.startswith(path):
            continue
        return prefix + full_key[len(path):] if f.metadata.get("inline") else _user_key(full_key, sub, path)
    return full_key


def _section_class(f: dataclasses.Field):
    """The dataclass type of a section field, or None for a leaf."""
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return type(value)
    return None


def _closest(full_key: str) -> str:
    """' (did you mean X?)' for an unknown dotted key, or a list of the valid keys at that level."""
    names = _dotted_names()
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    siblings = [n for n in names if n.rsplit(".", 1)[0] == parent and n.count(".") == full_key.count(".")]
    if not parent:
        siblings = [n for n in names if "." not in n]
    match = difflib.get_close_matches(full_key, siblings, n=1, cutoff=0.5)
    if not match:
        match = difflib.get_close_matches(full_key, names, n=1, cutoff=0.6)
    if match:
        return f" (did you mean {match[0]!r}?)"
    leaves = ", ".join(s.rsplit(".", 1)[-1] for s in siblings)
    return f" (valid keys under {parent or 'the top level'}: {leaves})"


def _raise_from_omegaconf(e: OmegaConfBaseException, source: str) -> None:
    key = _user_key(getattr(e, "full_key", None) or "?")
    msg = str(e).splitlines()[0]
    if isinstance(e, ConfigKeyError) or "not in" in msg or "Key '" in msg and "not" in msg:
        raise ConfigError(f"{source}: unknown config key {key!r}{_closest(key)}") from None
    empty = re.match(r"Incompatible value 'None' for field of type '(\w+)'", msg)
    if isinstance(e, ValidationError) and empty:  # `key=` or `key:` with nothing after it: YAML null
        raise ConfigError(f"{source}: {key!r} has no value (empty or null) but needs one of type {empty[1]}: "
                          f"give it ({key}=VALUE) or leave the key out to keep its default") from None
    if isinstance(e, ValidationError):
        raise ConfigError(f"{source}: wrong type for {key!r}: {msg}") from None
    raise ConfigError(f"{source}: invalid value for {key!r}: {msg}") from None


def _merge(merged: DictConfig, data: dict, source: str) -> DictConfig:
    """OmegaConf.merge with its errors as ConfigErrors. A list or a number where a section or mapping belongs
    is named by its dotted key: OmegaConf reports it without the key, or as a bare TypeError (a traceback)."""
    data = _nested(data)
    try:
        return OmegaConf.merge(merged, data)
    except (OmegaConfBaseException, TypeError) as e:
        misplaced = _misplaced(merged, data)
        if misplaced is not None:
            raise ConfigError(f"{source}: {misplaced}") from None
        if not isinstance(e, OmegaConfBaseException):
            raise ConfigError(f"{source}: {e}") from None
        _raise_from_omegaconf(e, source)
    raise AssertionError("unreachable")


def _misplaced(schema: DictConfig, data: dict, prefix: str = "") -> str | None:
    """'KEY must be a mapping ...' for the first key of `data` whose kind (mapping / list) is not the schema's."""
    for key, value in data.items():
        node, name = schema.get(key, None), f"{prefix}{key}"
        if isinstance(node, DictConfig) and not isinstance(value, dict):
            return f"{name!r} must be a mapping (key: value lines under it), got {type(value).__name__} {value!r}"
        if isinstance(node, ListConfig) and isinstance(value, dict):
            return f"{name!r} must be a list (e.g. [a, b]), got a mapping"
        found = _misplaced(node, value, name + ".") if isinstance(node, DictConfig) else None
        if found is not None:
            return found
    return None


def _empty_sections_dropped(schema: DictConfig, data: dict) -> dict:
    """`rollout:` with every line under it commented out is YAML null: in a file that means the section's
    defaults (OmegaConf calls it "not Optional"), as an empty `rollout: {}` does."""
    out = {}
    for key, value in data.items():
        node = schema.get(key, None)
        if isinstance(node, DictConfig) and value is None:
            continue
        out[key] = _empty_sections_dropped(node, value) if isinstance(node, DictConfig) and isinstance(value, dict) \
            else value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error: YAML keeps the last one, so a
    second `rollout:` section would silently drop every setting of the first."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys given beside it override it
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader's own error: "found unhashable key"
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first on line {seen[key] + 1}); keep one",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError(f"config path {path} is a directory; give the YAML file (e.g. configs/tiny_arithmetic.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.stat().st_size > MAX_YAML_CHARS:  # refused before it is read
        raise ConfigError(f"{path}: {path.stat().st_size:,} bytes, over the {MAX_YAML_CHARS:,} a config file may have")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"), str(path), _UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or " ".join(str(e).split())  # a ReaderError has no problem: one line
        raise ConfigError(f"{where}: malformed YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _override(merged: DictConfig, item: str) -> DictConfig:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. rollout.group_size=16)")
    try:
        load_yaml(item.partition("=")[2], f"override {item!r}")  # the budget, before OmegaConf expands aliases
        data = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        _raise_from_omegaconf(e, f"override {item!r}")
    except (yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"override {item!r}: malformed value ({str(e).splitlines()[0]})") from None
    key, _, value = item.partition("=")
    if value.strip() == "null" and _free_mapping(merged, key):  # e.g. task.options=null: drop the file's entries
        OmegaConf.update(merged, key, {}, merge=False)
        return merged
    return _merge(merged, data, f"override {item!r}")


def _free_mapping(merged: DictConfig, key: str) -> bool:
    """Whether `key` is a free-form mapping (task.options, a weights table), not a config section. Overrides merge
    into a mapping, so `key=null` is the way to empty one: switching task.name on the command line would
    otherwise keep the YAML's options of the old task."""
    node = OmegaConf.select(merged, key.strip(), default=None)
    return isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict


def _build(merged: DictConfig, source: str) -> Config:
    """The typed tree; a section's __post_init__ range check becomes a ConfigError naming the source."""
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else None
        if cause is not None and not isinstance(cause, OmegaConfBaseException):
            raise ConfigError(f"{source}: {cause}") from None
        _raise_from_omegaconf(e, source)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    raise AssertionError("unreachable")


def _schema() -> DictConfig:
    """The Config tree's defaults as an OmegaConf node that merges accept: the sections are frozen dataclasses
    (read-only nodes to OmegaConf), and only the built Config is meant to be read-only."""
    schema = OmegaConf.structured(Config)
    nodes = [schema]
    while nodes:
        node = nodes.pop()
        OmegaConf.set_readonly(node, None)
        nodes += [node._get_node(k) for k in node if isinstance(node._get_node(k), DictConfig)]
    return schema


def load_config(path: str | Path | Mapping | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file (or a mapping of the same sections: the Python API's config dict) <- `a.b=value`
    overrides, type-checked, then range-checked by every section."""
    merged: DictConfig = _schema()
    source = "config dict" if isinstance(path, Mapping) else str(path or "config")
    if path is not None:
        data = plain_data(path) if isinstance(path, Mapping) else _read_yaml(Path(path))
        merged = _merge(merged, _empty_sections_dropped(merged, data), source)
    for item in overrides:
        merged = _override(merged, item)
    return _build(merged, source)


def plain_data(value):
    """A config value as YAML would give it: plain dicts and lists (tuples as lists), keys as text, paths as text
    (a config dict of the Python API, an override's value)."""
    if isinstance(value, Mapping):
        return {str(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def as_mapping(cfg: Config) -> dict:
    """The config as plain YAML values, keyed as a user writes them (a stored config's marks: plain text)."""
    return _flat(OmegaConf.to_container(OmegaConf.structured(unmarked(cfg))))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(as_mapping(cfg)))


def config_from_yaml_text(text: str, source: str = "stored config") -> Config:
    """Rebuild a Config from `to_yaml` output (checkpoints and run folders store the config this way). A stored
    config is data: its values that name code (trust.CODE_KEYS) run only with the user's --allow-code. A
    checkpoint's resolved.yaml (plan/resolved.py: `machine` and `config`) gives its `config`."""
    try:
        data = load_yaml(text, source) or {}
        if isinstance(data, dict) and set(data) == {"machine", "config"}:  # resolved.yaml: the config it ran with
            data = data["config"] or {}
        merged = OmegaConf.merge(_schema(), OmegaConf.create(_nested(data)))
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: malformed YAML ({str(e).splitlines()[0]})") from None
    except OmegaConfBaseException as e:
        _raise_from_omegaconf(e, source)
    return mark_stored_code(_build(merged, source), source)  # its "module:function" values are data (trust.py)
