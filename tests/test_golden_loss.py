"""Golden losses: the tiny config's whole default run gives the stored losses.

The run is `configs/tiny.toml` as it is (512 synthetic samples, batch 8, 4 epochs: 256
steps, seed 0, the pipeline mode), in this process, with the end-of-run eval, checkpoints
and the export off (they come after the last step and change nothing in it). Its loss and
gradient norm at fixed steps must equal tests/golden/tiny_losses.json (losses to 1e-5
relative up to step 64, grad norms to 5 %: see REL_OF) (a
second, 40-step run with every loss option off its default: tiny_loss_options.json): a
change to the step's math, the data, the schedule or the seeding that moves them fails
here. The whole run, not a shorter one, because the LR schedule spans the planned steps: a
run cut by train.max_steps is another run from step 2 on.

A change that is meant to move the numbers rewrites the file and says why in its commit
message:

    DFLASH_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_golden_loss.py
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash import load_config
from tests.conftest import TINY, run_records

FOLDER = Path(__file__).parent / "golden"
# Beside run.output_dir (a temporary folder): what the run leaves out. None of it runs before
# the last step.
QUIET = ["eval.at_end=false", "checkpoint.at_end=false", "checkpoint.export_final=false"]
# The loss's options off the defaults, together: D-PACE weights, the noise schedule, target
# labels with the greedy prefix, the data's vocabulary with sampled negatives, a small chunk.
OPTIONS = [
    "train.max_steps=40", "loss.position_weights=\"dpace\"", "loss.noise_reveal_start=0.3",
    "loss.noise_reveal_end=0.1", "loss.labels=\"target\"", "loss.greedy_prefix_only=true",
    "loss.vocab=\"data\"", "loss.negatives=64", "loss.chunk=64",
]  # fmt: skip
FAMILY = {
    "dflash2": ["train.max_steps=40", 'drafter.family="dflash2"', "drafter.dflash2.selector_rank=32",
                "drafter.dflash2.selector_loss=0.5"],
    "dspark": ["train.max_steps=40", 'drafter.family="dspark"', "drafter.dspark.markov_rank=32"],
}  # fmt: skip
# name: (file, overrides, steps); every step of a run up to LATE_STEP (its own, where named in
# LATE_STEP_OF) is compared exactly
RUNS: dict[str, tuple[Path, list[str], list[int]]] = {
    # the first steps, then every 32nd to the end
    "default": (FOLDER / "tiny_losses.json", QUIET, [1, 2, 32, 64, 96, 128, 160, 192, 224, 256]),
    "loss_options": (FOLDER / "tiny_loss_options.json", [*QUIET, *OPTIONS], [1, 2, 10, 20, 30, 40]),
    # the families' terms: DFlash2's selector cross-entropy, DSpark's Markov bias and confidence BCE
    "dflash2": (FOLDER / "tiny_dflash2.json", [*QUIET, *FAMILY["dflash2"]], [1, 2, 10, 20, 30, 40]),
    "dspark": (FOLDER / "tiny_dspark.json", [*QUIET, *FAMILY["dspark"]], [1, 2, 10, 20, 30, 40]),
}
REL = 1e-5
# The records round to 6 decimals: one unit of the last one is ~1e-7 of a loss but ~3e-5 of a
# grad norm near 0.03, so a value that rounds the other way on another CPU is not a change.
ABS = 1.5e-6
# The same code on an AVX-512 CPU and on an AVX2 one (the golden files' maker) gives losses equal
# to 1e-5 but grad norms up to ~3 % apart late in the run (other kernels, other float sums, and
# a norm of small late gradients magnifies them): grad norms catch a broken backward, the
# losses any change in what training computes.
# Late in the 256-step run those differences grow, in the losses too (BENCHMARKS.md, "Golden
# losses across CPUs"): exact up to step 64, which any change to the step's math moves by far
# more, after it only gross changes.
REL_OF = {"loss": REL, "grad_norm": 5e-2}
LATE_STEP = 64
LATE_REL_OF = {"loss": 1e-2, "grad_norm": 0.25}
# DFlash2's selector ranks the drafter's top-K logits: a float difference that swaps two near-equal
# candidates changes its loss from that step on, so the same code on an AMD EPYC (AVX2) and the
# file's maker agree exactly to step 30 and then part (step 40: loss 6.4e-5 relative, grad norm
# 6 %). The families' runs are exact up to step 20, which any change to their terms moves by far
# more, and after it catch gross changes only.
LATE_STEP_OF = {"dflash2": 20, "dspark": 20}


def _rel(key: str, step: int, name: str) -> float:
    return LATE_REL_OF[key] if step > LATE_STEP_OF.get(name, LATE_STEP) else REL_OF[key]


WHY = (
    "Losses of the tiny config's whole default run. A change that moves these numbers changes what "
    "training computes: it must rewrite this file (the command below) and say why in its commit "
    "message. Refactors must leave them as they are."
)


def _losses(tmp_path: Path, overrides: list[str], at: list[int]) -> dict[str, dict[str, float]]:
    """{step: {loss, grad_norm}} at the steps `at` of the tiny run with `overrides`."""
    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', *overrides])
    records = run_records(cfg)
    steps = {r["step"]: r for r in records if r["event"] == "train_step"}
    assert records[-1]["event"] == "run_end" and records[-1]["steps"] == at[-1], records[-1]
    return {str(s): {"loss": steps[s]["loss"], "grad_norm": steps[s]["grad_norm"]} for s in at}


def _write(path: Path, overrides: list[str], got: dict[str, dict[str, float]]) -> None:
    doc: dict[str, Any] = {
        "why": WHY,
        "regenerate": "DFLASH_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_golden_loss.py",
        "run": "configs/tiny.toml in-process (tests/test_golden_loss.py): run.output_dir a temporary folder, "
        "and the overrides below; the same numbers as `bin/dflash run configs/tiny.toml`",
        "overrides": overrides,
        "rel_tol": REL,
        "abs_tol": ABS,
        "made_with": {"torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads()},
        "steps": got,
    }
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_tiny_run_gives_the_golden_losses(tmp_path: Path, name: str) -> None:
    """The tiny run's loss and grad norm at fixed steps equal the stored ones to 1e-5
    relative (or one unit of the records' last decimal): the whole default run, a 40-step
    run with every loss option off its default, and one of each drafter family (the file's
    settings must be this test's: else regenerate)."""
    path, overrides, at = RUNS[name]
    got = _losses(tmp_path, overrides, at)
    if os.environ.get("DFLASH_UPDATE_GOLDEN") == "1":
        _write(path, overrides, got)
        pytest.skip(f"rewrote {path.relative_to(TINY.parents[1])}: say why in the commit message")
    golden = json.loads(path.read_text(encoding="utf-8"))
    assert golden["overrides"] == overrides and list(golden["steps"]) == [str(s) for s in at], (
        "the file was made with other settings: regenerate it (see its `regenerate`)"
    )
    moved = {
        f"{step}.{key}": (want[key], got[step][key])
        for step, want in golden["steps"].items()
        for key in ("loss", "grad_norm")
        if not math.isclose(got[step][key], want[key], rel_tol=_rel(key, int(step), name), abs_tol=ABS)
    }
    assert not moved, (
        f"losses moved from the golden ones (step.key: golden, now): {moved}; golden made with "
        f"{golden['made_with']}, now torch {torch.__version__}. {golden['why']}"
    )
