"""Sequence parallelism (`pipeline.sequence_parallel = N`): N drafter replicas train one row
together, each holding 1/N of the context and of the blocks, an all-to-all by heads around each
attention. The step does not depend on N: the loss summed over the ranks, and the gradients
summed, equal the one-rank step's, for every family, with sliding layers, γ-decay and D-PACE,
and with KV heads fewer than the ranks (repeated)."""

from __future__ import annotations

import threading

import pytest
import torch

from dflash.errors import CheckpointError, ConfigError, DataError
from tests.conftest import ROOT, run_records


def _run_threads(fns: list) -> list:
    """Each function in its own thread (as the pipeline runs the replicas); their results."""
    out: list = [None] * len(fns)

    def work(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # surfaced below
            out[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(fns))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def _steps(cfg, grouped: bool = False):
    """One micro-step of the run's first batch (the drafter in float64; some family terms
    compute in float32): on one replica alone, and on the
    run's sequence-parallel group (each rank in its own thread). For each: the loss summed over
    the ranks, Σ w, and the gradients summed."""
    import copy
    import dataclasses

    from dflash.roofline import flops
    from dflash.runtime.devices import Device
    from dflash.runtime.messages import HostFeatures
    from dflash.stages import target_forward
    from dflash.stages.prefetch import next_batch
    from dflash.train.build import build_training

    t = build_training(cfg)
    micro = dataclasses.replace(t.micro, grouped=grouped)
    batch = next_batch(iter(t.plan), False)
    layers, teacher = target_forward.forward(t.targets[0], batch, t.targets[0].teacher_topk)
    feats = HostFeatures(batch, torch.cat(layers, -1).double(), 0, teacher=teacher)
    for rep in t.replicas:
        rep.model.double()
        rep.head = type(rep.head)(rep.head.embed.double(), rep.head.lm_head.double())
    alone = dataclasses.replace(t.replicas[0], model=copy.deepcopy(t.replicas[0].model), seq_group=None, seq_rank=0)

    def step(rep):
        def go():
            dev = Device("cpu", f"d{rep.seq_rank}")
            try:
                prepared = micro.prepare(rep, dev, feats, 0)
                work = flops.of_prepared(rep, prepared, micro.loss.chunk)
                return micro.compute(rep, dev, prepared), work.forward + work.backward
            except BaseException:
                if rep.seq_group is not None:
                    rep.seq_group.abort()
                raise
            finally:
                dev.close()

        return go

    results = []
    for reps in ([alone], t.replicas):
        out, work = zip(*_run_threads([step(r) for r in reps]), strict=True)
        names = [n for n, _ in reps[0].model.named_parameters()]
        grads = {n: sum(dict(r.model.named_parameters())[n].grad for r in reps) for n in names}
        results.append((sum(o.loss_sum for o in out), sum(o.weight_sum for o in out), grads, sum(work)))
    return results


def _compare(cfg, n: int, grouped: bool = False, **kw: str) -> None:
    sp = {"pipeline.drafter_devices": str(["cpu"] * n), "pipeline.sequence_parallel": str(n)}
    one, many = _steps(cfg(**kw, **sp), grouped)
    assert abs(float(one[0] - many[0])) <= 1e-6 * abs(float(one[0])), (one[0], many[0])
    assert one[1] == pytest.approx(many[1], rel=1e-6)  # Σ w: float32 sums in another order
    for name, g in one[2].items():  # max|Δ| ≤ 1e-6 · max|g|, tensor by tensor
        assert torch.allclose(g, many[2][name], rtol=0, atol=1e-6 * float(g.abs().max()) + 1e-15), name
    assert many[3] == pytest.approx(one[3], rel=1e-9)  # the profiler's FLOPs: the ranks' add up to the row's


FAMILIES = {
    "dflash": {},
    "dflash2": {"drafter.family": '"dflash2"'},
    "dspark": {"drafter.family": '"dspark"'},
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("n", [2, 4])
def test_sp_equals_one_rank_for_each_family(tiny_config, family, n):
    _compare(tiny_config, n, **FAMILIES[family], **{"target.tiny.num_kv_heads": "4"})


@pytest.mark.parametrize(
    "extra",
    [
        {"drafter.layer_types": '["sliding_attention", "full_attention"]', "drafter.num_layers": "2",
         "drafter.sliding_window": "12"},
        {"drafter.gamma": "4.0"},
        {"loss.position_weights": '"dpace"'},
        {"target.tiny.num_kv_heads": "2"},  # fewer KV heads than ranks: repeated
        {"loss.labels": '"target"', "loss.distill_topk": "4"},
    ],
    ids=["sliding", "gamma", "dpace", "kv_repeated", "target_labels_distill"],
)
def test_sp4_equals_one_rank_with_the_step_options(tiny_config, extra):
    _compare(tiny_config, 4, **extra)


def test_sp_on_the_grouped_attention_path(tiny_config):
    _compare(tiny_config, 2, grouped=True)


@pytest.mark.parametrize(("family", "mode"), [(f, "pipeline") for f in FAMILIES] + [("dflash", "serial")])
def test_a_run_with_sp2_has_the_one_device_runs_losses_and_weights(tiny_config, family, mode):
    """The CLI's run with `pipeline.sequence_parallel = 2` over two CPU replicas: the one-device
    run's `train_step` losses (rel 1e-5) and tokens, and after 20 steps its weights (rtol 1e-5,
    atol 1e-6; at a small learning rate, as AdamW scales each element's update by its own
    gradient: float32 sums in another order show in small elements in proportion to the rate)."""
    from safetensors.torch import load_file

    common = {**FAMILIES[family], "eval.at_end": "false", "data.num_samples": "160", "train.epochs": "1",
              "train.log_every": "4", "optimizer.lr": "1e-4", "pipeline.mode": f'"{mode}"'}  # fmt: skip
    one, sp = tiny_config(**common, **{"run.name": '"one"'}), tiny_config(**common, **{
        "run.name": '"sp"', "pipeline.drafter_devices": '["cpu", "cpu"]', "pipeline.sequence_parallel": "2"})
    ra, rb = run_records(one, timeout_s=120), run_records(sp, timeout_s=120)
    la = [(r["step"], r["loss"], r["tokens"]) for r in ra if r["event"] == "train_step"]
    lb = [(r["step"], r["loss"], r["tokens"]) for r in rb if r["event"] == "train_step"]
    assert len(la) >= 5 and [x[0] for x in la] == [x[0] for x in lb]
    assert all(abs(x[1] - y[1]) <= 1e-5 * abs(x[1]) for x, y in zip(la, lb, strict=True)), (la, lb)
    assert [x[2] for x in la] == [x[2] for x in lb]  # a group counts its rows once
    wa, wb = (load_file(str(c.run_dir / "checkpoints" / "step_000020" / "drafter.safetensors")) for c in (one, sp))
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)


def test_a_group_resumes_on_one_replica_and_back_with_the_same_losses(tiny_config, tmp_path):
    """A group counts as one replica in the global batch and its token budget is N replicas': an
    SP 2 run's checkpoint resumes on one device at twice the budget, and that run's on a group
    again, without changing `train.grad_accum`, and each resumed step has the loss of the run
    never interrupted."""
    common = {"eval.at_end": "false", "train.log_every": "1", "data.num_samples": "64", "train.epochs": "1",
              "checkpoint.every_steps": "3", "checkpoint.keep_last": "5"}  # fmt: skip
    sp = {"pipeline.drafter_devices": '["cpu", "cpu"]', "pipeline.sequence_parallel": "2", "data.token_budget": "256"}

    def run(name: str, resume: object = None, **kw: str) -> tuple[dict[int, float], object]:
        cfg = tiny_config(**common, **kw, **{"run.output_dir": f'"{tmp_path / name}"'})
        records = run_records(cfg, resume=resume, timeout_s=120)
        return {r["step"]: r["loss"] for r in records if r["event"] == "train_step"}, cfg.run_dir / "checkpoints"

    whole, a = run("a", **sp)
    one, b = run("b", resume=a / "step_000003", **{"data.token_budget": "512"})
    again, _ = run("c", resume=b / "step_000006", **sp)
    last = max(whole)
    assert sorted(whole) == list(range(1, last + 1)) and last >= 8
    assert sorted(one) == list(range(4, last + 1)) and sorted(again) == list(range(7, last + 1))
    assert all(abs(x[k] - whole[k]) <= 1e-5 * whole[k] for x in (one, again) for k in x), str((whole, one, again))


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"pipeline.drafter_devices": '["cpu", "cpu", "cpu"]', "pipeline.sequence_parallel": "2"},
         "sequence_parallel"),
        ({"pipeline.drafter_devices": '["cpu", "cpu", "cpu"]', "pipeline.sequence_parallel": "3"},
         "attention heads do not divide over 3"),
        ({"pipeline.sequence_parallel": "2"}, "groups of that many torchrun ranks, but 1 process ran"),
    ],
    ids=["devices", "heads", "one_device_one_process"],
)
def test_bad_sp_settings_are_one_line(tiny_config, overrides, says):
    from dflash.train.build import build_training

    with pytest.raises(ConfigError, match=says):
        build_training(tiny_config(**overrides))


