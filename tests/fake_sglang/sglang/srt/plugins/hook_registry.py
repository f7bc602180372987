"""Hooks on any function or method by dotted path: before, after, around (as SGLang's
``HookRegistry``: an AFTER hook gets ``(result, *args)``, an AROUND hook ``(original, *args)``)."""

from __future__ import annotations

import enum
import functools
import importlib
from collections.abc import Callable
from typing import Any, ClassVar


class HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


def _resolve(path: str) -> tuple[Any, str]:
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            obj = getattr(obj, name)
        return obj, parts[-1]
    raise ValueError(f"cannot resolve {path}")


def _wrap(original: Callable[..., Any], hook: Callable[..., Any], kind: HookType) -> Callable[..., Any]:
    if kind is HookType.AFTER:
        def after(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            changed = hook(result, *args, **kwargs)
            return result if changed is None else changed
        return functools.wraps(original)(after)
    if kind is HookType.AROUND:
        def around(*args: Any, **kwargs: Any) -> Any:
            return hook(original, *args, **kwargs)
        return functools.wraps(original)(around)
    if kind is HookType.BEFORE:
        def before(*args: Any, **kwargs: Any) -> Any:
            changed = hook(*args, **kwargs)
            if changed is not None:
                args, kwargs = changed
            return original(*args, **kwargs)
        return functools.wraps(original)(before)
    return functools.wraps(original)(lambda *a, **k: hook(*a, **k))


class HookRegistry:
    _hooks: ClassVar[dict[str, list[tuple[HookType, Callable[..., Any]]]]] = {}
    _patched: ClassVar[set[str]] = set()

    @classmethod
    def register(cls, target: str, hook: Callable[..., Any], hook_type: HookType = HookType.AFTER) -> None:
        cls._hooks.setdefault(target, []).append((hook_type, hook))

    @classmethod
    def apply_hooks(cls) -> None:
        for target, hooks in cls._hooks.items():
            if target in cls._patched:
                continue
            owner, name = _resolve(target)
            wrapped = getattr(owner, name)
            for kind, hook in hooks:
                wrapped = _wrap(wrapped, hook, kind)
            setattr(owner, name, wrapped)
            cls._patched.add(target)
