"""Command-line options as dataclasses: one field per flag, the parser generated from the fields.

Every subcommand declares its options once, as a keyword-only dataclass whose fields say
their flag's help, help section, aliases, choices and accepted range (``option``, ``switch``);
``add_options`` makes the argparse flags from the fields and ``from_namespace`` builds the
typed object back from the parsed flags, so the parser and the config cannot drift apart.
A flag is ``--`` + the field name with dashes (Megatron-LM's spelling, e.g.
``--pipeline-model-parallel-size``) unless ``flag=`` names another; older short spellings
(``--pp``, ``-m``) stay as ``aliases``. A ``nested`` field holds another options dataclass
whose flags join the parser with the parent's defaults (``simulate`` and ``bench`` share the
workload flags). Standard library only.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Optional

from .checks import Bound

_OPTION, _NESTED, _EXTERNAL = "option", "nested", "external"


def option(default: Any = None, help: Optional[str] = None, *, group: Optional[str] = None,
           flag: Optional[str] = None, aliases: tuple[str, ...] = (), bound: Optional[Bound] = None,
           positional: bool = False, **argparse_kwargs: Any) -> Any:
    """A field for one flag. ``bound``: the accepted range (the flag's type: a bad value stops
    the parse); ``group``: its help section; ``positional``: an argument without a flag
    (``default`` unused); ``argparse_kwargs``: choices, metavar, type or action, as argparse takes them."""
    meta = {"help": help, "group": group, "flag": flag, "aliases": tuple(aliases), "bound": bound,
            "positional": positional, "argparse": argparse_kwargs}
    return dataclasses.field(default=default, metadata={_OPTION: meta})


def switch(help: str, *, group: Optional[str] = None, flag: Optional[str] = None,
           aliases: tuple[str, ...] = ()) -> Any:
    """A boolean flag: off unless given."""
    return option(False, help, group=group, flag=flag, aliases=aliases, action="store_true")


def nested(cls: type, *, group: Optional[str] = None, **defaults: Any) -> Any:
    """A field holding an options dataclass ``cls``, whose flags join the parser with ``defaults``
    in place of the field defaults; ``group``: the help section of those that name none themselves."""
    return dataclasses.field(default_factory=lambda: cls(**defaults), metadata={_NESTED: (cls, group, defaults)})


def external(default: Any) -> Any:
    """A field whose flag another function adds to the parser (``megatron_lm.flags``' ``--rrfp-*``,
    shared with Megatron-LM's own parser): read back by ``from_namespace``, not generated."""
    return dataclasses.field(default=default, metadata={_EXTERNAL: True})


def flag_of(f: dataclasses.Field) -> str:
    """The flag of field ``f`` (its name for a positional argument)."""
    meta = f.metadata.get(_OPTION) or {}
    if meta.get("positional"):
        return f.name
    return meta.get("flag") or "--" + f.name.replace("_", "-")


def flags(cls: type) -> dict[str, str]:
    """Field name -> flag, nested fields included."""
    return {f.name: flag_of(f) for _, f, _, _ in _walk(cls, {}, None, external=True)}


def add_options(parser: argparse.ArgumentParser, cls: type, **defaults: Any) -> argparse.ArgumentParser:
    """One argparse argument per field of ``cls`` (``external`` ones excepted); ``defaults``: field
    name -> default in place of the field's own; "(default X)" ends the help of a flag with a value."""
    groups: dict[str, Any] = {}
    for owner, f, default, group in _walk(cls, defaults, None):
        meta = f.metadata[_OPTION]
        title = meta["group"] or group
        if title is not None and title not in groups:
            groups[title] = parser.add_argument_group(title)
        target = parser if title is None else groups[title]
        kwargs, help_text = dict(meta["argparse"]), meta["help"]
        if meta["positional"]:
            target.add_argument(f.name, help=help_text, **kwargs)
            continue
        if kwargs.get("action") is None:  # a flag with a value: typed by its range, or by its default
            bound = meta["bound"] or getattr(owner, "BOUNDS", {}).get(f.name)
            if bound is not None:
                kwargs["type"] = bound.parse
            elif "type" not in kwargs and default is not None:
                kwargs["type"] = type(default)
            if help_text is not None and default is not None:
                help_text += f" (default {default})"
            if meta["flag"] and "metavar" not in kwargs:  # named after what is typed, not the field
                kwargs["metavar"] = meta["flag"].lstrip("-").replace("-", "_").upper()
        target.add_argument(flag_of(f), *meta["aliases"], dest=f.name, default=default, help=help_text, **kwargs)
    return parser


def add_command(subparsers: Any, name: str, cls: type, run: Callable[[Any], int], *,
                defaults: Optional[dict] = None, **parser_kwargs: Any) -> argparse.ArgumentParser:
    """Subcommand ``name``: the flags of ``cls``; running it calls ``run`` with the parsed ``cls``."""
    parser = subparsers.add_parser(name, **parser_kwargs)
    add_options(parser, cls, **(defaults or {}))
    parser.set_defaults(func=lambda args: run(from_namespace(cls, args)))
    return parser


def from_namespace(cls: type, args: argparse.Namespace) -> Any:
    """The ``cls`` the parsed ``args`` describe (its ``__post_init__`` checks run)."""
    values = {}
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            values[f.name] = from_namespace(f.metadata[_NESTED][0], args)
        elif _OPTION in f.metadata or _EXTERNAL in f.metadata:
            values[f.name] = getattr(args, f.name)
    return cls(**values)


def to_argv(config: Any, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that reproduce ``config``: those whose value differs from the field's default."""
    argv = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if _NESTED in f.metadata:
            argv += to_argv(value, skip=skip)
        elif f.name in skip or value == f.default or not ({_OPTION, _EXTERNAL} & set(f.metadata)):
            continue
        elif (f.metadata.get(_OPTION) or {}).get("positional"):
            argv.append(str(value))
        else:
            text = (repr(value) if isinstance(value, float) else
                    ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))
            argv += [flag_of(f)] if isinstance(value, bool) else [flag_of(f), text]
    return argv


def _walk(cls: type, defaults: dict, group: Optional[str], *, external: bool = False
          ) -> Iterator[tuple[type, dataclasses.Field, Any, Optional[str]]]:
    """(owning class, field, its default, inherited help section) of every flag field."""
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            inner, inner_group, inner_defaults = f.metadata[_NESTED]
            yield from _walk(inner, {**inner_defaults, **defaults}, inner_group or group, external=external)
        elif _OPTION in f.metadata or (external and _EXTERNAL in f.metadata):
            yield cls, f, defaults.get(f.name, f.default), group


__all__ = ["add_command", "add_options", "external", "flag_of", "flags", "from_namespace", "nested", "option", "switch",
           "to_argv"]
