"""General plugins: entry points of group ``sglang.srt.plugins``, each called once, then
the hooks they registered applied (as SGLang's ``load_plugins`` does)."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

from sglang.srt.plugins.hook_registry import HookRegistry

GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"


def load_plugins() -> list[str]:
    allowed = {x.strip() for x in os.environ.get("SGLANG_PLUGINS", "").split(",") if x.strip()}
    loaded = []
    for ep in entry_points(group=GENERAL_PLUGINS_GROUP):
        if allowed and ep.name not in allowed:
            continue
        ep.load()()
        loaded.append(ep.name)
    HookRegistry.apply_hooks()
    return loaded
