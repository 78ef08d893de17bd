"""The one way to turn a ``_target_`` node into an object.

The dotted path is checked against the allowlist *before* anything is
imported, so ``_target_: os.system`` is refused without ``os.system`` ever
being looked up. Keyword arguments are checked against the callable's
signature with a "did you mean", and runtime arguments may not shadow
config fields.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Sequence
from typing import Any

from miles.config.schema import TargetConfig
from miles.config.validate import ConfigError, suggest

BUILTIN_ALLOW: tuple[str, ...] = ("miles.", "torch.optim.")


def check_allowed(target: str, allow: Sequence[str] = (), key: str = "_target_") -> None:
    """Raise :class:`ConfigError` unless ``target`` starts with an allowed prefix. Imports nothing."""
    prefixes = tuple(BUILTIN_ALLOW) + tuple(allow)
    if not any(target == p.rstrip(".") or target.startswith(p if p.endswith(".") else p + ".") for p in prefixes):
        raise ConfigError(
            f"{key}: '{target}' is not allowed. Targets must start with one of {', '.join(prefixes)}; "
            "to use your own code add its module prefix to plugins.allow (e.g. plugins.allow=[my_pkg.])"
        )


def locate(target: str) -> Any:
    """Import ``a.b.c`` as attribute ``c`` of module ``a.b`` (or deeper attribute chains)."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not ".".join(parts[:i]).startswith(e.name):
                raise  # a dependency of the module is missing: report that, not the path
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ConfigError(f"_target_: cannot import '{target}': no such module or attribute")


def build(node: TargetConfig, *, allow: Sequence[str] = (), key: str = "_target_", **runtime: Any) -> Any:
    """Instantiate ``node``: call its target with config kwargs plus ``runtime`` kwargs.

    ``runtime`` kwargs are objects only known at run time (a tokenizer, a model); they may not
    repeat a key set in config. With ``_partial_: true`` a ``functools.partial`` is returned.
    """
    check_allowed(node.target, allow, key)
    shadowed = sorted(set(node.kwargs) & set(runtime))
    if shadowed:
        raise ConfigError(f"{key}: runtime argument(s) {shadowed} would shadow config keys of '{node.target}'")
    fn = locate(node.target)
    kwargs = {k: _build_nested(v, allow, f"{key}.{k}") for k, v in node.kwargs.items()}
    _check_signature(fn, kwargs, node.target, key)
    kwargs.update(runtime)
    if node.partial:
        return functools.partial(fn, **kwargs)
    return fn(**kwargs)


def _build_nested(value: Any, allow: Sequence[str], key: str) -> Any:
    """Nested ``_target_`` mappings inside kwargs, also as items of a list, are built too (allowlist applies)."""
    if isinstance(value, dict) and "_target_" in value:
        from miles.config.validate import to_target

        return build(to_target(value, key), allow=allow, key=key)
    if isinstance(value, list | tuple) and any(isinstance(v, dict) and "_target_" in v for v in value):
        return [_build_nested(v, allow, f"{key}[{i}]") for i, v in enumerate(value)]
    return value


def _check_signature(fn: Any, kwargs: dict[str, Any], target: str, key: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for k in kwargs:
        if k not in params:
            names = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
            raise ConfigError(
                f"{key}.{k}: '{target}' takes no argument '{k}'{suggest(k, names)}. "
                f"Valid arguments: {', '.join(names)}"
            )
