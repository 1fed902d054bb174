"""Chat dataset formats: files on disk in, normalised conversations out.

Every supported layout becomes the same thing — a list of ``{"role", "content"}`` messages
with roles ``system`` / ``user`` / ``assistant`` — so that tokenization (``tokenize.py``)
never cares where a conversation came from:

- **JSONL** (``.jsonl``, or ``.json`` with one record per line): OpenAI-style
  ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ShareGPT-style
  ``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}``.
  A ``.json`` file holding one JSON array of such records (the original ShareGPT dumps)
  is read too.
- **parquet** (``pyarrow``): a ``messages`` or ``conversations`` column of such lists.
- **a ``datasets`` folder** (``datasets.save_to_disk``): the same columns; a
  ``DatasetDict`` is read through its ``train`` split (or its only split).

Each record is normalised by ``conversation.py`` (role spellings, types, at least one
assistant turn).

Problems are split by scope, because ``data.skip_invalid`` may only skip the second kind:
a *file* problem (missing file, unreadable parquet, no such column, optional package not
installed) raises ``DataError`` at once; a *record* problem (malformed JSON, wrong types,
unknown role, bytes that are not UTF-8, no assistant turn) is yielded as an
``InvalidRecord`` and the caller decides. Every item carries its file and line (JSONL,
1-based, as an editor shows it) or row (parquet / ``datasets``, 0-based, as ``ds[i]``), so
a one-line error points straight at the record.
"""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal

from dflash.config import DataFile
from dflash.data.conversation import ROLE_ALIASES, Conversation, InvalidRecord, Message, normalize_record, parse_record
from dflash.errors import DataError
from dflash.store.packages import local_path

__all__ = [
    "ROLE_ALIASES",
    "Conversation",
    "InvalidRecord",
    "Message",
    "count_records",
    "dataset_path",
    "iter_records",
    "normalize_record",
    "resolve_format",
]

Format = Literal["jsonl", "parquet", "hf_datasets"]

_COLUMNS = ("messages", "conversations")
_ARRAY_CHUNK = 4 << 20  # bytes read at a time from a JSON array file
_TOKEN_TAIL = 64  # an error this close to the end of what is read may be a token cut by the read
_CUT_SHORT = "the file ends inside the JSON array (cut short?): this record and any after it are missing"
_ROWS_PER_BATCH = 1024


def dataset_path(path: str, where: str = "") -> Path:
    """Where a dataset's `path` is on this machine (``~`` expanded, relative to the working
    directory, ``pkg:`` inside its package); DataError when it is not there. `where` (e.g.
    ``data.files[0]``) starts the messages."""
    try:
        found = local_path(path)
    except LookupError as err:
        raise DataError(f"{where or path}: {err}") from None
    if not found.exists():
        msg = f"{where}: dataset not found: {path}" if where else f"dataset not found: {path}"
        raise DataError(msg)
    return found


def resolve_format(file: DataFile) -> tuple[Path, Format]:
    """The file's path (``~`` expanded, relative to the working directory) and its format;
    a missing path or one whose format cannot be told is a DataError."""
    path = dataset_path(file.path)
    fmt = file.format
    if fmt == "auto":
        name = path.name.lower()
        if path.is_dir():
            fmt = "hf_datasets"
        elif name.endswith((".jsonl", ".json", ".ndjson")):
            fmt = "jsonl"
        elif name.endswith((".parquet", ".pq")):
            fmt = "parquet"
        else:
            msg = (
                f"{file.path}: cannot tell the format from its name; use .jsonl/.json, .parquet or a "
                "`datasets` folder, or set format = 'jsonl' | 'parquet' | 'hf_datasets'"
            )
            raise DataError(msg)
    if fmt == "hf_datasets" and not path.is_dir():
        msg = f"{file.path}: format 'hf_datasets' needs a folder written by datasets' save_to_disk"
        raise DataError(msg)
    if fmt != "hf_datasets" and path.is_dir():
        msg = f"{file.path}: is a folder; format {fmt!r} needs a file (a folder is read as 'hf_datasets')"
        raise DataError(msg)
    return path, fmt


