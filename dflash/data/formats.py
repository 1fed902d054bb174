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

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from dflash.config import DataFile
from dflash.data.conversation import ROLE_ALIASES, Conversation, InvalidRecord, Message, normalize_record, parse_record
from dflash.errors import DataError

__all__ = [
    "ROLE_ALIASES",
    "Conversation",
    "InvalidRecord",
    "Message",
    "count_records",
    "iter_records",
    "normalize_record",
    "resolve_format",
]

Format = Literal["jsonl", "parquet", "hf_datasets"]

_COLUMNS = ("messages", "conversations")
_ROWS_PER_BATCH = 1024


def resolve_format(file: DataFile) -> tuple[Path, Format]:
    """The file's path (``~`` expanded, relative to the working directory) and its format;
    a missing path or one whose format cannot be told is a DataError."""
    path = Path(file.path).expanduser()
    if not path.exists():
        msg = f"dataset not found: {file.path}"
        raise DataError(msg)
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
        yield from _iter_jsonl(path, file.path)
    elif fmt == "parquet":
        yield from _iter_parquet(path, file.path)
    else:
        yield from _iter_hf_datasets(path, file.path)


def count_records(file: DataFile) -> int | None:
    """How many records `iter_records` will yield, where that is cheap to know (for a
    progress bar's total); None otherwise."""
    path, fmt = resolve_format(file)
    try:
        if fmt == "jsonl":
            if _is_json_array(path):
                return None
            with path.open("rb") as f:
                return sum(1 for line in f if line.strip())
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
    except Exception:  # a count is a nicety; the real read reports real problems
        return None
    return None


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


def _iter_json_array(path: Path, label: str) -> Iterator[Conversation | InvalidRecord]:
    # One document: any syntax error leaves nothing to read, so it is a file-level error.
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        msg = f"{label}: not UTF-8 (byte offset {err.start})"
        raise DataError(msg) from None
    except json.JSONDecodeError as err:
        msg = f"{label}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno})"
        raise DataError(msg) from None
    for i, record in enumerate(data):
        yield parse_record(label, i, "item", record)


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
