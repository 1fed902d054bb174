"""vLLM at the serving end: the export's vLLM fields, the drafters vLLM cannot run (refused in
one line before loading), `--engine vllm` without vLLM, and a round trip: a tiny target with
head dim 32 and its trained export decoded in vLLM (`.venv-engines`, made by `make test`),
outputs identical to vLLM's plain greedy ones and ours, verify steps as our eval counts them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from dflash.engines import vllm
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.export import drafter_config_json, export_drafter
from tests.conftest import ROOT, dflash, json_lines, tiny_overrides

ENGINES_PY = ROOT / ".venv-engines" / "bin" / "python"

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
        vllm.require_vllm()
    tiny = str(ROOT / "configs" / "tiny.toml")
    proc = dflash("eval", tiny, "--drafter", str(tmp_path / "nothing"), "--engine", "vllm")
    if importlib.util.find_spec("vllm") is None:  # this Python's own answer (the main venv has no vLLM)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "make engines" in proc.stderr


@pytest.mark.slow
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
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}

    def in_vllm(export: Path) -> dict:
        proc = subprocess.run(
            [str(ENGINES_PY), "-m", "dflash", "eval", str(ROOT / "configs" / "tiny.toml"), "--drafter", str(export),
             *sets, "--engine", "vllm"],
            capture_output=True, text=True, timeout=400, cwd=ROOT, env=env,
        )  # fmt: skip
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
    again = in_vllm(tmp_path / "spec")
    assert again["speculative_config"]["model"] == str((tmp_path / "spec").resolve())
    same = ("tau", "verify_steps", "accepted_tokens", "accept_per_position", "identical_to_vllm_greedy", "lossless")
    assert {k: again[k] for k in same} == {k: record[k] for k in same}
