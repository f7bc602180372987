"""An engine's model ``config.json``, read once for the sources that derive bytes per block.

``ModelConfig(cfg).load()`` is None when the engine's configuration gives ``block_bytes``
or no ``model``; otherwise the parsed file, read at the first call and kept. A file that
cannot be read or parsed is ``SourceError("config", ...)`` naming the engine and the key.
"""

from __future__ import annotations

from typing import Any

from kvledger.collect.sources.base import SourceError
from kvledger.config.model import EngineConfig
from kvledger.model.block_bytes import ModelConfigError, load_model_config


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
