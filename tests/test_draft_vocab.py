"""The draft vocabulary (`drafter.draft_vocab_size`, `drafter.vocab_mapping`): the map counted
from the supervised tokens (kept in the run folder, reused on resume) or read (ours,
speculators'); labels and the teacher's top-k over its rows; the whole vocabulary as a draft
vocabulary gives the same losses bit for bit; a pruned tiny run of each family trains, resumes
exactly, exports (its maps and head: every tensor exact in AutoModel) and decodes losslessly;
the engines that cannot serve one say so in one line; `dflash plan` counts its head."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.errors import CheckpointError, ConfigError
from dflash.model.loss import draft_rows
from dflash.model.vocab import FILE, DraftVocab, count_supervised
from tests.conftest import run_records

OPTIONS = {"dflash2": {"drafter.dflash2.selector_rank": "16", "drafter.dflash2.selector_top_k": "8"},
           "dspark": {"drafter.dspark.markov_rank": "16"}}  # fmt: skip


def _family(name: str) -> dict[str, str]:
    return {"drafter.family": f'"{name}"', **OPTIONS.get(name, {})}


def test_the_most_frequent_tokens_with_the_ones_it_must_emit_ascending():
    freqs = torch.tensor([0, 5, 1, 9, 0, 3, 3, 0])
    v = DraftVocab.most_frequent(freqs, 4, keep=[7])
    assert v.ids.tolist() == [1, 3, 5, 7]  # 9, 5, then 3 tied at ids 5 and 6 (the lower wins), 7 kept
    assert v.t2d.tolist() == [False, True, False, True, False, True, False, True]
    assert v.index().tolist() == [-1, 0, -1, 1, -1, 2, -1, 3]
    assert torch.equal(v.offsets + torch.arange(4), v.ids)
    assert v.coverage() == pytest.approx(17 / 21)
    # fewer counted tokens than rows: the lowest unused ids fill the rest (as speculators does)
    assert DraftVocab.most_frequent(torch.tensor([0, 0, 4, 0, 1]), 3).ids.tolist() == [0, 2, 4]
    with pytest.raises(ConfigError, match="between 1 and"):
        DraftVocab.most_frequent(freqs, 9)


def test_counts_are_of_supervised_tokens_only():
    class S:
        input_ids = torch.tensor([1, 2, 2, 3, 3, 3])
        loss_mask = torch.tensor([0, 0, 1, 1, 1, 0], dtype=torch.bool)

    assert count_supervised([S(), S()], 5).tolist() == [0, 0, 2, 4, 0]


def test_maps_round_trip_ours_and_speculators_and_bad_ones_are_one_line(tmp_path):
    v = DraftVocab.most_frequent(torch.arange(16), 6, keep=[0])
    back = DraftVocab.load(v.save(tmp_path / FILE), 16)
    assert torch.equal(back.ids, v.ids) and torch.equal(back.freqs, v.freqs)
    # speculators' files: d2t as offsets, t2d beside it
    np.save(tmp_path / "d2t-6.npy", v.offsets.numpy())
    np.save(tmp_path / "t2d-6.npy", v.t2d.numpy())
    assert torch.equal(DraftVocab.load(tmp_path / "d2t-6.npy", 16).ids, v.ids)
    for bad, says in (
        (tmp_path / "none.safetensors", "is not a file"),
        (tmp_path / "d2t-6.npy", "outside the target's vocabulary"),  # read against a smaller vocabulary
    ):
        with pytest.raises(ConfigError, match=says) as err:
            DraftVocab.load(bad, 12 if "d2t" in bad.name else 16)
        assert "\n" not in str(err.value)
    np.save(tmp_path / "d2t-wide.npy", np.zeros((3, 2), dtype=np.int64))  # not one row
    with pytest.raises(ConfigError, match="one non-empty row") as err:
        DraftVocab.load(tmp_path / "d2t-wide.npy", 16)
    assert "\n" not in str(err.value)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="not a draft vocabulary map"):
        DraftVocab.load(tmp_path / "junk.safetensors", 16)


def test_labels_and_the_teacher_become_rows_and_what_lies_outside_counts_nothing():
    index = DraftVocab(torch.tensor([1, 4, 6]), 8).index()
    labels, weights = torch.tensor([4, 5, 6]), torch.tensor([1.0, 0.5, 0.25])
    vals = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 1.0]])
    ids = torch.tensor([[4, 2], [0, 1], [3, 5]])
    rows, w, (tv, ti) = draft_rows(index, labels, weights, (vals, ids))
    assert rows.tolist() == [1, -100, 2]  # 5 is outside: ignored, never "drafted right"
    # row 2's top-k lies wholly outside: weight 0 too; row 0 keeps its label's weight
    assert w.tolist() == [1.0, 0.0, 0.0]
    p = torch.softmax(tv, dim=-1)
    assert p[0].tolist() == [1.0, 0.0] and p[1].tolist() == [0.0, 1.0]  # restricted and renormalised
    assert ti[0].tolist() == [1, 0] and ti[1].tolist() == [0, 0]  # id 1 is row 0; outside ids clamp to 0 (p = 0)
    assert torch.isfinite(tv[2]).all()


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if r["event"] == "train_step"]


def test_the_whole_vocabulary_as_a_draft_vocabulary_gives_the_same_losses_bit_for_bit(tiny_config):
    """`draft_vocab_size` = the vocabulary is no draft vocabulary (the engines load such an export
    as a whole-vocabulary one): the same run, bit for bit, and no map written."""
    common = {"eval.at_end": "false", "train.max_steps": "6"}
    plain = _losses(run_records(tiny_config(**common, **{"run.name": '"plain"'}), timeout_s=120))
    cfg = tiny_config(**common, **{"run.name": '"whole"', "drafter.draft_vocab_size": "512"})
    whole = _losses(run_records(cfg, timeout_s=120))
    assert len(plain) >= 4 and whole == plain
    assert not (cfg.run_dir / FILE).exists()


def test_the_pruned_path_over_every_row_computes_the_same_step(tiny_config):
    """The draft-vocabulary machinery itself (head rows, labels as rows, `d2t`) over an identity
    map: one micro-step's loss, accuracy and gradients equal the whole-vocabulary step's, bit for bit."""


    from dflash.model.drafter import FrozenHead
    from dflash.runtime.devices import Device
    from dflash.runtime.messages import HostFeatures
    from dflash.stages import target_forward
    from dflash.stages.prefetch import next_batch
    from dflash.train.build import build_training
    from dflash.train.replicas import build_replicas

    cfg = tiny_config(**{"eval.at_end": "false"})
    t = build_training(cfg)
    rep = t.replicas[0]
    spec = dataclasses.replace(t.spec, draft_vocab_size=512)
    head = FrozenHead(t.targets[0].embed_weight, t.targets[0].lm_head_weight)
    same = build_replicas(spec, head, [torch.device("cpu")], cfg.optimizer, lambda _: 1.0, cfg.run.seed, None,
                          DraftVocab.identity(512))[0]  # fmt: skip
    batch = next_batch(iter(t.plan), False)
    layers, teacher = target_forward.forward(t.targets[0], batch, t.targets[0].teacher_topk)
    feats = HostFeatures(batch, torch.cat(layers, -1), 0, teacher=teacher)
    dev = Device("cpu", "d")
    try:
        parts = [t.micro.compute(r, dev, t.micro.prepare(r, dev, feats, 0)) for r in (rep, same)]
    finally:
        dev.close()
    assert torch.equal(parts[0].loss_sum, parts[1].loss_sum)
    assert torch.equal(parts[0].correct_per_slot, parts[1].correct_per_slot)
    grads = [[p.grad for p in r.model.parameters()] for r in (rep, same)]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))



@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_a_pruned_run_trains_resumes_exports_and_decodes_losslessly(tiny_config, tmp_path, family):
    """256 of 512 rows: trains; resumed from step 2 (the run folder's map reused), the same
    later losses; the export's head and maps are the map's, every tensor exact in AutoModel;
    dflash's decoding drafts target ids and stays lossless, greedy and sampled."""
    from transformers import AutoModel

    from dflash.eval import DecodeSettings, evaluate
    from dflash.model.drafter import FrozenHead
    from dflash.model.export import export_drafter, load_drafter
    from dflash.model.target import load_target

    common = {
        **_family(family), "drafter.draft_vocab_size": "256", "data.num_samples": "48", "train.epochs": "2",
        "checkpoint.every_steps": "2", "checkpoint.keep_last": "20", "eval.num_prompts": "2",
        "eval.max_new_tokens": "12", "pipeline.prepare_ahead": "false",
    }  # fmt: skip
    cfg = tiny_config(**common)
    a = run_records(cfg, timeout_s=240)
    (end,) = [r for r in a if r["event"] == "run_end"]
    assert end["eval_lossless"] is True
    vocab = DraftVocab.load(cfg.run_dir / FILE, 512)
    assert vocab.size == 256 and vocab.t2d[cfg.drafter.mask_token_id or 511]
    # resumed from step 2 in another folder: the checkpoint's map, the same later losses
    other = tiny_config(**common, **{"run.output_dir": f'"{tmp_path / "again"}"'})
    b = run_records(other, timeout_s=240, resume=cfg.run_dir / "checkpoints" / "step_000002")
    assert torch.equal(DraftVocab.load(other.run_dir / FILE, 512).ids, vocab.ids)
    la = {r["step"]: r["loss"] for r in a if r["event"] == "train_step"}
    lb = {r["step"]: r["loss"] for r in b if r["event"] == "train_step"}
    assert sorted(lb) == [s for s in sorted(la) if s > 2] and all(abs(la[s] - lb[s]) <= 1e-6 * abs(la[s]) for s in lb)
    # the export: the map's rows of the target's head, and the maps as vLLM and speculators store them
    export = Path(end["export_dir"])
    config = json.loads((export / "config.json").read_text())
    assert config["draft_vocab_size"] == 256 and config["vocab_size"] == 512
    target = load_target(cfg.target, torch.device("cpu"), 1)
    drafter = load_drafter(export)
    assert torch.equal(drafter.d2t, vocab.offsets) and torch.equal(drafter.t2d, vocab.t2d)
    rows = target.lm_head_weight[vocab.ids].to(torch.bfloat16).float()
    assert torch.equal(drafter.lm_head.weight, rows)
    hf = AutoModel.from_pretrained(str(export), trust_remote_code=True)
    from safetensors.torch import load_file

    stored = load_file(str(export / "model.safetensors"))
    mine = hf.state_dict()
    assert set(mine) == set(stored) and all(torch.equal(mine[k], stored[k]) for k in stored)
    if family != "dflash2":  # speculators' DFlash2 has no draft vocabulary (refused below)
        again = export_drafter(drafter, tmp_path / "spec", dtype=torch.float32, fmt="speculators")
        assert json.loads((again / "config.json").read_text())["draft_vocab_size"] == 256
        assert load_drafter(again).spec == drafter.spec
    head = FrozenHead(target.embed_weight, target.lm_head_weight)
    prompts = [torch.randint(0, 400, (6,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for batch, temperature in ((1, 0.0), (2, 0.0), (1, 0.8)):
        rec = evaluate(target, drafter, head, prompts, DecodeSettings(max_new=12, batch_size=batch,
                                                                      temperature=temperature))  # fmt: skip
        assert rec["lossless"] is (True if temperature == 0 else None)
        assert rec["tau"] >= 1.0


def test_a_checkpoint_of_another_draft_vocabulary_is_refused(tiny_config, tmp_path):
    """Resuming with `drafter.vocab_mapping` naming another map than the checkpoint's: one line.
    A map that leaves out the end-of-turn token is a warning; its coverage is counted."""
    common = {"drafter.draft_vocab_size": "256", "train.max_steps": "2", "checkpoint.every_steps": "2",
              "eval.at_end": "false"}  # fmt: skip
    cfg = tiny_config(**common)
    run_records(cfg, timeout_s=120)
    even = DraftVocab(torch.arange(256) * 2, 512).save(tmp_path / "even.safetensors")  # another map
    other = tiny_config(**common, **{"run.output_dir": f'"{tmp_path / "other"}"', "drafter.vocab_mapping": f'"{even}"'})
    with pytest.raises(CheckpointError, match="draft vocabulary differs") as err:
        run_records(other, timeout_s=120, resume=cfg.run_dir / "checkpoints" / "step_000002")
    assert "\n" not in str(err.value)
    fresh = tiny_config(**{**common, "drafter.vocab_mapping": f'"{even}"', "run.output_dir": f'"{tmp_path / "f"}"'})
    records = run_records(fresh, timeout_s=120)
    stats = next(r for r in records if r.get("data", {}).get("draft_vocab"))["data"]["draft_vocab"]
    assert stats["size"] == 256 and 0 < stats["coverage"] < 1


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"loss.vocab": '"data"'}, "already bounds the loss's softmax"),
        ({"drafter.draft_vocab_size": "-1"}, "draft_vocab_size"),
    ],
)
def test_bad_settings_are_one_line(tiny_config, overrides, says):
    from dflash.errors import DFlashError

    with pytest.raises((DFlashError, ValueError)) as err:
        tiny_config(**{"drafter.draft_vocab_size": "256", **overrides})
    assert says in str(err.value)


