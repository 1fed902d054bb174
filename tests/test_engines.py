"""vLLM at the serving end: the export's vLLM fields, the drafters vLLM cannot run (refused in
one line before loading), `--engine vllm` without vLLM, and a round trip: a tiny target with
head dim 32 and its trained export decoded in vLLM (`.venv-engines`, made by `make test`),
outputs identical to vLLM's plain greedy ones and ours, verify steps as our eval counts them."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from dflash.engines import vllm as engine
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.export import drafter_config_json, export_drafter
from dflash.serving import vllm
from tests.conftest import ENGINES_PY, ROOT, dflash, engines_python, json_lines, tiny_overrides

pytestmark = pytest.mark.engines("vllm")  # last, once `make test` has made .venv-engines

SPEC = DrafterSpec(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128, vocab_size=512,
    rms_norm_eps=1e-6, rope_theta=1e4, target_layer_ids=[1], num_target_layers=4, block_size=4, mask_token_id=511,
    layer_types=["full_attention", "full_attention"], sliding_window=64,
)  # fmt: skip


def test_the_export_tells_vllm_a_bidirectional_block_and_how_to_run_it(tmp_path):
    assert "causal" not in drafter_config_json(SPEC)["dflash_config"]  # vLLM's default: nothing to say
    bidirectional = dataclasses.replace(SPEC, sliding_causal_block=False)
    assert drafter_config_json(bidirectional)["dflash_config"]["causal"] is False  # never written as true
    out = export_drafter(DFlashDrafter(SPEC), tmp_path / "export")
    assert vllm.speculative_config(out, SPEC) == {"method": "dflash", "model": str(out), "num_speculative_tokens": 3}


def test_drafters_vllm_cannot_run_on_cpu_are_named_with_the_fix():
    assert vllm.problem(SPEC, 32, on_cpu=True) is None
    assert vllm.problem(dataclasses.replace(SPEC, head_dim=16), 32, on_cpu=True).startswith(
        "vLLM on CPU cannot run a drafter with head dim 16"
    )
    assert "target with head dim 16" in vllm.problem(SPEC, 16, on_cpu=True)
    mixed = dataclasses.replace(SPEC, layer_types=["full_attention", "sliding_attention"])
    assert "mixing full and sliding-window layers" in vllm.problem(mixed, 32, on_cpu=True)
    assert vllm.problem(mixed, 16, on_cpu=False) is None  # a GPU's runner takes them


def test_engine_vllm_without_vllm_says_how_to_get_it(tmp_path, monkeypatch):
    """In a Python without vLLM (the main venv), one line, before any model is loaded."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    from dflash.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--engine vllm: vLLM is not installed in this Python; make engines"):
        engine.require_vllm()
    tiny = str(ROOT / "configs" / "tiny.toml")
    proc = dflash("eval", tiny, "--drafter", str(tmp_path / "nothing"), "--engine", "vllm")
    if importlib.util.find_spec("vllm") is None:  # this Python's own answer (the main venv has no vLLM)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "make engines" in proc.stderr


def test_engine_vllm_refuses_sampling_before_loading_anything(tmp_path):
    """--temperature with --engine vllm: one line before any model (here: no drafter at all),
    before vLLM is looked for (the same in either venv)."""
    tiny = str(ROOT / "configs" / "tiny.toml")
    proc = dflash("eval", tiny, "--drafter", str(tmp_path / "nothing"), "--engine", "vllm", "--temperature", "0.5")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--engine vllm: greedy only" in proc.stderr and "drop --temperature" in proc.stderr


