"""Typed configuration: dataclasses per section, YAML files, and ``key.path=value`` overrides.

A config is a tree of dataclasses (the sections: ``sections.py`` for the root and shared ones, ``stages.py``
for one per stage). This module owns the generic machinery: building dataclasses from plain dicts with type
checks, rejecting unknown keys with a message that names the key and the valid ones, applying dotted
overrides from the command line, reading the docstring written under each field (so ``drafter config
--keys`` documents every option without a second copy of the text), and serialising back to a plain dict for
manifests and MLflow params.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import textwrap
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pipeline.errors import DrafterError

T = TypeVar("T")


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader without three YAML 1.1 readings no config means: a key given twice (the first
    silently lost), base-60 numbers (``time: 24:00:00`` was 86400) and leading-zero octal ones (``0123456`` was
    42798). Those two stay text, as YAML 1.2 reads them; decimal and ``0x`` integers and floats are unchanged."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        first: dict[str, int] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in first:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"found the key {key_node.value!r} twice (first on line {first[key_node.value] + 1}); YAML "
                        "would keep only the last", key_node.start_mark)
                first[key_node.value] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
ConfigLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
ConfigLoader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?
    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


def _yaml_value(raw: str) -> tuple[Any, str]:
    """``raw`` read as one YAML value, and the text after it YAML left out (a `` #`` comment)."""
    loader = ConfigLoader(raw)
    try:
        node = loader.get_single_node()
        return (None, "") if node is None else (loader.construct_document(node), raw[node.end_mark.index:].strip())
    finally:
        loader.dispose()


def check_value(ok: bool, key: str, expected: str, found: object) -> None:
    """Raise the standard bad-value error for config key ``key`` unless ``ok``."""
    if not ok:
        raise DrafterError(f"Invalid value for {key}.", expected=expected, found=_short(found),
                           fix=f"Set {key} to {expected} in the YAML or as an override {key}=...")


SEED_LIMIT = 2**62
"""Seeds lie in ``[0, SEED_LIMIT)``: torch takes 64 bits, and the stages add shard and step numbers to a seed."""


def check_seed(value: int, key: str) -> None:
    """Raise the standard bad-value error unless ``value`` is a seed in ``[0, 2**62)``."""
    check_value(0 <= value < SEED_LIMIT, key, "an integer in [0, 2**62)", value)


def check_devices(accelerator: str, devices: int | str, section: str) -> None:
    """Raise the standard bad-value error for ``<section>.accelerator`` / ``.devices`` Lightning would refuse deep in
    a run (or that would give a world of no ranks): auto, cpu or gpu; auto, a count >= 1, or GPU ids like "0,1"."""
    check_value(accelerator in ("auto", "cpu", "gpu", "cuda"), f"{section}.accelerator", "auto, cpu or gpu",
                accelerator)
    ids = str(devices).replace(" ", "").rstrip(",").split(",")
    ok = (devices == "auto" or (isinstance(devices, int) and devices >= 1)
          or (isinstance(devices, str) and "," not in devices and devices.isdigit() and int(devices) >= 1)
          or (isinstance(devices, str) and "," in devices and all(i.isdigit() for i in ids)))
    check_value(ok, f"{section}.devices", 'auto, a count >= 1, or GPU ids like "0,1"', devices)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "an int", "a float"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert where it is lossless (int → float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except DrafterError as err:
                errors.append(err)
        raise errors[0] if len(errors) == 1 else DrafterError(
            f"Config value {where} has the wrong type.",
            expected=" or ".join(_type_name(a) for a in args),
            found=f"{_short(value)} ({type(value).__name__})",
            fix=f"Set {where} to a value of the expected type.",
        )
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            value = [value]  # a scalar where a list is expected: `k=5` for `list[int]` means [5]
        item_tp = args[0] if args else Any
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise DrafterError(f"Config value {where} must be a mapping.", expected="a mapping {key: value, ...}",
                               found=_short(value), fix=f"Set {where} to a mapping, e.g. {where}={{}}.")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is Any:
        return value
    if tp is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:  # int -> float is lossless; YAML 1.1 reads 3e-4 (no dot) as a string, every user means the number
            number = float(value)
        except ValueError:
            number = None  # not a number: the type error below
        except OverflowError:
            number = math.inf  # an int beyond any float
        if number is not None:
            # nan fails every comparison and inf passes `> 0`, so range checks alone let them through into
            # sampling, schedules and gates; no float setting has a use for either.
            check_value(math.isfinite(number), where, "a finite number (not nan or inf)", value)
            return number
    if tp is Path and isinstance(value, str):
        return value
    if isinstance(tp, type) and not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise DrafterError(
            f"Config value {where} has the wrong type.",
            expected=_type_name(tp),
            found=f"{_short(value)} ({type(value).__name__})",
            fix=f"Set {where} to {_a(_type_name(tp))}.",
        )
    return value


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters: a message quotes a value, it need not hold all of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Build dataclass ``cls`` from a plain mapping; unknown keys and wrong types are errors."""
    label = where or cls.__name__
    if data is None:
        data = {}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    if not isinstance(data, dict):
        raise DrafterError(
            f"Config section {label!r} must be a mapping.",
            expected=f"a mapping with keys from: {', '.join(sorted(fields))}",
            found=_short(data),
            fix=(f"Write {where} as a section of `key: value` lines (or override {where}.KEY=VALUE)." if where
                 else "Write the file as `key: value` lines at top level."),
        )
    # YAML keys may be numbers, null or booleans; sort and print them as text, the way the user wrote them.
    unknown = sorted((str(k) for k in data if k not in fields), key=str)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise DrafterError(
            f"Unknown config key {key!r}.",
            expected=f"one of: {', '.join(sorted(fields))}" + (f" (in section {where!r})" if where else ""),
            found=", ".join(unknown),
            fix=(f"Fix the spelling, or see `drafter config --keys {where}` for every option there." if where
                 else "Fix the spelling, or see `drafter config --keys` for every option."),
        )
    hints = _hints(cls)
    kwargs = {}
    for name, value in data.items():
        factory = fields[name].default_factory
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, dict) and factory is not dataclasses.MISSING:
            # A nested section the parent gives its own defaults (e.g. a stage's training recipe): keys
            # the file sets go on top of those defaults, not of the nested class's.
            value = _deep_merge(to_dict(factory()), value)
        kwargs[name] = _coerce(value, hints[name], f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except DrafterError as err:
        raise _keyed(err, where) from None
    except (TypeError, ValueError) as err:
        raise DrafterError(f"Invalid config section {label!r}: {err}",
                           expected=f"values `drafter config --keys {where}` documents" if where
                           else "values `drafter config --keys` documents",
                           found=f"{type(err).__name__}: {err}",
                           fix="Fix the value the error names.") from err


def _keyed(err: DrafterError, where: str) -> DrafterError:
    """``err`` naming its key from the top: a section shared by several stages (``train``) checks its values as
    ``train.KEY``, which as an override names no key; inside ``train_drafter.train`` it is
    ``train_drafter.train.KEY``."""
    parent, _, section = where.rpartition(".")
    lead = "Invalid value for "
    key = err.problem.removeprefix(lead).removesuffix(".")  # e.g. "train.seed"
    if not parent or not err.problem.startswith(f"{lead}{section}.") or " " in key:
        return err
    full = f"{parent}.{key}"
    return DrafterError(err.problem.replace(key, full, 1), expected=err.expected, found=err.found,
                        fix=None if err.fix is None else err.fix.replace(f"{key} ", f"{full} ").replace(
                            f"{key}=", f"{full}="))


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def to_dict(obj: Any) -> Any:
    """Plain-data (JSON/YAML-serialisable) form of a config dataclass tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


# How a field relates to the artifact id of the stage that reads it (see :func:`identity`).
RUN_SETTING = "run_setting"
"""Where or how a job runs (accelerator, devices, nodes, workers, what to do after): never in an id."""
INPUT_OVERRIDE = "input_override"
"""A path to an upstream artifact used instead of the upstream stage's: the input's *id* enters the id."""


def run_setting(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field that does not change what a stage computes, only where or how it runs."""
    return dataclasses.field(default=default, metadata={"identity": RUN_SETTING}, **kwargs)


def input_override(default: Any = None) -> Any:
    """A dataclass field naming an upstream artifact directory to use instead of the upstream stage's."""
    return dataclasses.field(default=default, metadata={"identity": INPUT_OVERRIDE})


def identity(obj: Any) -> Any:
    """The plain-data form of a config (sub)tree with run settings and input overrides left out:
    exactly the fields that change a stage's result, which is what its artifact id hashes."""
    if dataclasses.is_dataclass(obj):
        return {f.name: identity(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.metadata.get("identity") not in (RUN_SETTING, INPUT_OVERRIDE)}
    return to_dict(obj)


def excluded_fields(cls: type, prefix: str = "") -> dict[str, str]:
    """Dotted key → why it is not part of any artifact id, for every such field under ``cls``."""
    out: dict[str, str] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(excluded_fields(hints[f.name], key + "."))
        elif f.metadata.get("identity") in (RUN_SETTING, INPUT_OVERRIDE):
            out[key] = f.metadata["identity"]
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"generate.max_new_tokens=64"`` → (["generate", "max_new_tokens"], 64). Values are YAML scalars (or flow
    collections, ``count.top_k=[8, 16]``); a value that is not YAML stays the text as written.

    Raises:
        DrafterError: no ``=``, no key before it, or a value YAML reads but Python cannot hold.
    """
    key, sep, raw = text.partition("=")
    path = [k for k in key.strip().split(".") if k]
    if not sep or not path:
        raise DrafterError(
            f"Cannot read the override {text!r}.",
            expected="key.path=value, e.g. generate.max_new_tokens=64",
            found=text if sep else f"{text} (no '=')",
            fix="Write each override as KEY=VALUE with a dotted key; `drafter config --keys` lists the keys.",
        )
    name = ".".join(path)
    if not raw.strip():
        raise DrafterError(f"The override {name}= has no value.", expected="a value after '='", found=repr(text),
                           fix=f"Write {name}=null for none, or {name}='\"\"' for empty text.")
    try:
        value, left_out = _yaml_value(raw)
    except yaml.YAMLError:
        value, left_out = raw, ""
    except (ValueError, RecursionError) as err:  # e.g. an int of more digits than Python converts
        raise DrafterError(
            f"Cannot read the value of the override {'.'.join(path)}=….",
            expected="a YAML value: a number, true/false, null, text, [a, b] or {k: v}",
            found=f"{_short(raw)}: {type(err).__name__}: {str(err)[:200]}",
            fix=f"Give {'.'.join(path)} a value of its type (`drafter config --keys {'.'.join(path)}` says which).",
        ) from err
    if left_out:  # `run #1`: YAML reads " #1" as a comment
        raise DrafterError(f"The value of the override {name} holds ' #', which YAML reads as the start of a "
                           "comment: what follows would be dropped.", expected="a value without a comment",
                           found=f"{raw!r}, read as {_short(value)} without {left_out!r}",
                           fix=f"Quote the value: {name}='\"{raw.strip()}\"'.")
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted overrides to a plain config mapping (validation happens in :func:`from_dict`)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for depth, key in enumerate(path[:-1]):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                section = ".".join(path[: depth + 1])
                raise DrafterError(
                    f"Override {text!r} goes through {section!r}, which is not a section.",
                    expected="a dotted key whose parts before the last are sections, e.g. generate.max_new_tokens=64",
                    found=f"{section} = {_short(node)}",
                    fix=f"Set {section} itself ({section}=VALUE), or see `drafter config --keys` for the keys.",
                )
        node[path[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config file into a mapping, with a clear error for a missing, unreadable or malformed file."""
    path = Path(path)
    if not path.exists() or path.is_dir():  # a pipe (`--config <(...)`) or a device is read like a file
        raise DrafterError(
            f"Config file {str(path)!r} does not exist.",
            expected="a YAML file",
            found="a directory" if path.is_dir() else "no such file",
            fix="Pass an existing YAML file, e.g. --config configs/tiny.yaml.",
        )
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DrafterError(f"Config file {str(path)!r} cannot be read.", expected="a readable YAML file",
                           found=f"{type(err).__name__}: {err}", fix="Check the file's permissions.") from err
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DrafterError(
            f"Config file {path.name} is not UTF-8 text (byte {err.start}: {raw[err.start:err.start + 1]!r}).",
            expected="a UTF-8 YAML file",
            found=f"{err.reason} at byte {err.start} of {len(raw)} ({path})",
            fix=f"Re-encode it, e.g. `iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`.",
        ) from err
    try:
        data = yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader (above)
    except yaml.YAMLError as err:
        raise DrafterError(f"Config file {str(path)!r} is not valid YAML: {err}",
                           expected="YAML mappings of `key: value`, as in configs/tiny.yaml",
                           found=str(getattr(err, "problem", None) or type(err).__name__),
                           fix="Fix the line the message names.") from err
    except (ValueError, RecursionError) as err:  # e.g. an int of more digits than Python converts
        raise DrafterError(f"Config file {str(path)!r} holds a value Python cannot read.",
                           expected="YAML numbers, text, lists and mappings of ordinary size",
                           found=f"{type(err).__name__}: {str(err)[:200]}",
                           fix="Fix the value the message names.") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DrafterError(f"Config file {str(path)!r} must hold a mapping at top level.",
                           expected="`key: value` lines at top level, as in configs/tiny.yaml",
                           found=_short(data), fix="Write the settings as a YAML mapping.")
    return data


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (litgpt style), by field name."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type, prefix: str = "", defaults: Any = None) -> list[tuple[str, str, str, str]]:
    """Rows (dotted key, type, default, doc) for every leaf option of ``cls``, for ``drafter config --keys``.

    ``defaults`` is the instance whose values are shown (a parent's default for a nested section, which may
    differ from the nested class's own defaults)."""
    rows = []
    docs = field_docs(cls)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key + ".", default if dataclasses.is_dataclass(default) else None))
            continue
        rows.append((key, _type_name(tp), repr(to_dict(default)), docs.get(f.name, "")))
    return rows