def iter_records(file: DataFile) -> Iterator[Conversation | InvalidRecord]:
    """Every record of one dataset, in file order: a Conversation or an InvalidRecord.
    File-level problems raise DataError."""
    path, fmt = resolve_format(file)
    if fmt == "jsonl":
        items = _iter_jsonl(path, file.path)
    elif fmt == "parquet":
        items = _iter_parquet(path, file.path)
    else:
        items = _iter_hf_datasets(path, file.path)
    yield from itertools.islice(items, file.max_records or None)


def count_records(file: DataFile) -> int | None:
    """How many records `iter_records` will yield, where that is cheap to know (for a
    progress bar's total); None otherwise."""
    path, fmt = resolve_format(file)
    n = None
    try:
        if fmt == "jsonl" and not _is_json_array(path):
            with path.open("rb") as f:
                n = sum(1 for line in f if line.strip())
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            n = int(pq.ParquetFile(path).metadata.num_rows)
    except Exception:  # a count is a nicety; the real read reports real problems
        n = None
    if file.max_records:
        return min(n, file.max_records) if n is not None else file.max_records
    return n


# --- JSONL -------------------------------------------------------------------------------


def _open_error(label: str, err: OSError) -> DataError:
    return DataError(f"cannot read dataset {label}: {err.strerror or err}")


def _is_json_array(path: Path) -> bool:
    """A `.json` file that is one JSON array rather than one record per line."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _iter_jsonl(path: Path, label: str) -> Iterator[Conversation | InvalidRecord]:
    try:
        if _is_json_array(path):
            yield from _iter_json_array(path, label)
            return
        f = path.open("rb")
    except OSError as err:
        raise _open_error(label, err) from None
    with f:
        # Bytes, not text: a line that is not UTF-8 is one bad record (skippable), not a
        # decode error that kills the whole file halfway through.
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a BOM some editors write
            if not raw.strip():
                continue  # blank lines (a trailing newline, spacing) are not records
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield InvalidRecord(label, lineno, "line", f"not UTF-8 (byte {err.start}: {raw[err.start]:#04x})")
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                yield InvalidRecord(label, lineno, "line", f"malformed JSON ({err.msg} at column {err.colno})")
                continue
            yield parse_record(label, lineno, "line", record)


class _ArrayReader:
    """A JSON array file's text, read a chunk at a time as parsing needs it: `buf[pos:]` is
    what has been read and not parsed yet."""

    def __init__(self, f: BinaryIO, label: str) -> None:
        self.f, self.label = f, label
        self.text = codecs.getincrementaldecoder("utf-8-sig")()
        self.decoder = json.JSONDecoder()
        self.buf, self.pos, self.eof, self.read = "", 0, False, 0

    def more(self) -> bool:
        """Read the next chunk; False at the end of the file."""
        if self.eof:
            return False
        chunk = self.f.read(_ARRAY_CHUNK)
        self.eof = not chunk
        try:
            new = self.text.decode(chunk, final=self.eof)
        except UnicodeDecodeError as err:
            if not self.eof:
                msg = f"{self.label}: not UTF-8 (byte offset {self.read + err.start})"
                raise DataError(msg) from None
            new = ""  # cut inside a multi-byte character: the record there is cut short anyway
        self.buf = self.buf[self.pos :] + new
        self.read += len(chunk)
        self.pos = 0
        return True

    def skip_space(self) -> str:
        """The next significant character, "" at the end of the file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def item(self, i: int) -> tuple[bool, Any]:
        """Item `i`, which starts at `pos`: (True, its value), or (False, None) when the file
        ends inside it. A syntax error elsewhere is a DataError."""
        while True:
            try:
                value, self.pos = self.decoder.raw_decode(self.buf, self.pos)
                return True, value
            except json.JSONDecodeError as err:
                # A record that runs to the end of what is read is incomplete, not wrong: the
                # read may end inside a string, a literal, a number or a \uXXXX escape.
                incomplete = err.msg.startswith("Unterminated") or err.pos >= len(self.buf) - _TOKEN_TAIL
                if incomplete and self.more():
                    continue
                if incomplete:
                    return False, None
                raise DataError(f"{self.label}: item {i}: malformed JSON ({err.msg})") from None


