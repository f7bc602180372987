"""An engine's model ``config.json``, read once for the sources that derive bytes per block.

``load_model_config`` reads one (the sources and ``kvledger plan``); the shapes derived
from it are ``model.block_bytes``'s.

``ModelConfig(cfg).load()`` is None when the engine's configuration gives ``block_bytes``
or no ``model``; otherwise the parsed file, read at the first call and kept. A file that
cannot be read or parsed is ``SourceError("config", ...)`` naming the engine and the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvledger.collect.sources.base import SourceError
from kvledger.config.files import read_regular
from kvledger.config.types import EngineConfig
from kvledger.domain.block_bytes import ModelConfigError


def load_model_config(path: str | Path) -> dict[str, Any]:
    """A ``config.json`` as a dict; a file that cannot be read or parsed is ModelConfigError."""
    try:
        data = json.loads(read_regular(path).decode("utf-8"))  # a regular file only: a FIFO is refused
    except OSError as exc:
        raise ModelConfigError(f"{path}: cannot read model config: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"{path}: model config is not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return data


class ModelConfig:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._loaded: dict[str, Any] | None = None

    def load(self) -> dict[str, Any] | None:
        if self.cfg.model is None or self.cfg.block_bytes is not None:
            return None
        if self._loaded is None:
            try:
                self._loaded = load_model_config(self.cfg.model.config)
            except ModelConfigError as exc:
                raise SourceError("config", f"engine {self.cfg.name!r}: model.config: {exc}") from None
        return self._loaded
