"""dflash: train DFlash speculative-decoding drafters through an asyncio pipeline.

import dflash
cfg = dflash.load_config("configs/tiny.toml", ["train.max_steps=20"])
summary = dflash.run(cfg)                      # synchronous callers
summary = await dflash.Coordinator(cfg).run()  # inside your own event loop
"""

from typing import Any

from dflash.config import Config, dump_toml, load_config, parse_config
from dflash.errors import CheckpointError, ConfigError, DataError, DFlashError, StageError

# torch-heavy parts load on first use, so that `dflash config show` and errors are instant.
_LAZY = {
    "Coordinator": "dflash.pipeline.coordinator",
    "run": "dflash.pipeline.runner",
    "export_drafter": "dflash.model.export",
    "load_drafter": "dflash.model.export",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    msg = f"module 'dflash' has no attribute {name!r}"
    raise AttributeError(msg)


__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "Coordinator",
    "DFlashError",
    "DataError",
    "StageError",
    "__version__",
    "dump_toml",
    "export_drafter",
    "load_config",
    "load_drafter",
    "parse_config",
    "run",
]