def test_mixed_drafters_get_vllms_v2_runner_on_a_gpu_only(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    mixed = dataclasses.replace(SPEC, layer_types=["full_attention", "sliding_attention"])
    with engine.runner_env(mixed, "cuda"):
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ  # as it was, after
    for spec, device in ((SPEC, "cuda"), (mixed, "cpu"), (None, "cuda")):
        with engine.runner_env(spec, device):
            assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    from dflash.errors import ConfigError

    with (
        pytest.raises(ConfigError, match=r"needs vLLM's V2 runner \(VLLM_USE_V2_MODEL_RUNNER=1\)"),
        engine.runner_env(mixed, "cuda"),
    ):
        pass
    assert engine.gpu_share("cpu") is None


def test_each_prompt_sets_counters_are_its_own():
    before = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens_per_pos": [7, 3]}
    after = {"vllm:spec_decode_num_drafts": 25, "vllm:spec_decode_num_accepted_tokens_per_pos": [17, 9, 1]}
    assert vllm._since(before, after) == {
        "vllm:spec_decode_num_drafts": 15, "vllm:spec_decode_num_accepted_tokens_per_pos": [10, 6, 1],
    }  # fmt: skip
    assert vllm._since({}, after) == after


def test_the_tiny_target_folder_is_removed_at_the_end(tiny_config):
    import torch

    from dflash.eval.engine import target_folder
    from dflash.model.target import load_target

    cfg = tiny_config()
    target = load_target(cfg.target, torch.device("cpu"), 1)
    with target_folder(cfg, target) as folder:
        assert (folder / "config.json").is_file()
    assert not folder.exists()


FULL, MIXED = ["full_attention", "full_attention"], ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("layer_types", [FULL, MIXED], ids=["full", "mixed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal_sliding", "bidirectional"])
def test_a_speculators_export_reads_back_as_the_same_drafter(tmp_path, layer_types, causal):
    import torch

    from dflash.errors import CheckpointError
    from dflash.model.export import load_drafter

    spec = dataclasses.replace(SPEC, layer_types=layer_types, sliding_causal_block=causal)
    model = DFlashDrafter(spec)
    if "sliding_attention" in layer_types and causal:  # vLLM would make its full layers causal too
        with pytest.raises(CheckpointError, match="--format speculators"):
            export_drafter(model, tmp_path / "spec", fmt="speculators")
        return
    out = export_drafter(model, tmp_path / "spec", fmt="speculators")
    back = load_drafter(out)
    expected = spec if "sliding_attention" in layer_types else dataclasses.replace(spec, sliding_causal_block=True)
    assert back.spec == expected  # all full: the flag means nothing, and reads back as its default
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name


def test_a_cpu_engine_runs_its_core_in_process_unless_the_user_says_otherwise(monkeypatch):
    """On a CPU a decoding engine is made with vLLM's engine core in dflash's process, the
    variable unset after and vLLM's cache of its variables off (a later engine reads them
    afresh); a value the user set stands, and on a GPU vLLM's own default does."""
    import sys
    import types

    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    uncached = []
    envs = types.SimpleNamespace(disable_envs_cache=lambda: uncached.append(True))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(envs=envs))
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    for device, preset, inside, after in (("cpu", None, "0", None), ("cpu", "1", "1", "1"), ("cuda", None, None, None)):
        monkeypatch.delenv(key, raising=False)
        if preset is not None:
            monkeypatch.setenv(key, preset)
        monkeypatch.setattr(engine, "engine_device", lambda d=device: d)
        uncached.clear()
        with engine.engine_core_in_process():
            assert os.environ.get(key) == inside, (device, preset)
        assert os.environ.get(key) == after and uncached == ([True] if inside == "0" else []), (device, preset)
    # open_engine makes its engine inside it
    monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(engine, "engine_device", lambda: "cpu")
    monkeypatch.setattr(engine, "kv_cache_bytes", lambda *a, **k: None)
    seen = []
    sys.modules["vllm"].LLM = lambda **kwargs: seen.append(os.environ.get(key)) or "engine"
    assert engine.open_engine(Path("target"), None, None, "float32", 64) == "engine"
    assert seen == ["0"] and key not in os.environ


def test_the_speculators_verifier_is_the_targets_folder(tmp_path, monkeypatch):
    """vLLM serving a speculators export loads `verifier.name_or_path` as the target: the
    absolute path of the target's HF folder, or "" when there is none to name."""
    from dflash.model.export import _verifier

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "t").mkdir(parents=True)
    (tmp_path / "models" / "t" / "config.json").write_text("{}")
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    converted = tmp_path / "cache" / "models" / ("t-" + "0123456789abcdef")
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    cases = {
        '[target]\nkind = "hf"\npath = "models/t"\n': str((tmp_path / "models" / "t").resolve()),
        '[target]\nkind = "hf"\npath = "models/nothing"\n': "",
        '[target]\nkind = "tiny"\n': "",
        f'[target]\nkind = "gguf"\npath = "{gguf}"\n[data]\ncache_dir = "{tmp_path / "cache"}"\n': str(converted),
        f'[target]\nkind = "gguf"\npath = "{gguf}"\n[data]\ncache_dir = "{tmp_path / "none"}"\n': "",
    }
    for toml, expected in cases.items():
        (checkpoint / "config.toml").write_text(toml)
        assert _verifier(checkpoint) == expected, toml


