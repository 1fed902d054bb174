"""Checkpoints: exact resume, atomic writes, refusals, emergency checkpoints, export. (A SIGTERM
then `--resume auto` through the CLI: tests/test_cli.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash import CheckpointError, Coordinator, load_drafter
from dflash.model.export import export_drafter
from dflash.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.conftest import CLI_TIMEOUT_S, ROOT, dflash, popen_cli, run_records

# prepare_ahead (off by default on CPU) on: resume stays exact when a batch is taken early.
COMMON = {
    "data.num_samples": 48, "train.epochs": 2, "eval.at_end": "false", "checkpoint.keep_last": 20,
    "pipeline.prepare_ahead": "true",
}  # fmt: skip


def _run(cfg, resume=None) -> list[dict]:
    return run_records(cfg, resume=resume)


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "drafter.safetensors"))


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["event"] == "train_step"}


def test_resume_mid_epoch_is_exact(tiny_config, tmp_path):
    """Resumed from step 4 (mid-epoch), steps 5..12 and the final weights equal an uninterrupted run's."""
    full = tiny_config(**COMMON, **{"checkpoint.every_steps": 2})
    a = _run(full)
    assert [r["step"] for r in a if r["event"] == "checkpoint"] == [2, 4, 6, 8, 10, 12]
    other = tiny_config(**COMMON, **{"run.output_dir": f'"{tmp_path / "b"}"', "checkpoint.every_steps": 2})
    b = _run(other, resume=full.run_dir / "checkpoints" / "step_000004")
    assert next(r for r in b if r["event"] == "setup")["resumed_from"] == 4
    la, lb = _losses(a), _losses(b)
    assert sorted(lb) == list(range(5, 13))
    assert all(la[s] == lb[s] for s in lb)
    wa, wb = _weights(full.run_dir, 12), _weights(other.run_dir, 12)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_incompatible_checkpoint_is_refused(tiny_config, tmp_path):
    """A checkpoint of another drafter shape is refused with the differing key named."""
    cfg = tiny_config(**COMMON, **{"train.max_steps": 1})
    _run(cfg)
    ckpt = latest_checkpoint(cfg.run_dir)
    assert ckpt is not None
    other = tiny_config(**COMMON, **{"drafter.block_size": 4, "run.output_dir": f'"{tmp_path / "x"}"'})
    with pytest.raises(CheckpointError, match=r"drafter\.block_size"):
        _run(other, resume=ckpt)
    with pytest.raises(CheckpointError, match="not found"):
        _run(other, resume=tmp_path / "nope")
    fresh = _run(other, resume="auto")  # none yet: a fresh start, said in a `resume` record
    rec = next(r for r in fresh if r["event"] == "resume")
    assert rec["from"] is None and "no checkpoint" in rec["note"]
    assert next(r for r in fresh if r["event"] == "run_end")["steps"] > 0


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(
        float((a[k] - b[k]).abs().max()) <= rel * max(float(a[k].abs().max()), 1e-12) for k in a
    )


def test_resume_with_fewer_replicas_keeps_the_global_batch(tiny_config, tmp_path):
    """Two replicas a step, resumed on one: grad_accum "auto" becomes 2, the steps read the
    same batches, so losses and weights equal the uninterrupted run's (to float-sum order)."""
    two = {**COMMON, "pipeline.drafter_devices": '["cpu", "cpu"]', "pipeline.prepare_ahead": "false",
           "checkpoint.every_steps": 2}  # fmt: skip
    full = tiny_config(**two)
    a = _run(full)
    one = tiny_config(**COMMON, **{"run.output_dir": f'"{tmp_path / "one"}"', "checkpoint.every_steps": 2})
    b = _run(one, resume=full.run_dir / "checkpoints" / "step_000002")
    rec = next(r for r in b if r["event"] == "resume")
    assert rec["step"] == 2 and not rec["global_batch_changed"]
    assert rec["global_batch"].startswith("2 batches a step (1 process × 1 replica × grad_accum 2")
    la, lb = _losses(a), _losses(b)
    assert sorted(lb) == [s for s in sorted(la) if s > 2] and len(lb) >= 3
    assert all(abs(la[s] - lb[s]) <= 1e-6 * abs(la[s]) for s in lb)
    last = max(la)
    assert _close(_weights(full.run_dir, last), _weights(one.run_dir, last))


