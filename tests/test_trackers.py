"""Experiment trackers fed from the records (`run.trackers`, `dflash run --tracker`), and the
HTML report (`dflash report --html`, `--compare`)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from dflash.errors import ConfigError
from dflash.trackers import scalars_of
from tests.conftest import ROOT, dflash, run_records

STEPS = {"train.max_steps": "12", "train.log_every": "2", "eval.at_end": "false", "profile.interval_s": "0.2"}


class Recorder:
    """A tracker double: what it was given, and a fault at its `fail_at`-th call."""

    name = "tensorboard"
    where = "a test double"
    made: ClassVar[list[Recorder]] = []

    def __init__(self, run_dir: Path, run_name: str, config: dict, fail_at: int = 0) -> None:
        self.run_name, self.config, self.logged, self.closed = run_name, config, [], False
        self.fail_at = fail_at
        Recorder.made.append(self)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.logged.append((step, scalars))
        if self.fail_at and len(self.logged) == self.fail_at:
            raise RuntimeError("the dashboard is gone")

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def recorder(monkeypatch):
    from dflash.trackers import backends

    Recorder.made = []

    def install(fail_at: int = 0) -> None:
        monkeypatch.setitem(backends.BACKENDS, "tensorboard", lambda *a: Recorder(*a[:3], fail_at=fail_at))

    return install


def _losses(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records if r["event"] == "train_step"]


def test_scalars_of_the_records_a_dashboard_plots():
    step = {"event": "train_step", "step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tau_sim": 1.7,
            "tokens_per_s": 900.0, "acc": [0.5, 0.25], "skipped": False}  # fmt: skip
    assert scalars_of(step) == {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/tau_sim": 1.7,
                                "train/tokens_per_s": 900.0, "train/acc_k1": 0.5, "train/acc_k2": 0.25}  # fmt: skip
    assert scalars_of({**step, "loss": None}).get("train/loss") is None  # a non-finite loss: no point
    profile = {"event": "profile", "stages": {"drafter.forward": {"mean_ms": 4.0, "mfu": 0.1}},
               "queues": {"hidden_states": {"mean_depth": 1.5}}, "tokens_per_s": {"drafter": 10.0}}  # fmt: skip
    assert scalars_of(profile) == {"profile/drafter.forward_ms": 4.0, "profile/drafter.forward_mfu": 0.1,
                                   "queue/hidden_states": 1.5, "profile/drafter_tokens_per_s": 10.0}  # fmt: skip
    ev = {"event": "eval", "prompt_set": "mtbench", "turn": 2, "tau": 1.3, "accept_per_position": [0.3],
          "lossless": True}  # fmt: skip
    assert scalars_of(ev) == {"eval/mtbench/turn2/tau": 1.3, "eval/mtbench/turn2/accept_k1": 0.3,
                              "eval/mtbench/turn2/lossless": 1.0}  # fmt: skip
    turns = {"event": "eval", "prompt_set": "mtbench", "tau": 1.3, "tau_per_turn": [1.25, 1.35]}
    assert scalars_of(turns) == {"eval/mtbench/tau": 1.3, "eval/mtbench/turn1/tau": 1.25,
                                 "eval/mtbench/turn2/tau": 1.35}  # fmt: skip
    assert scalars_of({"event": "checkpoint", "step": 4}) == {}


def test_a_tracker_gets_every_step_the_config_and_the_name(tiny_config, recorder):
    recorder()
    threads = set(threading.enumerate())
    records = run_records(tiny_config(**STEPS, **{"run.trackers": '["tensorboard"]', "run.name": '"watched"'}))
    (tracker,) = Recorder.made
    assert tracker.closed and tracker.run_name == "watched" and tracker.config["train"]["max_steps"] == 12
    logged = {step: s["train/loss"] for step, s in tracker.logged if "train/loss" in s}
    assert logged == dict(_losses(records)) and len(logged) >= 4
    assert any(k.startswith("profile/") for _, s in tracker.logged for k in s)
    assert set(threading.enumerate()) == threads  # the writer joined


def test_a_tracker_that_raises_is_dropped_with_one_warning_and_the_run_is_the_same(tiny_config, recorder):
    plain = run_records(tiny_config(**STEPS, **{"run.name": '"plain"'}))
    recorder(fail_at=3)
    threads = set(threading.enumerate())
    records = run_records(tiny_config(**STEPS, **{"run.trackers": '["tensorboard"]', "run.name": '"faulty"'}))
    warnings = [r for r in records if r["event"] == "warning" and "tracker" in r.get("message", "")]
    assert len(warnings) == 1 and "tensorboard failed while logging (RuntimeError: the dashboard is gone)" in (
        warnings[0]["message"]
    ), warnings
    assert _losses(records) == _losses(plain) and records[-1]["event"] == "run_end"
    assert len(Recorder.made[0].logged) == 3 and set(threading.enumerate()) == threads


def test_a_tracker_not_installed_is_one_line_before_any_step(tiny_config, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    records: list[dict] = []
    with pytest.raises(ConfigError, match=re.escape("run.trackers: wandb is not installed (wandb); "
                                                    "pip install 'dflash[trackers]'")):  # fmt: skip
        run_records(tiny_config(**STEPS, **{"run.trackers": '["wandb"]'}), into=records)
    assert not [r for r in records if r["event"] == "train_step"]


def test_a_bogus_tracker_on_the_command_line_is_one_line_exit_2(tmp_path):
    proc = dflash("run", str(ROOT / "configs" / "tiny.toml"), "--set", f'run.output_dir="{tmp_path}"',
                  "--tracker", "nope")  # fmt: skip
    assert proc.returncode == 2 and "train_step" not in proc.stdout, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "run.trackers" in line and "tensorboard" in line, line


def test_the_html_report_draws_a_run_and_compares_two(tiny_config, tmp_path):
    a = run_records(tiny_config(**STEPS, **{"run.name": '"alpha"'}))
    b = run_records(tiny_config(**STEPS, **{"run.name": '"beta"', "optimizer.lr": "1e-3"}))
    out = tmp_path / "one.html"
    proc = dflash("report", str(tmp_path / "alpha"), "--html", str(out))
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert page.count("<svg") >= 6 and "alpha" in page
    # self-contained: nothing fetched (SVG names its XML namespaces and metadata by address; nothing loads one)
    assert not re.search(r"<(script|link|img|iframe)[^>]*(src|href)=", page)
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page)
    both = tmp_path / "both.html"
    proc = dflash("report", "--compare", str(tmp_path / "alpha"), str(tmp_path / "beta"),
                  "--html", str(both))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    blob = re.search(r"<script type='application/json' id='dflash-series'>(.*?)</script>", both.read_text(), re.S)
    assert blob is not None
    runs = {r["name"]: r for r in json.loads(blob.group(1).replace("<\\/", "</"))["runs"]}
    assert set(runs) == {"alpha", "beta"}
    assert runs["alpha"]["train"]["loss"] == [loss for _, loss in _losses(a)]
    assert runs["beta"]["train"]["loss"] == [loss for _, loss in _losses(b)]


def _wandb_records(path: Path) -> list:
    """The protobuf records of a wandb run file (LevelDB's log format: 32 KiB blocks of chunks,
    each a CRC, a length and a type: full, first, middle, last), after its 7-byte header."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, part = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
    return out


