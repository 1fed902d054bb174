"""The four trackers, each behind `log(step, scalars)` and `close()`; offline first.

- `tensorboard`: event files in `<run>/tensorboard` (torch's `SummaryWriter`).
- `wandb`: a run under `<run>/wandb`; offline (`wandb sync <run>/wandb/offline-run-*` uploads it
  later) when `WANDB_MODE=offline` or no API key is set (`WANDB_API_KEY`, or `wandb login`'s
  netrc entry); project `WANDB_PROJECT`, else "dflash".
- `mlflow`: a run in the experiment "dflash" at `MLFLOW_TRACKING_URI`, else in a SQLite store in
  the run folder (`mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db`; MLflow's file store
  is frozen); the config as its parameters.
- `trackio`: a run in Trackio's local store (project "dflash"; `trackio show`).

A tracker not installed, or unable to start: one line naming it and the extra to install.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError
from dflash.trackers.common import EXTRA, Scalars, Tracker, flat_config, quiet

PROJECT = "dflash"



def start(name: str, run_dir: Path, run_name: str, config: Mapping[str, Any], rank: int | None = None) -> Tracker:
    """`rank` (every rank writes): TensorBoard to `tensorboard/rank<N>`, MLflow's local store
    `mlflow.rank<N>.db`; wandb and Trackio keep the runs apart by name."""
    make = BACKENDS[name]
    try:
        with quiet():  # their greetings held back: stdout is the records'
            return make(run_dir, run_name, config, rank)
    except ImportError as err:
        msg = f"run.trackers: {name} is not installed ({err.name or err}); {EXTRA}"
        raise ConfigError(msg) from None
    except ConfigError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0]
        msg = f"run.trackers: {name} could not start ({type(err).__name__}: {first[:200]})"
        raise ConfigError(msg) from None


class TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any], rank: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        where = run_dir / "tensorboard" if rank is None else run_dir / "tensorboard" / f"rank{rank}"
        self.writer = SummaryWriter(log_dir=str(where))
        self.where = f"tensorboard --logdir {shlex.quote(str(where))}"
        self.writer.add_text("config", "    " + json.dumps(config, indent=1).replace("\n", "\n    "), 0)
        self.writer.add_text("run", run_name, 0)

    def log(self, step: int, scalars: Scalars) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # one event a step with every scalar (add_scalar writes an event for each)
        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        self.writer._get_file_writer().add_summary(Summary(value=values), step)

    def close(self) -> None:
        self.writer.close()


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandB:
    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any], rank: int | None = None) -> None:
        import wandb

        offline = os.environ.get("WANDB_MODE") == "offline" or not _wandb_key()
        self._wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, dir=str(run_dir), config=dict(config),
            mode="offline" if offline else "online", settings=wandb.Settings(console="off", silent=True),
            reinit="create_new",
        )  # fmt: skip
        self.where = (f"wandb sync {shlex.quote(str(Path(self.run.dir).parent))}" if offline
                      else str(self.run.url or f"wandb project {self.run.project}, run {self.run.name}"))  # fmt: skip

    def log(self, step: int, scalars: Scalars) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        try:
            self.run.finish()
        finally:
            self._wandb.teardown()  # its service process ends with the run, not with the interpreter


class MLflow:
    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any], rank: int | None = None) -> None:
        import logging

        from mlflow import MlflowClient
        from mlflow.entities import Param

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its database set-up's INFO lines

        db = run_dir / ("mlflow.db" if rank is None else f"mlflow.rank{rank}.db")
        self.local = None if os.environ.get("MLFLOW_TRACKING_URI") else f"sqlite:///{db.resolve()}"
        self.client = MlflowClient(tracking_uri=self.local or os.environ["MLFLOW_TRACKING_URI"])
        exp = self.client.get_experiment_by_name(PROJECT)
        if exp is None:
            try:
                exp_id = self.client.create_experiment(PROJECT)
            except Exception:  # another process made it first
                exp_id = self.client.get_experiment_by_name(PROJECT).experiment_id
        else:
            exp_id = exp.experiment_id
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.where = (f"mlflow ui --backend-store-uri {shlex.quote(self.local)}" if self.local
                      else f"{os.environ['MLFLOW_TRACKING_URI']}, experiment {PROJECT}, run {self.run_id}")  # fmt: skip
        params = [Param(k, v[:6000]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, scalars: Scalars) -> None:
        self.log_many([(step, scalars)])

    def log_many(self, steps: list[tuple[int, Scalars]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for step, scalars in steps for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1,000 metrics a call
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
        if self.local is not None:  # MLflow keeps an engine per database open: the run folder's, closed
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            engine = SqlAlchemyStore._engine_map.pop(self.local, None)
            if engine is not None:
                engine.dispose()


class Trackio:
    name = "trackio"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any], rank: int | None = None) -> None:
        import trackio

        # the run object itself: trackio.log() finds its run in a context variable of the thread
        # that started it, and the writer thread is another
        self.run = trackio.init(project=PROJECT, name=run_name, config=dict(config), auto_log_gpu=False,
                                auto_log_cpu=False)  # fmt: skip
        home = os.environ.get("TRACKIO_DIR")
        self.where = f"{f'TRACKIO_DIR={shlex.quote(home)} ' if home else ''}trackio show --project {PROJECT}"

    def log(self, step: int, scalars: Scalars) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


BACKENDS: dict[str, Any] = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "trackio": Trackio}