def test_resume_refuses_a_grad_accum_that_changes_the_global_batch(tiny_config, tmp_path):
    """An explicit grad_accum that would change the global batch is refused, naming the one
    that keeps it; a number of replicas that cannot divide it names the process counts that
    can; --new-global-batch allows the change and the `resume` record says so."""
    from dflash.train.checkpoint import ResumeFrom

    cfg = tiny_config(**COMMON, **{"train.max_steps": 1, "train.grad_accum": 3})
    _run(cfg)
    ckpt = latest_checkpoint(cfg.run_dir)
    out = {"run.output_dir": f'"{tmp_path / "x"}"'}
    with pytest.raises(CheckpointError, match=r"set train\.grad_accum = 3 \(or \"auto\"\)"):
        _run(tiny_config(**COMMON, **out, **{"train.grad_accum": 1}), resume=ckpt)
    two_replicas = {"pipeline.drafter_devices": '["cpu", "cpu"]', "pipeline.prepare_ahead": "false"}
    two = tiny_config(**{**COMMON, **out, **two_replicas})
    with pytest.raises(CheckpointError, match=r"must divide 3 \(1 × 1, 3 × 1, 1 × 3 would\)"):
        _run(two, resume=ckpt)
    changed = _run(two, resume=ResumeFrom(ckpt, new_global_batch=True))
    rec = next(r for r in changed if r["event"] == "resume")
    assert rec["global_batch_changed"] and rec["global_batch"].startswith("4 batches a step")
    setup = next(r for r in changed if r["event"] == "setup")  # the schedule: the step done, then the rest at 4
    assert setup["total_steps"] == 1 + -(-(2 * setup["batches_per_epoch"] - 3) // 4)
    assert next(r for r in changed if r["event"] == "run_end")["steps"] == setup["total_steps"]


def test_incomplete_folders_are_never_the_latest(tmp_path):
    """A temporary folder, or a step folder without state.json, is not a checkpoint."""
    root = tmp_path / "run" / "checkpoints"
    (root / "step_000003").mkdir(parents=True)
    (root / "step_000003" / "state.json").write_text("{}")
    (root / ".tmp-step_000009-abc").mkdir()
    (root / "step_000007").mkdir()  # torn: no state.json
    assert latest_checkpoint(tmp_path / "run") == root / "step_000003"


_WRITER = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    import torch
    from dflash.train import checkpoint
    from dflash.train.checkpoint import Snapshot, write_checkpoint

    # Python's audit events for what a write does to the file system, and one before each
    # safetensors file (written from Rust, which raises none)
    FS_EVENTS = {"open", "os.mkdir", "tempfile.mkdtemp", "os.rename", "os.remove", "os.rmdir", "os.listdir",
                 "os.scandir", "shutil.rmtree", "safetensors.save_file"}
    save_file = checkpoint.save_file

    def audited_save_file(tensors, path, *args, **kwargs):
        sys.audit("safetensors.save_file", path)
        return save_file(tensors, path, *args, **kwargs)

    checkpoint.save_file = audited_save_file

    def writes(tree, kill_at):
        # Checkpoints 1, 2, 3 under tree/checkpoints (keep_last=2: the third prunes the first);
        # SIGKILL just before this process's kill_at-th file-system call in `tree` (0: never).
        # Returns how many such calls had been made at the end of each write, and the saves.
        seen, saves = 0, 0
        def hook(event, args):
            nonlocal seen, saves
            path = args[0] if args else None
            if event in FS_EVENTS and isinstance(path, (str, bytes, os.PathLike)) \\
                    and os.fsdecode(path).startswith(str(tree)):
                seen += 1
                saves += event == "safetensors.save_file"
                if seen == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        sys.addaudithook(hook)  # for good: in a forked child only
        ends = []
        for step in (1, 2, 3):
            w = {"w": torch.full((64, 64), float(step))}
            snap = Snapshot(step, w, {"state.0.exp_avg": w["w"].clone()},
                            {"step": step, "cursor": None, "scheduler": {}, "param_groups": [], "spec": {}}, "")
            write_checkpoint(snap, tree / "checkpoints", keep_last=2)
            ends.append(seen)
        return {"ends": ends, "saves": saves}

    def child(tree, kill_at):
        pid = os.fork()  # the child starts with torch imported: one import for every kill point
        if pid == 0:
            tree.mkdir(parents=True)
            (tree / "ends.json").write_text(json.dumps(writes(tree, kill_at)))
            os._exit(0)
        return os.waitpid(pid, 0)[1]

    out = Path(sys.argv[1])
    assert child(out / "all", 0) == 0
    count = json.loads((out / "all" / "ends.json").read_text())
    for k in range(1, count["ends"][-1] + 1):
        status = child(out / f"kill{k}", k)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, status)
    print(json.dumps(count))
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="fork and SIGKILL")
def test_kill_9_at_any_file_operation_of_checkpointing_leaves_a_readable_latest(tmp_path):
    """kill -9 just before each file-system call of three checkpoint writes (the folder, each
    file, the fsyncs, the rename, the third write's pruning of the first), one process per
    kill point: the latest complete checkpoint is the one before the write under way, or that
    write's own once it is renamed into place, and it loads with the weights of its step.
    (The writer is `python -c`, forked from the tests' server: conftest.popen_cli.)"""
    proc = popen_cli([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    count = json.loads(out)
    ends = count["ends"]  # how many calls had been made at the end of each write
    assert len(ends) == 3 and 0 < ends[0] < ends[1] < ends[2] and count["saves"] == 2 * 3, count
    for k in range(1, ends[-1] + 1):
        writing = next(n for n, end in enumerate(ends, 1) if k <= end)
        latest = latest_checkpoint(tmp_path / f"kill{k}")
        step = 0 if latest is None else json.loads((latest / "state.json").read_text())["step"]
        assert step in (writing - 1, writing), (k, writing, step)
        if latest is not None:
            assert float(load_file(str(latest / "drafter.safetensors"))["w"][0, 0]) == step


def test_export_round_trip_gives_the_training_logits(tiny_config):
    """An exported drafter (float32) loads back with identical weights and forward outputs."""
    cfg = tiny_config(**COMMON, **{"train.max_steps": 2})
    coord = Coordinator(cfg, log=False)
    asyncio.run(coord.run())
    model = coord.replicas[0].model
    path = export_drafter(model, cfg.run_dir / "f32", dtype=torch.float32)
    back = load_drafter(path)
    cfgj = json.loads((path / "config.json").read_text())
    assert cfgj["architectures"] == ["DFlashDraftModel"] and "dflash_config" in cfgj
    sd, sd2 = model.state_dict(), back.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    # the same inputs give the same outputs (logits are these through the frozen LM head)
    from dflash.model.masks import BlockLayout, dense_mask, make_mask_mod

    torch.manual_seed(0)
    spec = model.spec
    R, T, N, B = 2, 12, 2, spec.block_size
    layout = BlockLayout(
        torch.tensor([[3, 7], [2, 5]]), torch.ones(R, N, dtype=torch.bool), torch.zeros(R, T, dtype=torch.long), B
    )
    masks = {"full_attention": dense_mask(make_mask_mod(layout, None, False), layout)}
    args = (
        torch.randn(R, N * B, spec.hidden_size),
        torch.randn(R, T, spec.hidden_size * len(spec.target_layer_ids)),
        (layout.anchors[:, :, None] + torch.arange(B)).view(R, -1),
        torch.arange(T).expand(R, T),
        masks,
    )
    with torch.no_grad():
        assert torch.equal(model(*args), back(*args))


def test_nan_step_is_skipped_and_weights_stay_finite(tiny_config, monkeypatch):
    """A NaN loss at step 3 is skipped (logged, weights untouched, finite); training goes on."""
    monkeypatch.setenv("DFLASH_INJECT_FAULT", "drafter.nan@2")
    cfg = tiny_config(**{**COMMON, "train.max_steps": 5})
    records = _run(cfg)
    assert all(torch.isfinite(p).all() for p in load_drafter(cfg.run_dir / "final").parameters())
    steps = [r for r in records if r["event"] == "train_step"]
    assert [s["skipped"] for s in steps] == [False, False, True, False, False]
    assert steps[2]["loss"] is None
    assert [r["step"] for r in records if r["event"] == "bad_step"] == [3]
    assert records[-1]["event"] == "run_end"


def test_too_many_bad_steps_abort(tiny_config, monkeypatch):
    """train.max_bad_steps non-finite steps in a row end the run with a clear error."""
    from dflash import StageError

    monkeypatch.setenv("DFLASH_INJECT_FAULT", "drafter.nan@0+")
    with pytest.raises(StageError, match="max_bad_steps"):
        _run(tiny_config(**{**COMMON, "train.max_bad_steps": 3}))


def test_export_names_and_config_keys_match_the_reference():
    """The export has exactly the reference weight names (no embedding / LM head) and config keys."""
    from dflash.model.drafter import DFlashDrafter, DrafterSpec

    spec = DrafterSpec(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=[1, 3], num_target_layers=6,
        block_size=8, mask_token_id=5, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
    )  # fmt: skip
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = export_drafter(DFlashDrafter(spec), Path(d) / "out")
        names = set(load_file(str(path / "model.safetensors")))
        cfg = json.loads((path / "config.json").read_text())
    per_layer = [
        "input_layernorm.weight", "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"), "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]  # fmt: skip
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert names == want
    for key in ("architectures", "num_hidden_layers", "num_target_layers", "block_size", "layer_types",
                "sliding_window", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size"):  # fmt: skip
        assert key in cfg, key
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["mask_token_id"] == 5 and cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["num_target_layers"] == 6


def test_crash_after_a_skipped_step_writes_an_emergency_checkpoint_that_resumes(tiny_config, tmp_path, monkeypatch):
    """A stage crash after some steps — one of them skipped as non-finite — leaves a checkpoint
    of the last finished step (a skipped step is finished: nothing half-applied); resuming works."""
    from dflash import StageError

    monkeypatch.setenv("DFLASH_INJECT_FAULT", "drafter.nan@2,target.model_forward@16")
    # shallow queues: the target runs at most a few batches ahead of the last full step
    cfg = tiny_config(**{**COMMON, "train.epochs": 3, "pipeline.hs_queue_depth": 1, "pipeline.batch_queue_depth": 1})
    records: list[dict] = []
    with pytest.raises(StageError, match=r"target\.model_forward\[0\]"):
        run_records(cfg, into=records)
    assert [r["step"] for r in records if r["event"] == "bad_step"] == [3]
    emergency = [r for r in records if r["event"] == "checkpoint" and r.get("emergency")]
    assert len(emergency) == 1
    loaded = load_checkpoint(Path(emergency[0]["path"]))
    # Past the skipped step 3; the target runs ahead by what the stages hold in flight (a
    # batch in each queue and stage: up to ~9 with depth-1 queues, on a loaded machine).
    assert 3 <= loaded.step < 16
    monkeypatch.delenv("DFLASH_INJECT_FAULT")
    after = _run(cfg, resume="auto")
    assert next(r for r in after if r["event"] == "setup")["resumed_from"] == loaded.step
    assert after[-1]["event"] == "run_end" and after[-1]["steps"] == 18


@pytest.mark.slow
def test_stage_fault_in_the_cli_exits_1_with_one_line_naming_the_stage(tmp_path):
    """A real subprocess (`bin/dflash` forked from the tests' server: conftest.dflash): an
    exception injected into a stage exits 1, with one stderr line naming the stage and no
    traceback, and stdout ending in run_failed. (Every stage's fault is covered in-process by
    test_pipeline.py; this pins what the CLI makes of one.)"""
    args = [
        "run", str(ROOT / "configs" / "tiny.toml"),
        "--set", f'run.output_dir="{tmp_path}"', "--set", "data.num_samples=32",
    ]  # fmt: skip
    proc = dflash(*args, env={"DFLASH_INJECT_FAULT": "target.pack_hidden@3"})
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("dflash: error: stage target.pack_hidden[0] failed: InjectedFault"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["event"] == "run_failed"


def test_crash_in_the_optimizer_before_it_changes_anything_still_saves_the_last_step(tiny_config, monkeypatch):
    """A failure inside the optimizer step before any weight or AdamW state changes (here its
    fault point, which comes first) leaves a consistent state: the emergency checkpoint holds
    the step before."""
    from dflash import StageError

    monkeypatch.setenv("DFLASH_INJECT_FAULT", "drafter.optimizer_step@3")
    cfg = tiny_config(**{**COMMON, "checkpoint.at_end": "true"})
    records: list[dict] = []
    with pytest.raises(StageError, match=r"drafter\.optimizer_step"):
        run_records(cfg, into=records)
    (emergency,) = [r for r in records if r["event"] == "checkpoint" and r.get("emergency")]
    assert emergency["step"] == 3 and load_checkpoint(Path(emergency["path"])).step == 3


def test_export_loads_through_automodel_with_trust_remote_code(tmp_path):
    """The export carries `auto_map` and its own modeling file: transformers' AutoModel
    builds the drafter with the trained weights, and its outputs (hence logits through the
    target's LM head) equal `dflash.load_drafter`'s — without a mask (the reference's
    inference: every slot sees all context and its whole block) and with one."""
    from transformers import AutoModel

    from dflash.model.drafter import DFlashDrafter, DrafterSpec

    spec = DrafterSpec(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=[0, 2], num_target_layers=4,
        block_size=4, mask_token_id=63, layer_types=["full_attention", "full_attention"], sliding_window=5,
    )  # fmt: skip
    d = DFlashDrafter(spec)
    d.init_weights(torch.Generator().manual_seed(1))
    path = export_drafter(d, tmp_path / "exp", dtype=torch.float32)
    assert json.loads((path / "config.json").read_text())["auto_map"] == {
        "AutoModel": "modeling_dflash.DFlashDraftModel"
    }
    hf = AutoModel.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32)
    ours = load_drafter(path)
    R, T, Q = 2, 9, 4
    g = torch.Generator().manual_seed(2)
    emb, ctx = torch.randn(R, Q, 32, generator=g), torch.randn(R, T, 64, generator=g)
    ctx_pos, q_pos = torch.arange(T).expand(R, T), (T + torch.arange(Q)).expand(R, Q)
    lm_head = torch.randn(64, 32, generator=g)
    full = torch.ones(R, 1, Q, T + Q, dtype=torch.bool)
    some = torch.rand(R, 1, Q, T + Q, generator=g) > 0.3
    with torch.no_grad():
        for mask, hf_mask in ((full, None), (some, some)):
            a = ours(emb, ctx, q_pos, ctx_pos, {"full_attention": mask})
            pos = torch.cat([ctx_pos, q_pos], 1)
            b = hf(position_ids=pos, attention_mask=hf_mask, noise_embedding=emb, target_hidden=ctx)
            assert torch.allclose(a @ lm_head.T, b @ lm_head.T, atol=1e-5, rtol=0), (a - b).abs().max()


def test_automodel_default_masks_are_the_engines_and_training_semantics(tmp_path):
    """Without a mask, the exported model computes what vLLM / SGLang / SpecForge compute and
    what dflash trains: full layers bidirectional over context and block; sliding layers
    causal inside the block and windowed (W positions, itself included)."""
    from transformers import AutoModel

    from dflash.model.drafter import DFlashDrafter, DrafterSpec

    W = 5
    spec = DrafterSpec(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=[0, 2], num_target_layers=4,
        block_size=4, mask_token_id=63, layer_types=["full_attention", "sliding_attention"], sliding_window=W,
    )  # fmt: skip
    d = DFlashDrafter(spec)
    d.init_weights(torch.Generator().manual_seed(4))
    path = export_drafter(d, tmp_path / "exp", dtype=torch.float32)
    hf = AutoModel.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32)
    R, T, Q = 1, 9, 4
    g = torch.Generator().manual_seed(5)
    emb, ctx = torch.randn(R, Q, 32, generator=g), torch.randn(R, T, 64, generator=g)
    ctx_pos, q_pos = torch.arange(T)[None], (T + torch.arange(Q))[None]
    k_pos = torch.cat([ctx_pos, q_pos], 1)
    diff = q_pos[:, None, :, None] - k_pos[:, None, None, :]
    full = torch.ones(R, 1, Q, T + Q, dtype=torch.bool)
    masks = {"full_attention": full, "sliding_attention": (diff >= 0) & (diff < W)}
    with torch.no_grad():
        a = load_drafter(path)(emb, ctx, q_pos, ctx_pos, masks)
        b = hf(position_ids=k_pos, noise_embedding=emb, target_hidden=ctx)
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()


def test_rope_scaling_is_the_targets_in_training_and_in_the_export(tmp_path):
    """A target with scaled RoPE (Llama-3.1 style): the drafter uses the same inverse
    frequencies as the target's own rotary embedding, writes `rope_scaling` into the export,
    and AutoModel computes the same outputs from it."""
    from transformers import AutoModel, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from dflash.model.drafter import DFlashDrafter, DrafterSpec

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
    spec = DrafterSpec(
        hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=64, rms_norm_eps=1e-6, rope_theta=500000.0, target_layer_ids=[0], num_target_layers=2,
        block_size=4, mask_token_id=63, layer_types=["full_attention"], sliding_window=5, rope_scaling=scaling,
    )  # fmt: skip
    d = DFlashDrafter(spec)
    d.init_weights(torch.Generator().manual_seed(6))
    target_rope = LlamaRotaryEmbedding(
        LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8, rope_theta=500000.0, rope_scaling=dict(scaling))
    )
    assert d.scaled_rope is not None and torch.equal(d.scaled_rope[0], target_rope.inv_freq)
    plain = DFlashDrafter(dataclasses.replace(spec, rope_scaling=None))
    assert plain.scaled_rope is None
    path = export_drafter(d, tmp_path / "exp", dtype=torch.float32)
    assert json.loads((path / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    back = load_drafter(path)
    assert back.spec.rope_scaling == scaling
    hf = AutoModel.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32)
    R, T, Q = 1, 40, 4  # positions past original_max_position_embeddings, where scaling matters
    g = torch.Generator().manual_seed(7)
    emb, ctx = torch.randn(R, Q, 32, generator=g), torch.randn(R, T, 32, generator=g)
    ctx_pos, q_pos = torch.arange(T)[None], (T + torch.arange(Q))[None]
    full = {"full_attention": torch.ones(R, 1, Q, T + Q, dtype=torch.bool)}
    with torch.no_grad():
        a = back(emb, ctx, q_pos, ctx_pos, full)
        b = hf(position_ids=torch.cat([ctx_pos, q_pos], 1), noise_embedding=emb, target_hidden=ctx)
        plain.load_state_dict(d.state_dict())
        unscaled = plain(emb, ctx, q_pos, ctx_pos, full)
    assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert not torch.allclose(a, unscaled, atol=1e-4), "scaling made no difference: the test would not see it"
    assert load_drafter(path, dtype=torch.bfloat16).scaled_rope[0].dtype == torch.float32  # never rounded
    # yarn: the attention factor depends on the target's max_position_embeddings, which is passed on
    from dflash.model.modeling_dflash import scaled_rope

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ref = LlamaRotaryEmbedding(LlamaConfig(
        hidden_size=32, num_attention_heads=4, head_dim=8, rope_theta=10000.0, max_position_embeddings=64,
        rope_scaling=dict(yarn),
    ))  # fmt: skip
    inv, factor = scaled_rope(8, 10000.0, yarn, 64)
    assert torch.equal(inv, ref.inv_freq) and factor == ref.attention_scaling != 1.0


def test_restore_keeps_this_runs_optimizer_kernel_not_the_checkpoints():
    """The AdamW kernel (fused on a CPU, multi-tensor on CUDA) is the resuming run's: a
    checkpoint written by the per-tensor loop (or on another device kind) does not switch it;
    the state itself (moments, step) is loaded."""
    from types import SimpleNamespace

    from dflash.train.checkpoint import Loaded, restore

    def replica(**kernel):
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, **kernel)
        return SimpleNamespace(model=model, optimizer=opt, device=torch.device("cpu"),
                               scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))  # fmt: skip

    old = replica(foreach=False, fused=None)
    old.model(torch.randn(2, 4)).sum().backward()
    old.optimizer.step()
    saved = old.optimizer.state_dict()
    loaded = Loaded(Path("ckpt"), 1, None, old.model.state_dict(), saved, old.scheduler.state_dict(), {})
    new = replica(fused=True)
    restore(loaded, [new])
    group = new.optimizer.param_groups[0]
    assert group["fused"] is True and not group["foreach"]
    exp_avg = saved["state"][0]["exp_avg"]
    assert torch.equal(new.optimizer.state[new.model.weight]["exp_avg"], exp_avg)


