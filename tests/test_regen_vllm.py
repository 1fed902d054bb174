"""`regen.engine = "vllm"`: the replies from vLLM's offline API in this process. Without vLLM,
one line saying how to get it, before anything loads; the config errors; the requests' options
(greedy as the local loop's argmax, sampled seeds per prompt); which prompts start under
regen.max_minutes; and, in `.venv-engines` on a tiny target with head dim 32 (vLLM on CPU takes
no smaller one), the same replies as the local loop token for token, the same records, and a
resume that answers nothing new."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dflash.config import Config, load_config
from dflash.data.prompts import load_prompts
from dflash.errors import ConfigError
from dflash.regen.vllm import ReplySettings, hf_sampling, model_len, sampling_options
from tests.conftest import ENGINES_PY, dflash, engines_python
from tests.test_regen_files import NUM_TRAIN, _tokenizer, regen_setup

pytestmark = pytest.mark.engines("vllm")  # last, once `make test` has made .venv-engines

# In .venv-engines: `dflash regen ARGS...`, in this process, with each reply's token ids (as
# the loop hands them to be decoded and written) saved as JSON to IDS; first, vLLM takes a
# sampled request's options.
RECORDING = """
import json, sys
from pathlib import Path

from vllm import SamplingParams

from dflash.regen import command as regen
from dflash.cli import entry
from dflash.regen.vllm import ReplySettings, sampling_options

seen = {}
write = regen._OutputFile.write_ids


def recorded(self, i, ids):
    seen[i] = list(ids)
    return write(self, i, ids)


if __name__ == "__main__":
    sampled = ReplySettings(12, 7, 0.8, 3, (("top_k", 50), ("top_p", 0.9), ("min_p", 0.05)))
    params = SamplingParams(**sampling_options(sampled, 5))
    assert (params.seed, params.top_k, params.top_p, params.min_p, params.stop_token_ids) == (8, 50, 0.9, 0.05, [7])
    regen._OutputFile.write_ids = recorded
    ids_path, sys.argv = Path(sys.argv[1]), ["dflash", *sys.argv[2:]]
    try:
        entry()
    finally:
        ids_path.write_text(json.dumps(seen))