def test_a_groups_token_budget_is_n_replicas_budgets(tiny_config):
    from dflash.train.build import build_training

    one = build_training(tiny_config(**{"data.token_budget": "256"}))
    two = build_training(tiny_config(**{"data.token_budget": "256", "pipeline.drafter_devices": '["cpu", "cpu"]',
                                        "pipeline.sequence_parallel": "2"}))  # fmt: skip
    assert (one.plan.token_budget, two.plan.token_budget) == (256, 512)
    assert max(b.input_ids.numel() for b in _batches(two)) > 256 >= max(b.input_ids.numel() for b in _batches(one))


def test_a_resume_at_another_n_keeps_the_groups_token_budget(tiny_config, tmp_path):
    """What a resume must keep is a group's budget (N × data.token_budget), not a replica's: an
    SP 2 run's batches are a one-device run's at twice the budget (the same plan, so its cursor
    resumes there), and the same budget at another N is refused in one line naming the one that
    keeps it."""
    from dflash.train.build import build_training
    from dflash.train.checkpoint import check_resume_config

    sp = {"pipeline.drafter_devices": '["cpu", "cpu"]', "pipeline.sequence_parallel": "2"}
    two = tiny_config(**{"data.token_budget": "256"}, **sp)
    one = tiny_config(**{"data.token_budget": "512"})
    assert build_training(two).plan.fingerprint == build_training(one).plan.fingerprint
    saved = two.model_dump(mode="json", exclude_none=True)
    check_resume_config(saved, one, tmp_path)
    with pytest.raises(CheckpointError, match=r"256 × 2 -> 256 × 1; data.token_budget = 512 keeps it"):
        check_resume_config(saved, tiny_config(**{"data.token_budget": "256"}), tmp_path)