def test_every_minutes_checkpoints_after_the_step_that_ends_the_interval(tiny_config):
    """`checkpoint.every_minutes`: a checkpoint after the first step that ends that long after
    the last one (or the start), on the writer's own clock; `every_steps` still counts steps."""
    from dflash.train.checkpoint import Checkpointer

    now = [0.0]
    ck = Checkpointer(tiny_config(**{"checkpoint.every_minutes": 0.5, "checkpoint.every_steps": 10}), None, None, None)
    ck._clock, ck._since = (lambda: now[0]), 0.0
    written: list[int] = []

    async def write(step: int) -> None:
        written.append(step)

    class Ctx:
        last_batch = 0
        ahead = frozenset()

        def __init__(self, step: int) -> None:
            self.step = step

        async def read(self, _stage, fn, *args):
            return fn(*args)

    ck.take, ck.write = (lambda step, _last, _ahead: step), write

    async def steps() -> None:
        for step, t in enumerate([10, 29, 31, 40, 60, 62, 95, 100, 105, 110], start=1):
            now[0] = t
            await ck.after_step(Ctx(step))

    asyncio.run(steps())
    assert written == [3, 6, 7, 10]  # by the clock: 31 s, 62 s, 95 s; step 10 by every_steps


def test_a_malformed_global_batch_in_state_json_is_one_line(tiny_config):
    """A hand-edited state.json whose `batch` is not three integers >= 1: a CheckpointError
    naming the file and the field, not a TypeError."""
    cfg = tiny_config(**COMMON, **{"train.max_steps": 1})
    _run(cfg)
    ckpt = latest_checkpoint(cfg.run_dir)
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "batch": {"processes": "2", "replicas": 1}}))
    with pytest.raises(CheckpointError, match=r"step_000001: unreadable checkpoint: state.json's batch"):
        load_checkpoint(ckpt)