"""


@dataclass
class Env:
    root: Path
    config: Path

    def cfg(self, name: str, *overrides: str) -> Config:
        return load_config(self.config, [f'run.name="{name}"', *overrides])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    """A tiny HF folder vLLM on CPU can run (head dim 32), a prompt file, a config. Its linear
    layers are redrawn with std 0.2 (not 0.02): then its greedy replies differ from prompt to
    prompt (19 of the 20) and some stop at the eos (6), so that both are compared."""
    import torch

    from dflash.config import TinyTargetConfig
    from dflash.model.target import build_tiny

    root = tmp_path_factory.mktemp("regen_vllm")
    tok = _tokenizer()
    model = build_tiny(TinyTargetConfig(vocab_size=len(tok), head_dim=32, num_heads=2, num_kv_heads=1, seed=1))
    draw = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=draw) * 0.2)
    return Env(root, regen_setup(root, model, tok, batch_size=8))


def test_without_vllm_one_line_says_how_to_get_it_before_anything_loads(env, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    from dflash.regen import regenerate

    cfg = env.cfg("none", 'regen.engine="vllm"')
    with pytest.raises(ConfigError, match=r"^regen\.engine = 'vllm': vLLM is not installed in this Python; make"):
        regenerate(cfg, None, None, progress=False)
    assert not cfg.regen_output.exists() and not cfg.regen_heldout.exists()
    if real("vllm") is None:  # the main venv: the command, with a target that does not even exist
        proc = dflash("regen", str(env.config), "--set", 'regen.engine="vllm"', "--set", 'target.path="/no/model"')
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "make engines, then run .venv-engines/bin/dflash regen" in proc.stderr


def test_vllm_with_a_server_or_saved_features_is_a_config_error(env):
    with pytest.raises(ConfigError, match=r"regen\.server with regen\.engine = 'vllm'") as err:
        env.cfg("x", 'regen.engine="vllm"', 'regen.server="http://127.0.0.1:1"')
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"regen\.save_features with regen\.engine = 'vllm'.*dflash features"):
        env.cfg("x", 'regen.engine="vllm"', "regen.save_features=true")
    assert env.cfg("x").regen.engine == "hf"


def test_requests_ask_the_local_loops_argmax_or_a_seed_per_prompt(env, tmp_path):
    greedy = sampling_options(ReplySettings(12, 7, seed=3), 5)
    assert greedy == {
        "max_tokens": 12, "temperature": 0.0, "stop_token_ids": [7], "ignore_eos": True, "repetition_penalty": 1.0,
        "detokenize": False,
    }  # fmt: skip
    sampling = hf_sampling(env.root / "model")  # no generation_config.json: generate's defaults
    assert sampling == (("top_k", 50), ("top_p", 1.0), ("min_p", 0.0))
    sampled = ReplySettings(12, 7, 0.8, seed=3, sampling=sampling)
    assert sampling_options(sampled, 5)["seed"] == 8 and sampling_options(sampled, 6)["seed"] == 9
    assert sampling_options(sampled, 5)["top_k"] == 50 and sampling_options(sampled, 5)["temperature"] == 0.8
    (tmp_path / "generation_config.json").write_text('{"top_k": 20, "top_p": 0.9, "min_p": 0.05}')
    assert hf_sampling(tmp_path) == (("top_k", 20), ("top_p", 0.9), ("min_p", 0.05))


def test_under_a_deadline_the_first_slots_start_then_only_replies_that_end_by_it(monkeypatch):
    from types import SimpleNamespace

    from dflash.regen import vllm
    from dflash.regen.vllm import ReplyEngine

    now = 100.0
    monkeypatch.setattr(vllm, "time", SimpleNamespace(perf_counter=lambda: now))  # a clock that stands still
    engine = object.__new__(ReplyEngine)  # its state alone: no vLLM
    engine.settings, engine.slots, engine.running, engine.added, engine.step_s = ReplySettings(9, 0), 4, set(), 0, 0.0
    assert engine.room(now - 1) == 4  # the first slots' worth always starts
    engine.running, engine.added, engine.step_s = {"0", "1"}, 4, 0.5  # 2 slots free; a reply takes 10 steps, 5 s
    assert engine.room(now + 5) == 2 and engine.room(float("inf")) == 2  # one started now ends by the deadline
    assert engine.room(now + 4.9) == 0  # it would end past the deadline: none starts
    engine.running = set()
    assert engine.room(now + 4.9) == 0  # and the regen ends once those running are answered


def test_a_prompt_and_reply_past_the_targets_positions_is_one_line(env):
    folder = env.root / "model"  # max_position_embeddings 4096
    assert model_len(folder, 40, 12) == 60 and model_len(folder, 4090, 6) == 4096
    with pytest.raises(ConfigError, match=r"a prompt of 4090 tokens .* set regen\.max_prompt_tokens \(at most 4084\)"):
        model_len(folder, 4090, 12)


def _records(path: Path) -> dict[tuple[int, int], list[dict[str, str]]]:
    return {(r["id"], r["turn"]): r["messages"] for r in map(json.loads, path.read_text(encoding="utf-8").splitlines())}


def _with_second_turns(env: Env) -> str:
    """The prompt file's conversations, every other one with a second user turn: the config
    override that reads them."""
    path = env.root / "turns.jsonl"
    convs = [json.loads(line) for line in (env.root / "prompts.jsonl").read_text(encoding="utf-8").splitlines()]
    for i, c in enumerate(convs):
        first = [m for m in c["messages"] if m["role"] != "assistant"]
        c["messages"] = first + (
            [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "why"}] if i % 2 else []
        )
    path.write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")
    return f"regen.prompts={json.dumps(str(path))}"


def _stats(stdout: str) -> dict[str, Any]:
    (record,) = [r for r in map(json.loads, filter(None, stdout.splitlines())) if r.get("event") == "regen"]
    return record


@pytest.mark.slow
def test_vllm_writes_the_local_loops_replies_token_for_token_and_resumes(env, monkeypatch):
    if not ENGINES_PY.exists():
        pytest.fail(f"{ENGINES_PY} is missing: `make test` (or `make engines`) builds it")
    import torch

    from dflash.model.loading import load_tokenizer
    from dflash.model.target import load_target
    from dflash.regen import command as regen

    over = _with_second_turns(env)  # every turn: the second asked with each engine's own first reply
    local = env.cfg("hf", over)
    turns = sum(len(t) for t in load_prompts(local).train)
    assert turns > NUM_TRAIN
    tokenizer = load_tokenizer(local.target, local.data.cache_dir)
    target = load_target(local.target, torch.device("cpu"), local.drafter.num_layers, local.data.cache_dir)
    ours: dict[int, list[int]] = {}
    write = regen._OutputFile.write_ids

    def recorded(self: Any, i: int, ids: list[int]) -> Any:
        ours[i] = list(ids)
        return write(self, i, ids)

    monkeypatch.setattr(regen._OutputFile, "write_ids", recorded)
    assert regen.regenerate(local, target, tokenizer, progress=False)["generated"] == turns

    script, ids = env.root / "recording.py", env.root / "vllm_ids.json"
    script.write_text(RECORDING, encoding="utf-8")
    args = [str(env.config), "--set", 'run.name="vllm"', "--set", 'regen.engine="vllm"', "--set", over]
    run_env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # dflash sizes it
    proc = engines_python([str(script), str(ids), "regen", *args], env=run_env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = _stats(proc.stdout)
    assert (stats["engine"], stats["generated"], stats["target_dtype"]) == ("vllm", turns, "float32")
    theirs = {int(i): v for i, v in json.loads(ids.read_text()).items()}
    assert theirs == ours  # every reply's token ids
    assert sum(map(len, ours.values())) == stats["new_tokens"]
    assert len({tuple(v) for v in ours.values()}) > NUM_TRAIN // 2 and sum(len(v) < 12 for v in ours.values()) >= 3
    vllm_cfg = env.cfg("vllm", 'regen.engine="vllm"', over)
    assert _records(vllm_cfg.regen_output) == _records(local.regen_output)  # the text, and the prompts by id
    assert vllm_cfg.regen_heldout.read_text() == local.regen_heldout.read_text()

    again = engines_python(["-m", "dflash", "regen", *args], env=run_env, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = _stats(again.stdout)
    assert (resumed["generated"], resumed["resumed_from"], resumed["engine_start_s"]) == (0, turns, 0.0)
    assert len(vllm_cfg.regen_output.read_text().splitlines()) == turns

    # stopped mid-conversation (regen.max_minutes spent after the first turns), then resumed: the
    # local loop's records, each turn once
    cut = [str(env.config), "--set", 'run.name="vllm_cut"', "--set", 'regen.engine="vllm"', "--set", over]
    for extra in (["--set", "regen.max_minutes=0.0001"], []):
        proc = engines_python(["-m", "dflash", "regen", *cut, *extra], env=run_env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if extra:
            part = _stats(proc.stdout)
            assert 0 < part["generated"] < turns and part["unanswered"] > 0, part
    cut_cfg = env.cfg("vllm_cut", 'regen.engine="vllm"', over)
    assert _stats(proc.stdout)["resumed_from"] == part["generated"]
    assert _records(cut_cfg.regen_output) == _records(local.regen_output)
    assert len(cut_cfg.regen_output.read_text().splitlines()) == turns
