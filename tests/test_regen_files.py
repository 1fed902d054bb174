"""`dflash regen` → `data.source = "files"` → `dflash run` / `dflash eval`, end to end on a
tiny local Hugging Face folder (random Qwen3 + word-level ChatML tokenizer): the regen
output and held-out files, resume (torn tails included), determinism, training and eval on
the regen output, and one-line errors for the usual mistakes.

The CLI runs as real subprocesses of `bin/dflash` (forked from the tests' server: see `Cli`;
HOME pointed into the tmp folder, so that dflash's caches under ~ stay in it), started early
and in parallel by `Cli`; regen's resume and determinism run in-process against the same
model folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.config import Config, load_config
from dflash.errors import ConfigError, DataError
from dflash.regen import regenerate
from tests.conftest import ForkedPopen, json_lines, run_records

ROOT = Path(__file__).resolve().parents[1]
DFLASH = ROOT / "bin" / "dflash"

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|mask|>"]
WORDS = (
    "system user assistant you are terse hi hello there how is it going fine thanks bye ok "
    "tell me about the cat dog sun moon sea sky tree red blue green one two three four five "
    "what why when where who please sure yes no"
)
SUBJECTS = ["cat", "dog", "sun", "moon", "sea", "sky"]
ADJECTIVES = ["red", "blue", "green", "one"]
NUM_CONVERSATIONS = len(SUBJECTS) * len(ADJECTIVES)  # 24
HOLDOUT = 4
NUM_TRAIN = NUM_CONVERSATIONS - HOLDOUT  # 20


def _conversations() -> list[dict[str, Any]]:
    """24 distinct short chats: some with a system turn, some with an assistant turn to cut."""
    out = []
    for i, (adj, subj) in enumerate((a, s) for a in ADJECTIVES for s in SUBJECTS):
        user = {"role": "user", "content": f"tell me about the {adj} {subj}"}
        if i % 3 == 0:
            msgs = [{"role": "system", "content": "you are terse"}, user]
        elif i % 3 == 1:
            msgs = [user, {"role": "assistant", "content": "fine thanks"}]
        else:
            msgs = [user]
        out.append({"messages": msgs})
    return out


def _prompt_of(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation cut before its first assistant turn (what regen prompts with)."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append(m)
    return out


def _key(messages: list[dict[str, str]]) -> str:
    return json.dumps(messages, sort_keys=True)


@dataclass
class Env:
    root: Path
    model: Path
    prompts: Path
    config: Path
    runs: Path
    cache: Path
    home: Path
    mask_id: int

    def run_dir(self, name: str) -> Path:
        return self.runs / name

    def cfg(self, name: str, *overrides: str) -> Config:
        return load_config(self.config, [f'run.name="{name}"', *overrides])


def _tokenizer(words: str = WORDS, template: str = CHATML, more_specials: tuple[str, ...] = ()) -> Any:
    """A word-level tokenizer over `words` (one token per word or newline) with ChatML's special
    tokens (and `more_specials`) and the chat `template`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.Split(Regex("\n"), "isolated")]
    )
    tok.train_from_iterator([words, "\n"], trainers.WordLevelTrainer(special_tokens=[*SPECIALS, *more_specials]))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|mask|>", *more_specials],
    )
    hf.chat_template = template
    return hf


def regen_setup(root: Path, model: Any, tok: Any, batch_size: int) -> Path:
    """`model` and `tok` saved as a local HF folder under `root`, the conversations as a prompt
    file, and a regen config over them; returns the config's path."""
    import tomli_w

    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in _conversations()), encoding="utf-8")
    config = {
        "run": {"name": "main", "output_dir": str(root / "runs"), "seed": 0},
        "target": {"kind": "hf", "path": str(root / "model"), "stop_token": "<|im_end|>"},
        "regen": {"prompts": str(prompts), "holdout": HOLDOUT, "max_new_tokens": 12, "batch_size": batch_size},
        "data": {"cache_dir": str(root / "cache")},
    }
    path = root / "regen.toml"
    path.write_text(tomli_w.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    """A local HF folder (random tiny Qwen3 + ChatML tokenizer), a prompt JSONL, a config."""
    import tomli_w
    from transformers.utils import logging as hf_logging

    from dflash.config import TinyTargetConfig
    from dflash.model.target import build_tiny

    root = tmp_path_factory.mktemp("regen_files")
    model_dir = root / "model"
    tok = _tokenizer()
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    assert isinstance(mask_id, int) and mask_id != tok.unk_token_id
    hf_logging.disable_progress_bar()
    build_tiny(TinyTargetConfig(vocab_size=len(tok))).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in _conversations()), encoding="utf-8")
    runs, cache, home = root / "runs", root / "cache", root / "home"
    home.mkdir()
    config = {
        "run": {"name": "main", "output_dir": str(runs), "seed": 0},
        "target": {"kind": "hf", "path": str(model_dir), "stop_token": "<|im_end|>"},
        "regen": {"prompts": str(prompts), "holdout": HOLDOUT, "max_new_tokens": 12, "batch_size": 8},
        "data": {
            "source": "files",
            "files": [{"path": str(runs / "main" / "regen.jsonl")}],
            "cache_dir": str(cache),
            "batch_size": 8,
            "max_seq_len": 64,
        },
        "drafter": {"num_layers": 1, "block_size": 4, "max_anchors": 8, "mask_token_id": mask_id},
        "train": {"epochs": 1, "log_every": 1},
        "optimizer": {"lr": 1e-2},
        "profile": {"interval_s": 5.0},
        "eval": {"num_prompts": 2, "max_new_tokens": 8, "at_end": True},
    }
    cfg_path = root / "regen.toml"
    cfg_path.write_text(tomli_w.dumps(config), encoding="utf-8")
    return Env(root, model_dir, prompts, cfg_path, runs, cache, home, mask_id)


@pytest.fixture(scope="session")
def loaded(env: Env) -> tuple[Any, Any]:
    """(target, tokenizer) loaded in-process, the way `dflash regen` loads them."""
    from dflash.model.loading import load_tokenizer
    from dflash.model.target import load_target

    cfg = env.cfg("main")
    tokenizer = load_tokenizer(cfg.target, cfg.data.cache_dir)
    target = load_target(cfg.target, torch.device("cpu"), cfg.drafter.num_layers, cfg.data.cache_dir)
    return target, tokenizer