def test_a_draft_vocabulary_smaller_than_the_selectors_candidates_is_one_line(tiny_config):
    cfg = tiny_config(**_family("dflash2"), **{"drafter.draft_vocab_size": "4", "eval.at_end": "false"})
    with pytest.raises(ConfigError, match="selector_top_k") as err:
        run_records(cfg, timeout_s=120)
    assert "\n" not in str(err.value)


def test_vllm_and_speculators_refuse_a_pruned_dflash2_in_one_line():
    from dflash.model.export import speculators_config_json
    from dflash.serving import vllm
    from tests.test_families import _spec

    spec = _spec("dflash2", draft_vocab_size=32)
    why = vllm.problem(spec, 64, on_cpu=False)
    assert why is not None and "draft vocabulary" in why and "\n" not in why
    with pytest.raises(CheckpointError, match="no draft vocabulary"):
        speculators_config_json(spec)
    assert vllm.problem(_spec("dspark", draft_vocab_size=32), 64, on_cpu=False) is None


def test_plan_counts_the_head_at_the_draft_size():
    from click.testing import CliRunner

    from dflash.cli import main
    from tests.conftest import ROOT

    def plan(*extra: str) -> dict:
        args = ["plan", str(ROOT / "configs" / "tiny.toml"), "--json", *extra]
        got = CliRunner().invoke(main, args)
        assert got.exit_code == 0, got.output
        return json.loads(got.output.strip().splitlines()[-1])

    whole, pruned = plan(), plan("--set", "drafter.draft_vocab_size=128")
    assert whole["batch"]["loss_head_rows"] == 512 and pruned["batch"]["loss_head_rows"] == 128
    assert pruned["drafter"]["gflop_per_batch"]["forward"] < whole["drafter"]["gflop_per_batch"]["forward"]


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_a_drafter_cut_to_a_draft_vocabulary_drafts_what_it_drafted_inside_it(family):
    """`restricted`: the same weights at the kept rows; where every draft of the whole-vocabulary
    drafter lies inside the draft vocabulary, the cut one drafts the same target ids."""
    from dflash.model.families import propose
    from tests.test_families import _spec

    d = _random_drafter(_spec(family))
    head = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    h = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(6))
    anchor = torch.tensor([1, 2, 3])
    full, _ = propose(d, h, head, anchor)
    ids = torch.unique(torch.cat([full.flatten(), torch.arange(0, 64, 3)]))
    cut = d.restricted(ids, head)
    assert cut.spec.draft_vocab_size == len(ids) and torch.equal(cut.lm_head.weight, head[ids])
    again, _ = propose(cut, h, head, anchor)
    assert torch.equal(again, full)


def _random_drafter(spec):
    from dflash.model.drafter import DFlashDrafter

    d = DFlashDrafter(spec)
    d.init_weights(torch.Generator().manual_seed(1))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    return d


def test_a_draft_vocabulary_cut_again_keeps_its_rows():
    from tests.test_families import _spec

    d = _random_drafter(_spec("dspark"))
    head = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    wide = d.restricted(torch.arange(0, 64, 2), head)
    narrow = wide.restricted(torch.arange(0, 64, 4))
    direct = d.restricted(torch.arange(0, 64, 4), head)
    assert all(torch.equal(narrow.state_dict()[k], v) for k, v in direct.state_dict().items())
