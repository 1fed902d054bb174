"""dflash: train DFlash speculative-decoding drafters through an asyncio pipeline.

    import dflash
    cfg = dflash.load_config("configs/tiny.toml", ["train.max_steps=20"])
    summary = dflash.run(cfg)                      # synchronous callers
    summary = await dflash.Coordinator(cfg).run()  # inside your own event loop
"""

from dflash.config import Config, dump_toml, load_config, parse_config
from dflash.coordinator import Coordinator, run
from dflash.errors import CheckpointError, ConfigError, DataError, DFlashError, StageError
from dflash.export import export_drafter, load_drafter

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