def test_a_row_longer_than_a_groups_budget_is_one_line(tiny_config):
    from dflash.train.build import build_training

    with pytest.raises(DataError, match=r"tokens, more than a sequence-parallel group's token budget \(pipeline\."
                       r"sequence_parallel × data.token_budget = 2 × 16 = 32\): it fits no group; raise pipeline\."
                       r"sequence_parallel to \d+ \(replicas permitting\) or data.token_budget to \d+"):  # fmt: skip
        build_training(tiny_config(**{"data.token_budget": "16", "pipeline.drafter_devices": '["cpu", "cpu"]',
                                      "pipeline.sequence_parallel": "2"}))  # fmt: skip


def _batches(t):
    from dflash.stages.prefetch import next_batch

    it = iter(t.plan)
    return [b for b in (next_batch(it, False) for _ in range(8)) if b is not None]


def test_plan_names_the_degree_a_long_row_needs():
    """`dflash plan --row-length` past data.max_seq_len: a replica's memory falls with N, the
    smallest N that fits is named (and advised when one replica does not fit), the all-to-all's
    bytes and time are given."""
    from dflash import load_config
    from dflash.plan import plan

    cfg = load_config(ROOT / "bench" / "plan" / "seed.toml")
    long = plan(cfg, gpu="h100", row_length=524288)
    assert long["batch"]["row_length"] == 524288 > cfg.data.max_seq_len
    sp = long["sequence_parallel"]
    mem = list(sp["memory_per_rank_gib"].values())
    assert mem == sorted(mem, reverse=True) and sp["degree_needed"] == 4
    assert sp["all_to_all_mb_per_layer"]["4"] > 0 and sp["all_to_all_ms_per_layer"]["4"] > 0
    short = plan(cfg, gpu="h100", row_length=32768)["sequence_parallel"]
    assert short["degree_needed"] == 1 and short["features_per_row_gib"] < sp["features_per_row_gib"]
    from dflash.plan import _advice

    assert "pipeline.sequence_parallel = 4" in _advice(None, 0.0, True, False, 4)  # type: ignore[arg-type]


def test_a_rank_that_fails_ends_its_group_in_one_error(tiny_config, monkeypatch):
    """A fault in one rank's forward: the other rank, waiting in an exchange of the backward, is
    woken (the group aborted) and the run ends with the one rank's error, not a hang."""
    from dflash import StageError

    monkeypatch.setenv("DFLASH_INJECT_FAULT", "drafter.forward@5")
    cfg = tiny_config(**{"eval.at_end": "false", "pipeline.drafter_devices": '["cpu", "cpu"]',
                         "pipeline.sequence_parallel": "2"})  # fmt: skip
    records: list[dict] = []
    with pytest.raises(StageError, match=r"injected fault in drafter\.forward"):
        run_records(cfg, into=records, timeout_s=120)
    assert records[-1]["event"] == "run_failed"