def _iter_json_array(path: Path, label: str) -> Iterator[Conversation | InvalidRecord]:
    """The records of a file holding one JSON array, read record by record as the file is
    read (a few MiB at a time: a big dump's first records cost only what they take). A file
    cut short — the array never closes, its last record is incomplete, as in some published
    ShareGPT dumps — yields its complete records and then one InvalidRecord for the rest;
    any other syntax error leaves nothing certain to read and is a file-level DataError."""
    try:
        f = path.open("rb")
    except OSError as err:
        raise _open_error(label, err) from None
    with f:
        reader = _ArrayReader(f, label)
        if reader.skip_space() != "[":
            raise DataError(f"{label}: malformed JSON (not an array)")
        reader.pos += 1
        i = 0
        c = reader.skip_space()
        while c != "]":  # c: the first character of item i, or "" where the file ends
            complete, record = reader.item(i) if c else (False, None)
            if not complete:
                yield InvalidRecord(label, i, "item", _CUT_SHORT)
                return
            yield parse_record(label, i, "item", record)
            i += 1
            c = reader.skip_space()
            if c == ",":
                reader.pos += 1
                c = reader.skip_space()
            elif c not in ("]", ""):
                raise DataError(f"{label}: malformed JSON (expected ',' or ']' after item {i - 1})")


# --- parquet and datasets ----------------------------------------------------------------


def _need(package: str, what: str) -> DataError:
    return DataError(f"reading {what} needs the '{package}' package: pip install {package}")


def _pick_column(names: list[str], label: str) -> str:
    for c in _COLUMNS:
        if c in names:
            return c
    msg = f"{label}: no 'messages' or 'conversations' column (columns: {', '.join(names) or 'none'})"
    raise DataError(msg)


def _column_items(label: str, column: str, start: int, values: list[Any]) -> Iterator[Conversation | InvalidRecord]:
    for i, value in enumerate(values, start=start):
        yield parse_record(label, i, "row", {column: value})


def _iter_parquet(path: Path, label: str) -> Iterator[Conversation | InvalidRecord]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise _need("pyarrow", f"parquet file {label}") from None
    try:
        pf = pq.ParquetFile(path)
    except OSError as err:
        raise _open_error(label, err) from None
    except Exception as err:  # pyarrow raises ArrowInvalid for a file that is not parquet
        msg = f"{label}: not a readable parquet file ({err})"
        raise DataError(" ".join(msg.split())) from None
    column = _pick_column(list(pf.schema_arrow.names), label)
    row = 0
    # Batches keep memory flat on big files; to_pylist turns list<struct> into dicts.
    for batch in pf.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[column]):
        values = batch.column(0).to_pylist()
        yield from _column_items(label, column, row, values)
        row += len(values)


def _iter_hf_datasets(path: Path, label: str) -> Iterator[Conversation | InvalidRecord]:
    try:
        import datasets
    except ImportError:
        raise _need("datasets", f"the `datasets` folder {label}") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # FileNotFoundError or datasets' own errors for a foreign folder
        msg = f"{label}: not a folder written by datasets' save_to_disk ({type(err).__name__}: {err})"
        raise DataError(" ".join(msg.split())) from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if "train" in ds:
            ds = ds["train"]
        elif len(splits) == 1:
            ds = ds[splits[0]]
        else:
            msg = f"{label}: a DatasetDict with splits {', '.join(splits)} and no 'train'; save one split"
            raise DataError(msg)
    column = _pick_column(list(ds.column_names), label)
    ds = ds.select_columns([column])
    row = 0
    for batch in ds.iter(batch_size=_ROWS_PER_BATCH):
        values = batch[column]
        yield from _column_items(label, column, row, values)
        row += len(values)
