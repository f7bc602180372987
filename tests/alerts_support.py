"""Load the alerts/ scripts (generate.py, lint.py) as modules for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "alerts"
RULES = ALERTS / "kvledger.rules.yml"


def load(name: str) -> ModuleType:
    """alerts/<name>.py as module ``kvledger_alerts_<name>``."""
    mod_name = f"kvledger_alerts_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, ALERTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module