class Cli:
    """`bin/dflash` subprocesses, each started as soon as its inputs exist and collected when a
    test needs it: forked from the tests' server, which has imported torch, transformers and
    dflash already (`conftest.ForkedPopen`), so a start costs no imports, and they overlap the
    in-process tests. cwd is the tmp folder, HOME is in it (dflash reads it when it expands
    `~`); stdout/stderr go to files, so a run never stalls on a full pipe while nobody reads it."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.logs = env.root / "cli_logs"
        self.logs.mkdir(exist_ok=True)
        self.procs: dict[str, ForkedPopen] = {}

    def start(self, name: str, *args: str) -> None:
        drop = {"DFLASH_PROFILE_INTERVAL", "DFLASH_INJECT_FAULT", "DFLASH_DEBUG"}
        env_vars = {k: v for k, v in os.environ.items() if k not in drop}
        env_vars.update(HOME=str(self.env.home), HF_HUB_OFFLINE="1")
        with (self.logs / f"{name}.out").open("wb") as out, (self.logs / f"{name}.err").open("wb") as err:
            self.procs[name] = ForkedPopen([str(DFLASH), *args], list(args), env_vars, self.env.root, out, err)

    def result(self, name: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        proc = self.procs[name]
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"{proc.args} timed out")
        read = lambda ext: (self.logs / f"{name}.{ext}").read_text(encoding="utf-8")  # noqa: E731
        return subprocess.CompletedProcess(proc.args, proc.returncode, read("out"), read("err"))

    def close(self) -> None:
        for proc in self.procs.values():  # only ours, by object: a failed test leaves none behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def regen_in_process(env: Env, loaded: tuple[Any, Any], name: str, *overrides: str) -> dict[str, Any]:
    target, tokenizer = loaded
    return regenerate(env.cfg(name, *overrides), target, tokenizer, progress=False)


# -- the CLI runs, shared: regen once, train once on its output, misuse alongside ------------


def misuse_cases(env: Env) -> dict[str, tuple[list[str], int, str]]:
    """name: (bin/dflash arguments, exit code, what the one error line must say)."""
    cfg = str(env.config)
    missing_prompts, missing_data = env.root / "no_prompts.jsonl", env.root / "no_data.jsonl"
    return {
        "tiny": (
            ["regen", cfg, "--set", 'run.name="tiny"', "--set", 'target.kind="tiny"'],
            2, "regen needs a real target",
        ),
        "no_prompts": (
            ["regen", cfg, "--set", 'run.name="no_prompts"', "--set", f'regen.prompts="{missing_prompts}"'],
            1, f"regen.prompts: file not found: {missing_prompts}",
        ),
        "no_data": (
            ["run", cfg, "--set", 'run.name="no_data"', "--set", f'data.files=[{{path = "{missing_data}"}}]'],
            1, f"dataset not found: {missing_data}",
        ),
        "no_heldout": (  # needs a trained drafter: started once training is done
            ["eval", cfg, "--set", 'run.name="no_heldout"', "--set", f'eval.prompts="{missing_prompts}"',
             "--drafter", str(env.run_dir("main") / "final")],
            1, f"eval prompts not found: {missing_prompts}",
        ),
    }  # fmt: skip


# `eval --prompts 9` on a holdout of 4: the count is capped by the held-out file.
EVAL_ARGS = ["--set", 'run.name="main"', "--prompts", "9", "--max-new-tokens", "6"]


@pytest.fixture(scope="session")
def cli(env: Env):
    c = Cli(env)
    yield c
    c.close()


@pytest.fixture(scope="session")
def regen_run(env: Env, cli: Cli) -> subprocess.CompletedProcess[str]:
    """`dflash regen` of the whole prompt set (the misuse runs that need nothing start with it);
    once it is done, the training run on its output starts in the background."""
    # The server's torch has this process's thread count (OMP_NUM_THREADS, conftest):
    # test_greedy_regen_is_deterministic compares outputs.
    cli.start("regen", "regen", str(env.config), "--set", 'run.name="main"')
    for name in ("tiny", "no_prompts", "no_data"):
        cli.start(name, *misuse_cases(env)[name][0])
    proc = cli.result("regen")
    if proc.returncode == 0:
        cli.start("run", "run", str(env.config), "--set", 'run.name="main"')
    return proc


@pytest.fixture(scope="session")
def trained_run(env: Env, cli: Cli, regen_run: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """`dflash run` on the regen output; once done, the eval runs on its drafter start."""
    assert regen_run.returncode == 0, regen_run.stderr
    proc = cli.result("run")
    if proc.returncode == 0:
        final = str(env.run_dir("main") / "final")
        cli.start("eval", "eval", str(env.config), "--drafter", final, *EVAL_ARGS)
        turns = env.root / "two_turns.jsonl"
        turns.write_text("".join(json.dumps({"turns": [f"tell me about {w}", "and then?"]}) + "\n" for w in ("a", "b")))
        sets = ["--prompts", "heldout", "--prompts", str(turns), "--num-prompts", "2", "--max-new-tokens", "6"]
        cli.start("eval_sets", "eval", str(env.config), "--drafter", final, "--set", 'run.name="main"', *sets)
        cli.start("no_heldout", *misuse_cases(env)["no_heldout"][0])
    return proc


def test_regen_cli_writes_replies_and_disjoint_heldout(env: Env, regen_run: subprocess.CompletedProcess[str]) -> None:
    """`dflash regen` writes <run>/regen.jsonl ({id, messages} ending with an assistant turn, one
    per training prompt) and <run>/regen.heldout.jsonl (the held-out prompts, disjoint from the
    training ones); stdout is exactly one JSON `regen` record."""
    assert regen_run.returncode == 0, regen_run.stderr
    assert "Traceback" not in regen_run.stderr
    (rec,) = json_lines(regen_run.stdout)
    run = env.run_dir("main")
    out, held = run / "regen.jsonl", run / "regen.heldout.jsonl"
    assert rec["event"] == "regen"
    assert rec["output"] == str(out) and rec["heldout"] == str(held)
    assert (rec["prompts"], rec["generated"], rec["resumed_from"]) == (NUM_TRAIN, NUM_TRAIN, 0)
    assert 0 < rec["new_tokens"] <= NUM_TRAIN * 12  # max_new_tokens = 12

    all_prompts = {_key(_prompt_of(c["messages"])) for c in _conversations()}
    assert len(all_prompts) == NUM_CONVERSATIONS
    records = read_jsonl(out)
    assert out.read_bytes().endswith(b"\n")
    assert len(records) == NUM_TRAIN
    assert all(set(r) == {"id", "turn", "messages"} and r["turn"] == 1 for r in records)
    assert sorted(r["id"] for r in records) == list(range(NUM_TRAIN))
    for r in records:
        *prompt, reply = r["messages"]
        assert reply["role"] == "assistant" and isinstance(reply["content"], str)
        assert prompt[-1]["role"] == "user" and all(m["role"] != "assistant" for m in prompt)
    train_prompts = {_key(r["messages"][:-1]) for r in records}

    heldout = read_jsonl(held)
    assert len(heldout) == HOLDOUT
    assert sorted(h["id"] for h in heldout) == list(range(HOLDOUT))
    held_prompts = {_key(h["messages"]) for h in heldout}
    assert all(h["messages"][-1]["role"] == "user" for h in heldout)
    assert len(held_prompts) == HOLDOUT and not held_prompts & train_prompts
    assert held_prompts | train_prompts == all_prompts


def test_regen_resumes_and_drops_a_torn_tail(env: Env, loaded: tuple[Any, Any]) -> None:
    """Regen resumes: 6 prompts, then 12, generates only the 6 new ones; a torn last line is
    dropped and regenerated, leaving 12 distinct ids and no duplicates."""
    out = env.cfg("resume").regen_output
    first = regen_in_process(env, loaded, "resume", "regen.max_prompts=6")
    assert (first["prompts"], first["generated"], first["resumed_from"]) == (6, 6, 0)
    ids_6 = [r["id"] for r in read_jsonl(out)]
    assert sorted(ids_6) == list(range(6))

    second = regen_in_process(env, loaded, "resume", "regen.max_prompts=12")
    assert (second["prompts"], second["generated"], second["resumed_from"]) == (12, 6, 6)
    records = read_jsonl(out)
    assert [r["id"] for r in records[:6]] == ids_6  # appended, the first six untouched
    assert sorted(r["id"] for r in records) == list(range(12))

    data = out.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    torn_id = json.loads(data[last_start:])["id"]
    out.write_bytes(data[: last_start + (len(data) - last_start) // 2])  # cut the last line mid-way
    third = regen_in_process(env, loaded, "resume", "regen.max_prompts=12")
    assert (third["generated"], third["resumed_from"]) == (1, 11)
    records = read_jsonl(out)  # every line parses: the torn one is gone
    assert out.read_bytes().endswith(b"\n")
    assert sorted(r["id"] for r in records) == list(range(12))
    assert records[-1]["id"] == torn_id

    again = regen_in_process(env, loaded, "resume", "regen.max_prompts=12")
    assert (again["generated"], again["resumed_from"]) == (0, 12)
    assert len(read_jsonl(out)) == 12


def test_regen_max_minutes_stops_between_batches_and_a_later_regen_finishes(env: Env, loaded: tuple[Any, Any]) -> None:
    """`regen.max_minutes`: past the budget no new batch starts (one batch at least); the
    replies written are kept, the rest are counted as unanswered, and a regen without the
    budget answers only those."""
    out = env.cfg("budget").regen_output
    sets = ("regen.max_prompts=12", "regen.batch_size=4")
    first = regen_in_process(env, loaded, "budget", *sets, "regen.max_minutes=1e-6")
    assert (first["prompts"], first["generated"], first["resumed_from"], first["unanswered"]) == (12, 4, 0, 8)
    assert len(read_jsonl(out)) == 4
    rest = regen_in_process(env, loaded, "budget", *sets)
    assert (rest["generated"], rest["resumed_from"], rest["unanswered"]) == (8, 4, 0)
    assert sorted(r["id"] for r in read_jsonl(out)) == list(range(12))
    done = regen_in_process(env, loaded, "budget", *sets, "regen.max_minutes=1e-6")  # nothing left to do
    assert (done["generated"], done["resumed_from"], done["unanswered"]) == (0, 12, 0)


def test_regen_max_prompt_tokens_skips_longer_prompts_and_counts_them(env: Env, loaded: tuple[Any, Any]) -> None:
    """`regen.max_prompt_tokens`: training prompts longer than the cap (with the chat
    template) are skipped and counted (`too_long`), not left unanswered; the rest are answered."""
    from dflash.data.prompts import load_prompts

    _, tokenizer = loaded
    cfg = env.cfg("cap", "regen.max_prompts=12")
    train = load_prompts(cfg).train
    ids = [
        tokenizer.apply_chat_template(p[0], add_generation_prompt=True, tokenize=True, return_dict=True) for p in train
    ]
    lengths = [len(x["input_ids"]) for x in ids]
    cap = sorted(lengths)[len(lengths) // 2]
    keep = {i for i, n in enumerate(lengths) if n <= cap}
    assert 0 < len(keep) < len(train)
    stats = regen_in_process(env, loaded, "cap", "regen.max_prompts=12", f"regen.max_prompt_tokens={cap}")
    assert (stats["generated"], stats["too_long"], stats["unanswered"]) == (len(keep), len(train) - len(keep), 0)
    assert {r["id"] for r in read_jsonl(env.cfg("cap").regen_output)} == keep


def test_regen_answers_several_prompt_sets_interleaved(env: Env, loaded: tuple[Any, Any], tmp_path: Path) -> None:
    """`regen.prompts` as a list: the held-out prompts and the first set's training order are
    those of the first set alone; a second set (here a ShareGPT-style JSON array cut short)
    is drawn interleaved with it (equal weights: turn about), its repeats of earlier prompts and
    of itself dropped; max_prompts counts over both; the stats count replies per set. A record
    without a reply is a prompt; one cut short is an error unless data.skip_invalid (then
    counted in a warning)."""
    from dflash.data.prompts import load_prompts

    second = [
        {"conversations": [{"from": "human", "value": f"what is the {w} sky"}, {"from": "gpt", "value": "blue"}]}
        for w in ("red", "blue", "green", "red")  # "red" twice: once only
    ]
    second.append({"conversations": [{"from": "human", "value": "tell me about the red dog"}]})  # in the first set
    second.append({"conversations": [{"from": "human", "value": "hello there"}]})  # no reply: a prompt all the same
    second.append({"conversations": [{"from": "gpt", "value": "hello"}]})  # no user turn: not a prompt
    arr = tmp_path / "more.json"
    text = json.dumps(second)
    arr.write_text(text[:-1] + ', {"conversations": [{"from": "human", "va', encoding="utf-8")  # cut short
    both = f"regen.prompts=[{json.dumps(str(env.prompts))}, {json.dumps(str(arr))}]"

    one = load_prompts(env.cfg("sets"))
    with pytest.raises(DataError, match=r"more\.json"):
        load_prompts(env.cfg("sets", both))
    with pytest.warns(UserWarning, match="skipped 1 invalid record"):
        two = load_prompts(env.cfg("sets", both, "data.skip_invalid=true"))
    first = [t for t, src in zip(two.train, two.source, strict=True) if src == str(env.prompts)]
    assert two.held == one.held and first == one.train
    assert two.source[:8] == [str(env.prompts), str(arr)] * 4  # turn about, while the second set lasts
    extra = sorted(t[0][0]["content"] for t, src in zip(two.train, two.source, strict=True) if src == str(arr))
    assert extra == ["hello there", "what is the blue sky", "what is the green sky", "what is the red sky"]
    assert [n for _, n in two.sets] == [NUM_TRAIN, 4]

    with pytest.warns(UserWarning, match="skipped 1 invalid record"):
        stats = regen_in_process(env, loaded, "sets", both, "data.skip_invalid=true", "regen.max_prompts=6")
    assert list(stats["generated_per_set"].values()) == [3, 3]
    assert [s["prompts"] for s in stats["per_set"].values()] == [3, 3]
    assert stats["prompts"] == 6

    # A first set with repeats: none of a held-out prompt's copies is trained on, every prompt once.
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(json.dumps(c) + "\n" for c in _conversations() * 2), encoding="utf-8")
    dup = load_prompts(env.cfg("sets", f"regen.prompts={json.dumps(str(twice))}"))
    keys = [_key(p[0]) for p in dup.train]
    assert len(set(keys)) == len(keys) == NUM_CONVERSATIONS - len({_key(p[0]) for p in dup.held})
    assert not set(keys) & {_key(p[0]) for p in dup.held}
    with pytest.raises(ConfigError, match="named twice"):
        env.cfg("sets", f"regen.prompts=[{json.dumps(str(arr))}, {json.dumps(str(arr))}]")


def test_greedy_regen_is_deterministic(
    env: Env, loaded: tuple[Any, Any], regen_run: subprocess.CompletedProcess[str]
) -> None:
    """Greedy regen is deterministic: the same prompts give byte-identical output and held-out
    files in two fresh output folders (the CLI's, and one written in-process)."""
    assert regen_run.returncode == 0, regen_run.stderr
    stats = regen_in_process(env, loaded, "again")
    assert stats["generated"] == NUM_TRAIN
    a, b = env.run_dir("main"), env.run_dir("again")
    assert (b / "regen.jsonl").read_bytes() == (a / "regen.jsonl").read_bytes()
    assert (b / "regen.heldout.jsonl").read_bytes() == (a / "regen.heldout.jsonl").read_bytes()


def test_run_trains_on_regen_output_and_evaluates(env: Env, trained_run: subprocess.CompletedProcess[str]) -> None:
    """`dflash run` with data.source = "files" on the regen output trains (setup's data stats
    count the regen records), evaluates losslessly on the held-out prompts, ends with run_end,
    and writes no cache outside data.cache_dir."""
    assert trained_run.returncode == 0, trained_run.stderr
    assert "Traceback" not in trained_run.stderr
    records = json_lines(trained_run.stdout)
    by_event: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_event.setdefault(r["event"], []).append(r)
    assert "run_failed" not in by_event and "warning" not in by_event, by_event.get("warning")

    (setup,) = by_event["setup"]
    data = setup["data"]
    assert data["records"] == data["samples"] == setup["samples"] == NUM_TRAIN
    assert data["skipped_invalid"] == data["dropped_overlong"] == 0
    assert 0 < data["supervised_tokens"] < data["tokens"]
    assert setup["mask_token_id"] == env.mask_id
    assert setup["total_steps"] == 3  # 20 samples, batch 8, one epoch

    assert len(by_event["train_step"]) == 3
    (ev,) = by_event["eval"]
    assert ev["lossless"] is True and ev["mismatched_prompts"] == 0
    assert ev["prompts"] == 2 and ev["verify_steps"] > 0 and 0 < ev["tokens"] <= 2 * 8

    (end,) = by_event["run_end"]
    assert records[-1] is end
    assert end["steps"] == 3 and end["eval_lossless"] is True
    final = env.run_dir("main") / "final"
    assert end["export_dir"] == str(final)
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()

    assert any((env.cache / "tokenized").glob("*.safetensors"))
    assert not (env.home / ".cache" / "dflash").exists()


def test_a_run_named_apart_from_its_regen_run_evaluates_on_its_heldout_prompts(
    env: Env, regen_run: subprocess.CompletedProcess[str]
) -> None:
    """A new user's path: a run with another name than the regen run, trained on that run's
    regen.jsonl, finds the held-out prompts beside its data file, exports and evaluates."""
    assert regen_run.returncode == 0, regen_run.stderr
    records = run_records(env.cfg("renamed", "train.max_steps=1"))
    (ev,) = [r for r in records if r["event"] == "eval"]
    assert ev["prompts"] == 2 and ev["lossless"] is True
    assert records[-1]["event"] == "run_end" and records[-1]["export_dir"] == str(env.run_dir("renamed") / "final")
    assert (env.run_dir("renamed") / "records.jsonl").is_file()


# -- regressions of fixed regen bugs (torn lines, eval.prompts overwritten). In-process,
# placed here so that they run while the eval subprocesses below are busy. ----------------


def test_resume_keeps_a_complete_last_record_missing_its_newline(env: Env, loaded: tuple[Any, Any]) -> None:
    """A regen output cut just before its final newline resumes to all ids, none lost."""
    out = env.cfg("no_newline").regen_output
    regen_in_process(env, loaded, "no_newline", "regen.max_prompts=3")
    out.write_bytes(out.read_bytes()[:-1])
    stats = regen_in_process(env, loaded, "no_newline", "regen.max_prompts=3")
    assert sorted(r["id"] for r in read_jsonl(out)) == [0, 1, 2], stats


def test_regen_keeps_the_template_options_and_refuses_to_mix_them(env: Env, loaded: tuple[Any, Any]) -> None:
    """Each reply records the `data.chat_template_kwargs` its prompt was rendered with; a
    resume under other options is refused, naming both (the file would mix renderings)."""
    out = env.cfg("kwargs").regen_output
    regen_in_process(env, loaded, "kwargs", "regen.max_prompts=2", "data.chat_template_kwargs={terse=true}")
    assert [r["chat_template_kwargs"] for r in read_jsonl(out)] == [{"terse": True}] * 2
    with pytest.raises(DataError, match=r"written with data.chat_template_kwargs = \{'terse': True\}, the config now "
                       r"has \{\}; use a new regen.output"):  # fmt: skip
        regen_in_process(env, loaded, "kwargs", "regen.max_prompts=3")


def test_resume_after_a_torn_first_line(env: Env, loaded: tuple[Any, Any]) -> None:
    """A regen output whose only line is torn is regenerated into a valid file, no duplicates."""
    out = env.cfg("torn_first").regen_output
    regen_in_process(env, loaded, "torn_first", "regen.max_prompts=3")
    out.write_bytes(out.read_bytes()[:15])
    regen_in_process(env, loaded, "torn_first", "regen.max_prompts=3")
    assert sorted(r["id"] for r in read_jsonl(out)) == [0, 1, 2]


def test_a_second_regen_on_the_same_output_is_refused(env: Env, loaded: tuple[Any, Any]) -> None:
    """Two regens appending to one file would answer prompts twice: the second one stops at
    once with a one-line error, and the file is left as the first one writes it."""
    import fcntl

    out = env.cfg("locked").regen_output
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.with_name(out.name + ".lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # stands in for a regen still running
        with pytest.raises(DataError, match="another `dflash regen` is writing it"):
            regen_in_process(env, loaded, "locked", "regen.max_prompts=2")
    assert not out.exists()
    regen_in_process(env, loaded, "locked", "regen.max_prompts=2")  # free again once it ends
    assert sorted(r["id"] for r in read_jsonl(out)) == [0, 1]


def test_regen_leaves_eval_prompts_file_alone(env: Env, loaded: tuple[Any, Any]) -> None:
    """With eval.prompts set to the user's own file, regen does not overwrite it."""
    mine = env.root / "my_eval_prompts.jsonl"
    text = json.dumps({"messages": [{"role": "user", "content": "tell me about the tree"}]}) + "\n"
    mine.write_text(text, encoding="utf-8")
    regen_in_process(env, loaded, "own_eval", "regen.max_prompts=2", f'eval.prompts="{mine}"')
    assert mine.read_text(encoding="utf-8") == text


def test_eval_cli_on_heldout_prompts(cli: Cli, trained_run: subprocess.CompletedProcess[str]) -> None:
    """`dflash eval CONFIG --drafter <run>/final` evaluates on the held-out file: one `eval`
    record, lossless, over min(num_prompts, holdout) prompts."""
    assert trained_run.returncode == 0, trained_run.stderr
    proc = cli.result("eval")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    (rec,) = json_lines(proc.stdout)
    assert rec["event"] == "eval"
    assert rec["lossless"] is True and rec["mismatched_prompts"] == 0
    assert rec["prompts"] == min(9, HOLDOUT)
    assert rec["block_size"] == 4 and 0 < rec["tokens"] <= HOLDOUT * 6


def test_eval_cli_on_prompt_sets(cli: Cli, trained_run: subprocess.CompletedProcess[str]) -> None:
    """`dflash eval --prompts heldout --prompts FILE --num-prompts 2`: one `eval` record per
    set; a two-turn prompt is two generations, the second after the target's own reply; a
    table per set on stderr."""
    assert trained_run.returncode == 0, trained_run.stderr
    proc = cli.result("eval_sets")
    assert proc.returncode == 0, proc.stderr
    held, turns = json_lines(proc.stdout)
    assert (held["prompt_set"], held["prompts"], held["generations"]) == ("heldout", 2, 2)
    assert (turns["prompt_set"], turns["prompts"], turns["generations"]) == ("two_turns", 2, 4)
    assert held["lossless"] is True and turns["lossless"] is True
    assert "prompt set" in proc.stderr and "two_turns" in proc.stderr


def test_misuse_is_one_line_without_traceback(
    env: Env, cli: Cli, regen_run: subprocess.CompletedProcess[str], trained_run: subprocess.CompletedProcess[str]
) -> None:
    """Regen on the tiny target, regen with a missing prompts file, eval before regen (no
    held-out file) and run on a missing data file each fail with one `dflash: error:` line on
    stderr, the documented exit code, no traceback and no result record."""
    assert trained_run.returncode == 0, trained_run.stderr
    for name, (_, code, needle) in misuse_cases(env).items():
        proc = cli.result(name)
        assert proc.returncode == code, (name, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr, (name, proc.stderr)
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("dflash: error: "), (name, proc.stderr)
        assert needle in lines[0], (name, lines[0])
        events = [r["event"] for r in json_lines(proc.stdout)]
        assert not {"run_end", "regen", "eval"} & set(events), (name, events)
    for name in ("tiny", "no_prompts"):
        assert not (env.run_dir(name) / "regen.jsonl").exists()
        assert not (env.run_dir(name) / "regen.heldout.jsonl").exists()


# -- feature files (regen.save_features) ------------------------------------------------------


def _feature_regen(env: Env, loaded: tuple[Any, Any], name: str, *extra: str) -> tuple[dict[str, Any], Path]:
    sets = ("regen.save_features=true", "regen.max_prompts=12", "regen.batch_size=4", *extra)
    stats = regen_in_process(env, loaded, name, *sets)
    return stats, Path(stats["features"])


def test_regen_features_equal_a_training_forward(env: Env, loaded: tuple[Any, Any]) -> None:
    """`regen.save_features`: every reply gets an entry whose ids are its training tokenization,
    whose features are the target's (a full forward over those ids, as training computes
    them) at every position but the end-of-turn tail, and whose `next` is the target's greedy
    token wherever it is a label (supervised next position); resumed, parts append."""
    from dflash.data.chat_template import tokenize_conversation
    from dflash.features.files import read_folder

    target, tokenizer = loaded
    stats, folder = _feature_regen(env, loaded, "feats")
    assert folder == env.run_dir("feats") / "regen.features" and stats["features_mb"] > 0
    assert sorted(p.name for p in folder.iterdir()) == [f"part-0000{i}.safetensors" for i in range(3)]
    written = read_jsonl(Path(stats["output"]))
    records = {tuple(tokenize_conversation(tokenizer, r["messages"])[0]): r for r in written}
    entries = list(read_folder(folder))
    assert len(entries) == 12
    for meta, e in entries:
        assert meta.layer_ids == target.layer_ids and meta.greedy and meta.width == target.hidden_size
        ids = e.ids.tolist()
        _, mask = tokenize_conversation(tokenizer, records[tuple(ids)]["messages"])
        T = len(ids)
        layers, (_, top) = target.teacher(e.ids[None], torch.zeros(1, T, dtype=torch.long), torch.arange(T)[None],
                                          packed=False, k=1)  # fmt: skip
        ref = torch.cat(layers, dim=-1)[0]
        torch.testing.assert_close(e.features[: T - 2].float(), ref[: T - 2].bfloat16().float(), atol=2e-2, rtol=2e-2)
        # <|im_end|> and "\n": never fed while generating (zeros), or all redone by a forward
        tail = e.features[T - 2 :].float()
        assert not tail.any() or torch.allclose(tail, ref[T - 2 :].bfloat16().float(), atol=2e-2, rtol=2e-2)
        labels = torch.tensor(mask[1:])  # next[p] is a label where p + 1 is supervised
        labels[-1] = False  # the one after <|im_end|>: the data's "\n" (no end of turn follows it)
        assert torch.equal(e.next[:-1][labels], top[0, :-1, 0][labels])

    more, _ = _feature_regen(env, loaded, "feats", "regen.max_prompts=16")
    assert more["generated"] == 4 and len(list(read_folder(folder))) == 16
    assert (folder / "part-00003.safetensors").is_file()


def test_regen_feature_entries_recompute_what_retokenizing_changes(loaded: tuple[Any, Any]) -> None:
    """A reply whose written text tokenizes differently from what was generated (here: `fed`
    made wrong on purpose) gets its features and labels from a target forward over the
    training tokenization; a matching one keeps what generation computed."""
    from dflash.data.chat_template import tokenize_conversation
    from dflash.regen.local import feature_entries

    target, tokenizer = loaded
    conv = [{"role": "user", "content": "tell me about the cat"}, {"role": "assistant", "content": "the red dog"}]
    ids, _ = tokenize_conversation(tokenizer, conv)
    T, W = len(ids), target.hidden_size
    generated = torch.randn(T - 2, W)
    wrong = [*ids[: T - 4], ids[0], ids[0]]  # the last two reply tokens differ from the re-tokenization
    good, redone = feature_entries(
        target, tokenizer, [conv, conv], [ids[: T - 2], wrong], [7, 7], [generated, generated], {}, greedy=True
    )
    assert good is not None and redone is not None
    torch.testing.assert_close(good.features[: T - 2], generated.bfloat16())
    assert good.next.tolist()[: T - 3] == ids[1 : T - 2] and int(good.next[T - 3]) == 7  # after the last fed one
    layers, (_, top) = target.teacher(torch.tensor([ids]), torch.zeros(1, T, dtype=torch.long), torch.arange(T)[None],
                                      packed=False, k=1)  # fmt: skip
    torch.testing.assert_close(redone.features, torch.cat(layers, -1)[0].bfloat16())
    assert torch.equal(redone.next, top[0, :, 0])


def test_training_reads_regen_features_from_the_store(env: Env, loaded: tuple[Any, Any]) -> None:
    """A run on a regen output with feature files needs no target forward at all (target
    labels included): every batch is read from the store, by the chain's reader thread (the
    README's thread list); features made by another target layout, distillation, or a sampled
    regen with target labels: not used, with a warning that says why."""
    import threading

    from dflash.train.build import build_training
    from tests.conftest import run_records

    _, folder = _feature_regen(env, loaded, "seeded")
    data = f'data.files=[{{path = "{env.run_dir("seeded") / "regen.jsonl"}"}}]'
    base = ("eval.at_end=false", "checkpoint.export_final=false", data, "train.epochs=2")
    cfg = env.cfg("seeded", *base, 'loss.labels="target"')
    threads: set[str] = set()

    def seen(record: dict[str, Any]) -> None:
        if record["event"] == "train_step":
            threads.update(t.name.rsplit("_", 1)[0] for t in threading.enumerate() if t.name.startswith("dflash-"))

    records = run_records(cfg, timeout_s=120, subscribers=[seen])
    assert threads == {"dflash-data", "dflash-reader0", "dflash-target0", "dflash-drafter0", "dflash-optimizer"}
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "each target chain, its reader with a feature store, each replica" in readme
    (setup,) = [r for r in records if r["event"] == "setup"]
    assert setup["data"]["feature_files_samples"] == setup["samples"] == 12
    (end,) = [r for r in records if r["event"] == "run_end"]
    assert end["feature_store"]["misses"] == 0 and end["feature_store"]["hits"] == end["steps"] == 4
    forwards = [r for r in records if r["event"] == "profile" and "target.model_forward" in r["stages"]]
    assert forwards == [] and (folder / "index.safetensors").is_file()

    def warned(*sets: str) -> str:
        t = build_training(env.cfg("seeded", *base, *sets))
        assert t.data_stats.get("feature_files_samples", 0) == 0 and t.store is None
        (w,) = [w for w in t.warnings if "feature files" in w]
        return w

    assert "layer_ids" in warned("target.layer_ids=[0]")
    assert "top-k" in warned("loss.distill=0.5")
    _feature_regen(env, loaded, "sampled", "regen.temperature=1.0")
    sampled = f'data.files=[{{path = "{env.run_dir("sampled") / "regen.jsonl"}"}}]'
    assert "sampled" in warned(sampled, 'loss.labels="target"')
    t = build_training(env.cfg("seeded", *base, sampled, 'loss.labels="data"'))  # features alone serve data labels
    assert t.data_stats["feature_files_samples"] == 12 and t.store is not None

    from dflash.model.target import Target

    other = (Target(loaded[0].model, [0]), loaded[1])  # another layer: regen will not append its features
    with pytest.raises(DataError, match="layer_ids"):
        _feature_regen(env, other, "seeded", "regen.max_prompts=16")
    assert len(list(folder.glob("part-*"))) == 3
    with pytest.raises(DataError, match="sampled"):  # nor mix sampled parts into greedy ones
        _feature_regen(env, loaded, "seeded", "regen.max_prompts=16", "regen.temperature=1.0")

    off = build_training(env.cfg("seeded", *base, "data.feature_files=false"))
    assert "feature_files_samples" not in off.data_stats and not [w for w in off.warnings if "feature" in w]

    # A damaged part costs only its own entries: the others still serve, one warning names it.
    from safetensors.torch import load_file, save_file

    part = folder / "part-00001.safetensors"
    part.write_bytes(part.read_bytes()[:100])  # cut short
    t = build_training(env.cfg("seeded", *base))
    assert t.data_stats["feature_files_samples"] == 8 and "unreadable" in " ".join(t.warnings)
    bad = folder / "part-00002.safetensors"
    tensors = load_file(bad)
    tensors["next"] = tensors["next"][:1]  # a label column shorter than its ids
    from safetensors import safe_open

    with safe_open(str(folder / "part-00000.safetensors"), framework="pt") as f:
        header = f.metadata()
    save_file(tensors, str(bad), metadata=header)
    t = build_training(env.cfg("seeded", *base, 'loss.labels="target"'))
    assert t.data_stats["feature_files_samples"] == 4 and "shapes do not fit" in " ".join(t.warnings)

    # An index that no longer matches its parts (a part swapped for another of the same size)
    # is one line naming both; a rebuilt index serves again.
    index = folder / "index.safetensors"
    good = folder / "part-00000.safetensors"
    saved = good.read_bytes()
    tensors = load_file(good)
    tensors["ids"] = tensors["ids"].flip(0)
    save_file(tensors, str(good), metadata=header)
    t = build_training(env.cfg("seeded", *base))
    assert t.store is not None
    from dflash.data.samples import collate

    store = t.store
    in_first = next(s for s in t.plan.samples if (h := store.find(s.input_ids)) and store.indexes[0].part[h[1]] == 0)
    with pytest.raises(DataError, match=r"index.safetensors does not match .*part-00000.safetensors"):
        store.read(collate([in_first], 0, 0), torch.float32)
    good.write_bytes(saved)
    index.unlink()
    assert build_training(env.cfg("seeded", *base)).data_stats["feature_files_samples"] == 4


def test_store_fed_training_equals_cache_fed_and_serial(env: Env, loaded: tuple[Any, Any]) -> None:
    """Training from the feature store gives the same losses, bit for bit, with the in-memory
    cache above it (later epochs hit the cache) and without, in the pipeline and the serial loop."""
    from tests.conftest import run_records

    _feature_regen(env, loaded, "storefed")
    data = f'data.files=[{{path = "{env.run_dir("storefed") / "regen.jsonl"}"}}]'
    base = ("eval.at_end=false", "checkpoint.export_final=false", data, "train.epochs=3")

    def losses(name: str, *sets: str) -> tuple[list[float], dict[str, Any]]:
        records = run_records(env.cfg(name, *base, *sets), timeout_s=120)
        (end,) = [r for r in records if r["event"] == "run_end"]
        return [r["loss"] for r in records if r["event"] == "train_step"], end

    store_only, end = losses("sf_store", 'pipeline.mode="serial"')
    assert end["feature_store"]["hits"] == end["steps"] == 6 and end["feature_cache"] is None
    cached, end = losses("sf_cache", 'pipeline.mode="serial"', "data.feature_cache_mb=16")
    assert end["feature_cache"]["hits"] == 4 and end["feature_store"]["hits"] == 2
    assert cached == store_only
    assert losses("sf_pipeline")[0] == store_only


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_each_family_trains_from_feature_files_as_dflash_does(env: Env, loaded: tuple[Any, Any], family: str) -> None:
    """DFlash2 and DSpark through what DFlash goes through with feature files: the store
    alone, the in-memory cache above it (later epochs hit it), a head-only target
    (`target.load = "head"`), each run's final profile record: the same losses, step for step."""
    from tests.conftest import run_records

    name = f"fam_{family}"
    _feature_regen(env, loaded, name)
    options = {"dflash2": ("drafter.dflash2.selector_rank=8", "drafter.dflash2.selector_top_k=4"),
               "dspark": ("drafter.dspark.markov_rank=8",)}[family]  # fmt: skip
    data = f'data.files=[{{path = "{env.run_dir(name) / "regen.jsonl"}"}}]'
    base = ("eval.at_end=false", "checkpoint.export_final=false", data, "train.epochs=2", 'loss.labels="target"',
            'pipeline.mode="serial"', f'drafter.family="{family}"', *options)  # fmt: skip

    def losses(tag: str, *sets: str) -> tuple[list[float], dict[str, Any]]:
        records = run_records(env.cfg(f"{name}_{tag}", *base, *sets), timeout_s=120)
        (end,) = [r for r in records if r["event"] == "run_end"]
        assert end["feature_store"]["misses"] == 0
        assert any(r["event"] == "profile" and r.get("final") for r in records)
        return [r["loss"] for r in records if r["event"] == "train_step"], end

    store, end = losses("store")
    assert end["feature_cache"] is None and len(store) == end["steps"] > 0
    cached, end = losses("cache", "data.feature_cache_mb=16")
    assert end["feature_cache"]["hits"] > 0 and cached == store
    assert losses("head", 'target.load="head"')[0] == store


def test_a_head_only_target_trains_as_the_whole_one_from_feature_files(env: Env, loaded: tuple[Any, Any]) -> None:
    """`target.load = "head"`: only the config, embeddings and LM head load (no decoder layer);
    a run whose every sample has stored features trains step for step as with the whole
    target. What would need the decoder layers is refused in one line before anything loads,
    and samples without stored features are refused after the seeding, naming the count."""
    from dflash.model.target_head import TargetHead, load_target_head
    from dflash.train.build import build_training

    whole_target = loaded[0]
    _feature_regen(env, loaded, "head")
    data = f'data.files=[{{path = "{env.run_dir("head") / "regen.jsonl"}"}}]'
    base = ("eval.at_end=false", "checkpoint.export_final=false", data, "train.epochs=2", 'loss.labels="target"')
    cfg = env.cfg("head", *base, 'target.load="head"')
    t = load_target_head(cfg.target, torch.device("cpu"), cfg.drafter.num_layers, cfg.data.cache_dir)
    assert t.model is None and t.name == whole_target.name and t.layer_ids == whole_target.layer_ids
    assert torch.equal(t.embed_weight, whole_target.embed_weight)
    assert torch.equal(t.lm_head_weight, whole_target.lm_head_weight)

    def losses(records: list[dict[str, Any]]) -> list[float]:
        (end,) = [r for r in records if r["event"] == "run_end"]
        assert end["feature_store"]["misses"] == 0
        return [r["loss"] for r in records if r["event"] == "train_step"]

    head = run_records(cfg, timeout_s=120)
    (setup,) = [r for r in head if r["event"] == "setup"]
    assert setup["target"] == whole_target.name
    assert losses(head) == losses(run_records(env.cfg("head_whole", *base), timeout_s=120))
    training = build_training(cfg)
    assert all(isinstance(tgt, TargetHead) for tgt in training.targets)

    refused = {
        "eval.at_end=true": "eval.at_end = false",
        "drafter.init_from_target=true": "drafter.init_from_target = false",
        "loss.distill=0.5": "loss.distill = 0",
        "data.feature_files=false": "data.feature_files = true",
    }
    for override, says in refused.items():
        with pytest.raises(ConfigError, match=re.escape(says)):
            build_training(env.cfg("head", *base, 'target.load="head"', override))
    extra = env.root / "head_extra"  # the same files, and one conversation more without features
    shutil.copytree(env.run_dir("head") / "regen.features", extra / "regen.features")
    one_more = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bye"}]})
    (extra / "regen.jsonl").write_text((env.run_dir("head") / "regen.jsonl").read_text() + one_more + "\n")
    more = f'data.files=[{{path = "{extra / "regen.jsonl"}"}}]'
    with pytest.raises(DataError, match="12 of 13 samples"):
        build_training(env.cfg("head", *base, 'target.load="head"', more))
    with pytest.raises(ConfigError, match="not the tiny target"):
        env.cfg("head", 'target.kind="tiny"', 'target.load="head"')
    with pytest.raises(ConfigError, match="a GGUF is converted by loading it whole"):
        env.cfg("head", 'target.kind="gguf"', 'target.path="x.gguf"', 'target.load="head"')
    with pytest.raises(ConfigError, match="regen's own loop runs the whole target"):  # the CLI, before loading
        from click.testing import CliRunner

        from dflash.cli import main

        result = CliRunner().invoke(main, ["regen", str(env.config), "--set", 'target.load="head"'])
        raise result.exception or AssertionError(result.output)
    wrong = build_training(env.cfg("head", *base, "target.layer_ids=[0]"))  # features of another layer
    assert wrong.data_stats["feature_files_samples"] == 0
    with pytest.raises(DataError, match=r"0 of 12 samples .*made with layer_ids"):  # the reason, in the line
        build_training(env.cfg("head", *base, 'target.load="head"', "target.layer_ids=[0]"))


def test_regen_batches_keep_the_shuffled_order_across_windows_and_cap_long_outliers() -> None:
    """Regen's batches follow the prompts' (seeded, shuffled) order window by window, so a run
    cut by its budget has answered a random sample, not the shortest prompts; inside a window
    like lengths go together, and a few long prompts get a batch of their own size."""
    from dflash.regen.command import _batches

    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(30, 60, (100,), generator=g)]
    lengths[5] = lengths[50] = 400  # two long outliers
    items = [(i, [1] * n) for i, n in enumerate(lengths)]
    batches = list(_batches(items, 4))
    assert sorted(i for b in batches for i, _ in b) == list(range(100))  # every prompt, once
    window = 8 * 4
    windows = [{i // window for i, _ in b} for b in batches]
    assert all(len(w) == 1 for w in windows), "a batch takes prompts of one window"
    order = [w.pop() for w in windows]
    assert order == sorted(order), "windows in the prompts' order: a cut run has answered the first ones"
    for b in batches:
        assert 1 <= len(b) <= 4
        assert [len(t) for _, t in b] == sorted(len(t) for _, t in b)
    first = [min(len(t) for _, t in b) for b in batches if all(i < window for i, _ in b)]
    assert first != sorted(first), "a window's batches in random order: a cut run has not answered only its shortest"
    assert list(_batches(items, 4)) == batches and list(_batches(items, 4, seed=1)) != batches  # seeded
    outliers = [b for b in batches if any(len(t) == 400 for _, t in b)]
    assert [len(b) for b in outliers] == [1, 1], "a 400-token prompt does not pad three ~45-token ones"


def test_regen_fits_its_last_batch_into_the_budget() -> None:
    """The batch that would end past `regen.max_minutes` is cut to the rows that fit (a batch
    costs a quarter fixed, three quarters per row), or skipped under 8 rows."""
    from dflash.regen.local import _rows_that_fit

    assert _rows_that_fit(100.0, 40.0, 128, 128) == 128  # a whole batch fits
    assert _rows_that_fit(40.0, 40.0, 128, 128) == 128  # exactly
    assert _rows_that_fit(20.0, 40.0, 128, 128) == 42  # (0.5 - 0.25) / 0.75 of 128
    assert _rows_that_fit(10.0, 40.0, 128, 128) == 0  # the fixed quarter alone fills it
    assert _rows_that_fit(-5.0, 40.0, 128, 128) == 0
    assert _rows_that_fit(30.0, 40.0, 128, 16) == 16  # a small batch that fits
    assert _rows_that_fit(5.0, 0.0, 0, 128) == 128  # nothing measured yet: the whole batch


def test_regen_runs_the_shared_prompt_prefix_once_with_the_same_result(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's shared prefix (the chat template's system turn) runs once and its KV cache is
    copied to every row, the padding between it and each row's own tokens: the same greedy
    tokens and features as feeding every whole prompt left-padded, and as one row alone."""
    from dflash.regen import local

    target, tokenizer = loaded
    system = {"role": "system", "content": "You are terse."}
    convs = [[system, *_prompt_of(c["messages"])] for c in _conversations()[:5]]
    kw = {"add_generation_prompt": True, "tokenize": True, "return_dict": True}
    rows = [list(tokenizer.apply_chat_template(c, **kw)["input_ids"]) for c in convs]
    assert local._common_prefix(rows) >= local._MIN_PREFIX
    assert local._common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # every row keeps a token to feed
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    raw = {"do_sample": False, **local._RAW}
    new, feats = local._generate(target, rows, pad, eos, 9, raw, True)
    monkeypatch.setattr(local, "_MIN_PREFIX", 10**6)  # the whole prompts, left-padded
    ref_new, ref_feats = local._generate(target, rows, pad, eos, 9, raw, True)
    assert torch.equal(new, ref_new)
    for r, toks in enumerate(rows):
        n = len(toks) + 8  # the prompt, then every new token but the last
        assert feats[r].shape[0] >= n
        torch.testing.assert_close(feats[r][:n], ref_feats[r][:n], atol=1e-4, rtol=1e-4)
        one, one_feats = local._generate(target, [toks], pad, eos, 9, raw, True)
        assert torch.equal(one[0], new[r])
        torch.testing.assert_close(one_feats[0][:n], feats[r][:n], atol=1e-4, rtol=1e-4)


def test_replay_tau_equals_the_speculative_eval_on_the_same_prompts(
    env: Env, loaded: tuple[Any, Any], trained_run: subprocess.CompletedProcess[str]
) -> None:
    """bench/replay_tau.py: given the target's greedy reply and its features, the walk of
    greedy verification over teacher-forced drafts gives exactly the verify steps speculative
    decoding takes (the same accepted count at each step, max_new_tokens inside a block
    included); and it reads a regen output's feature files."""
    import importlib.util

    from dflash.eval.decode import speculative_generate
    from dflash.eval.prompts import stop_ids
    from dflash.model.drafter import FrozenHead
    from dflash.model.export import load_drafter

    assert trained_run.returncode == 0, trained_run.stderr
    spec = importlib.util.spec_from_file_location("replay_tau", ROOT / "bench" / "replay_tau.py")
    assert spec is not None and spec.loader is not None
    replay_tau = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay_tau)
    target, tokenizer = loaded
    drafter = load_drafter(env.run_dir("main") / "final", torch.device("cpu")).eval()
    head = FrozenHead(target.embed_weight, target.lm_head_weight).to(torch.device("cpu"), torch.float32)
    stops = stop_ids(target, tokenizer)
    heldout = env.run_dir("main") / "regen.heldout.jsonl"
    convs = [r["messages"] for r in read_jsonl(heldout)] + [[{"role": "user", "content": c}] for c in ("a b", "hi")]
    accepted, replies = [], []
    for max_new in (3, 8, 24):
        for msgs in convs:
            enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            prompt = torch.tensor(list(enc["input_ids"]))
            out = speculative_generate(target, drafter, head, prompt, max_new, stops)
            ids = torch.cat([prompt, torch.tensor(out.tokens)])
            _, feats = target.forward_with_features(input_ids=ids[None])
            replies.append((ids, feats[0], len(prompt)))
            got = replay_tau.replay(drafter, head, replies[-1:], int(tokenizer.eos_token_id), max_new)
            assert got["verify_steps"] == len(out.accepted)
            assert got["accept_hist"] == [out.accepted.count(a) for a in range(4)], (got, out.accepted)
            accepted += out.accepted
    assert any(accepted) and any(a == 0 for a in accepted)  # drafts both accepted and rejected

    sets = (f"regen.prompts={json.dumps(str(heldout))}", "regen.holdout=0", "regen.save_features=true")
    stats = regen_in_process(env, loaded, "replay", *sets)
    read = replay_tau.replies_with_features(Path(stats["output"]), tokenizer)
    assert len(read) <= HOLDOUT  # replies that re-tokenize to other tokens than generated are skipped
    for ids, feats, P in read:
        assert feats.shape == (len(ids), target.hidden_size) and 0 < P < len(ids)