@pytest.mark.slow
@pytest.mark.timeout(600)  # two training runs and six vLLM engines: ~150 s on two cores, ~200 s beside another test
def test_a_trained_export_decodes_identically_in_vllm(tmp_path):
    if not ENGINES_PY.exists():
        pytest.fail(f"{ENGINES_PY} is missing: `make test` (or `make engines`) builds it")
    shape = {
        "target.tiny.head_dim": 32, "target.tiny.num_heads": 2, "target.tiny.num_kv_heads": 1,
        "data.num_samples": 128, "train.epochs": 2, "eval.at_end": "false", "eval.num_prompts": 6,
    }  # fmt: skip
    sets = [a for kv in tiny_overrides(tmp_path, **shape) for a in ("--set", kv)]
    trained = dflash("run", str(ROOT / "configs" / "tiny.toml"), *sets)
    assert trained.returncode == 0, trained.stderr[-2000:]
    end = next(r for r in json_lines(trained.stdout) if r["event"] == "run_end")
    drafter = Path(end["export_dir"])
    assert end["vllm_speculative_config"]["method"] == "dflash"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # the KV cache: sized by dflash (vLLM alone wants 0.92 of memory)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)

    def in_vllm(export: Path) -> dict:
        proc = engines_python(["-m", "dflash", "eval", str(ROOT / "configs" / "tiny.toml"), "--drafter", str(export),
                               *sets, "--engine", "vllm"], env=env, timeout=400)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        (record,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        return record

    record = in_vllm(drafter)
    assert record["engine"] == "vllm" and record["prompts"] == 6
    assert record["identical_to_vllm_greedy"] == 6 and record["identical_to_dflash_greedy"] == 6 and record["lossless"]
    assert record["tau"] > 1.0 and record["dflash_tau"] > 1.0
    # The same verify steps but at a generation's end, where vLLM counts drafts past max_tokens
    assert abs(record["verify_steps"] - record["dflash_verify_steps"]) <= record["prompts"], record
    # vLLM's second format, from the run's last checkpoint: the same drafter, the same decoding
    exported = dflash("export", str(Path(end["run_dir"])), str(tmp_path / "spec"), "--format", "speculators")
    assert exported.returncode == 0 and "speculative_config = " in exported.stderr, exported.stderr
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [3]
    assert config["speculators_config"]["verifier"]["name_or_path"] == ""  # the tiny target has no folder
    again = in_vllm(tmp_path / "spec")
    assert again["speculative_config"]["model"] == str((tmp_path / "spec").resolve())
    same = ("tau", "verify_steps", "accepted_tokens", "accept_per_position", "identical_to_vllm_greedy", "lossless")
    assert {k: again[k] for k in same} == {k: record[k] for k in same}
    # a draft vocabulary (256 of 512): vLLM loads its head and d2t and drafts what dflash drafts
    pruned = [*sets, "--set", "drafter.draft_vocab_size=256", "--set", 'run.name="pruned"']
    trained = dflash("run", str(ROOT / "configs" / "tiny.toml"), *pruned)
    assert trained.returncode == 0, trained.stderr[-2000:]
    end = next(r for r in json_lines(trained.stdout) if r["event"] == "run_end")
    small = in_vllm(Path(end["export_dir"]))
    assert small["identical_to_vllm_greedy"] == 6 and small["identical_to_dflash_greedy"] == 6 and small["lossless"]
    assert small["tau"] > 1.0 and abs(small["verify_steps"] - small["dflash_verify_steps"]) <= small["prompts"], small


def test_a_head_only_target_is_checked_by_vllm_alone(tmp_path, monkeypatch):
    """`target.load = "head"` (no decoder layers here): `--engine vllm` decodes with vLLM only
    (over `--tensor-parallel` devices); the record says so with nulls where ours would be, and
    the plain `dflash` engine is refused in one line."""
    import torch

    from dflash.cli import _eval_table
    from dflash.config import TinyTargetConfig, load_config
    from dflash.errors import ConfigError
    from dflash.eval.command import run_eval
    from dflash.eval.engine import evaluate_in_vllm
    from dflash.eval.tally import DecodeSettings
    from dflash.model.target import build_tiny
    from dflash.model.target_head import load_target_head

    build_tiny(TinyTargetConfig(head_dim=32, num_heads=2, num_kv_heads=1, vocab_size=512)).save_pretrained(
        tmp_path / "model"
    )
    sets = [*tiny_overrides(tmp_path), 'target.kind="hf"', f'target.path="{tmp_path / "model"}"', 'target.load="head"']
    cfg = load_config(ROOT / "configs" / "tiny.toml", sets)
    with pytest.raises(ConfigError, match="--engine vllm"):
        run_eval(cfg, tmp_path / "no_export")
    target = load_target_head(cfg.target, torch.device("cpu"), 1)
    assert target.model is None
    calls = []

    def decode(*args, **kwargs):  # vLLM's runs stood in for: with the drafter (its path given), then plain
        drafted = len(args) > 4
        calls.append((drafted, kwargs.get("tensor_parallel", args[-1] if drafted else None)))
        if not drafted:
            return [vllm.EngineRun([[5, 6, 7], [8]], seconds=1.0)]
        return [vllm.EngineRun([[5, 6, 7], [8]], drafts=4, accepted=6, accepted_per_pos=[4, 2, 0], seconds=1.0)]

    monkeypatch.setattr(vllm, "decode", decode)
    monkeypatch.setattr(engine, "engine_device", lambda: "cpu")
    drafter = DFlashDrafter(SPEC)
    prompts = {"heldout": [torch.tensor([1, 2]), torch.tensor([3])]}
    (record,) = evaluate_in_vllm(cfg, target, drafter, tmp_path, prompts, DecodeSettings.of(cfg, {0}), None, 2)
    assert calls == [(True, 2), (False, 2)]
    # The record's numbers from the drafted run's counters: τ = 1 + accepted / verify steps
    assert (record["tau"], record["verify_steps"], record["accepted_tokens"]) == (2.5, 4, 6)
    assert record["accept_per_position"] == [1.0, 0.5, 0.0]
    assert record["identical_to_vllm_greedy"] == 2 and record["lossless"]
    assert record["dflash_tau"] is None and record["identical_to_dflash_greedy"] is None
    assert "-" in _eval_table([{"prompt_set": "heldout", **record}])
    from dflash.errors import CheckpointError
    from dflash.eval.fit import check_drafter_fits

    with pytest.raises(CheckpointError, match=r"this target: hidden \d+, vocab 512"):  # its sizes, named
        check_drafter_fits(DFlashDrafter(dataclasses.replace(SPEC, hidden_size=48, num_heads=1)), target)
    from click.testing import CliRunner

    from dflash.cli import main

    args = ["eval", str(ROOT / "configs" / "tiny.toml"), "--drafter", str(tmp_path), "--tensor-parallel", "2"]
    with pytest.raises(ConfigError, match="--tensor-parallel: only with --engine vllm"):
        raise CliRunner().invoke(main, args).exception or AssertionError("not refused")


def test_vllms_kv_cache_is_sized_for_what_dflash_runs(tmp_path, monkeypatch):
    """Two layers × 2 (K, V) × 1 KV head × 32 × 4 bytes a token for the target, the same for the
    drafter; 6 sequences of 40 tokens (+ the block, in 16-token blocks, one spare): a quarter
    more and 64 MiB. The user's VLLM_CPU_KVCACHE_SPACE wins; an engine that does not start is
    one line naming it."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    per_token = 2 * 2 * 1 * 32 * 4
    drafter = dataclasses.replace(SPEC, num_layers=2)
    tokens = 6 * (3 + 1) * 16  # ceil((40 + 4) / 16) + 1 blocks a sequence
    expected = int(2 * per_token * tokens * 1.25) + (64 << 20)
    assert engine.kv_cache_bytes(tmp_path, "float32", 6, 40, drafter) == expected
    assert engine.kv_cache_bytes(tmp_path, "float32", 6, 40, drafter, total_tokens=100) < expected
    assert engine.kv_cache_bytes(tmp_path / "missing", "float32", 6, 40) is None  # vLLM sizes it then
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert engine.kv_cache_bytes(tmp_path, "float32", 6, 40, drafter) is None
    err = engine.engine_failed(RuntimeError("Engine core initialization failed.\nSee root cause above."), expected)
    assert "\n" not in str(err) and "VLLM_CPU_KVCACHE_SPACE=GiB" in str(err) and "0.06 GiB" in str(err)