def test_the_four_trackers_hold_the_runs_series_and_config(tmp_path):
    import sqlite3

    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {"WANDB_MODE": "offline", "TRACKIO_DIR": str(tmp_path / "trackio"), "HOME": str(tmp_path)}
    sets = [a for kv in [f'run.output_dir="{tmp_path}"', 'run.name="watched"', "train.max_steps=6",
                         "data.num_samples=32", "eval.at_end=false", "profile.interval_s=0.2"] for a in ("--set", kv)]
    proc = dflash("run", str(ROOT / "configs" / "tiny.toml"), *sets, "--tracker", "tensorboard", "--tracker", "wandb",
                  "--tracker", "mlflow", "--tracker", "trackio", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]  # stdout: the records alone
    losses = dict(_losses(records))
    assert len(losses) == 6 and not [r for r in records if r["event"] == "warning"]
    run = tmp_path / "watched"
    # the trackers' greetings held back (Trackio's prints, MLflow's set-up lines); where each wrote: one line each
    assert "Trackio" not in proc.stderr and "Creating initial MLflow database" not in proc.stderr, proc.stderr
    where = records[-1]["trackers"]
    assert all(f"dflash: {name}: {w}" in proc.stderr for name, w in where.items()), proc.stderr
    assert where["tensorboard"] == f"tensorboard --logdir {run / 'tensorboard'}"
    assert where["mlflow"] == f"mlflow ui --backend-store-uri sqlite:///{(run / 'mlflow.db').resolve()}"
    assert where["wandb"].startswith(f"wandb sync {run / 'wandb' / 'offline-run-'}")
    assert where["trackio"] == f"TRACKIO_DIR={tmp_path / 'trackio'} trackio show --project dflash"
    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    assert {e.step: e.value for e in board.Scalars("train/loss")} == pytest.approx(losses, abs=1e-6)
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("dflash").experiment_id])
    assert found.info.run_name == "watched" and found.data.params["train.max_steps"] == "6"
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")}
    assert history == pytest.approx(losses, abs=1e-6)
    (wandb_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    kept = _wandb_records(wandb_file)
    (start,) = [r.run for r in kept if r.WhichOneof("record_type") == "run"]
    assert start.display_name == "watched" and "train" in {u.key for u in start.config.update}
    steps = [{i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
             for r in kept if r.WhichOneof("record_type") == "history"]  # fmt: skip
    assert float([s for s in steps if "train/loss" in s][-1]["train/loss"]) == pytest.approx(losses[6], abs=1e-6)
    db = sqlite3.connect(tmp_path / "trackio" / "dflash.db")
    (config,) = db.execute("select config from configs where run_name = 'watched'").fetchall()
    assert json.loads(config[0])["train"]["max_steps"] == 6
    rows = db.execute("select step, metrics from metrics where run_name = 'watched' order by id").fetchall()
    assert [json.loads(m)["train/loss"] for s, m in rows if "train/loss" in json.loads(m)][-1] == losses[6]


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_the_loss_parts_add_up_to_the_loss(tiny_config, family):
    """`train_step`'s `loss_parts`: CE, the distillation term where `loss.distill` > 0, the
    family's heads where it has them; their sum is the loss."""
    cfg = tiny_config(**STEPS, **{"drafter.family": f'"{family}"', "loss.distill": "0.5"})
    steps = [r for r in run_records(cfg) if r["event"] == "train_step"]
    want = {"ce", "distill"} | ({"family"} if family != "dflash" else set())
    for r in steps:
        assert set(r["loss_parts"]) == want and sum(r["loss_parts"].values()) == pytest.approx(r["loss"], abs=2e-6)


def test_an_embedded_run_with_the_four_trackers_leaves_nothing_behind(tiny_config, tmp_path, monkeypatch):
    """`Coordinator.run` with every tracker: when it returns, the threads are the ones before it,
    no child process is left (wandb's service ends with its run) and no file of the run folder is
    open."""
    import psutil

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    threads, me = set(threading.enumerate()), psutil.Process()
    children = {p.pid for p in me.children(recursive=True)}  # the tests' own (a forked CLI server)
    records = run_records(tiny_config(**STEPS, **{"run.trackers": json.dumps(["tensorboard", "wandb", "mlflow",
                                                                              "trackio"])}))  # fmt: skip
    assert records[-1]["event"] == "run_end" and not [r for r in records if r["event"] == "warning"]
    assert set(threading.enumerate()) == threads
    assert [p for p in me.children(recursive=True) if p.pid not in children] == []
    assert [f.path for f in me.open_files() if f.path.startswith(str(tmp_path))] == []
