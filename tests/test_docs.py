"""The documents are a user's reference, so what they name must be true of the code: module
paths exist, config keys exist in the schema, every benchmark script has its section, and the
README stays short and speaks of the tool, not of how it was made. Standard library and
`dflash.config` only: no model is built."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from dflash.config import Config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
EXPERIMENTS = ROOT / "docs" / "experiments.md"
HISTORY = ROOT / "docs" / "benchmarks-history.md"
DOCS = [README, BENCHMARKS, ARCHITECTURE, EXPERIMENTS, HISTORY]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))

README_MAX_LINES = 300
BENCHMARKS_MAX_LINES = 350
# The columns every benchmark's table of current figures has (its first table).
FIGURE_COLUMNS = {"figure", "machine", "date", "commit", "command"}
# Words that belong to a diary, not a reference (whole words, any case).
DENYLIST = [r"\bsessions?\b", r"\bsittings?\b", r"\byesterday\b", r"\blead for the next\b"]

# Folders a path may start with, relative to the repository root.
_ROOTS = ("dflash/", "bench/", "tests/", "configs/", "bin/", "docs/")
# Subpackages of dflash/: a path starting with one of these is relative to dflash/.
_SUBPACKAGES = tuple(f"{p.name}/" for p in (ROOT / "dflash").iterdir() if (p / "__init__.py").exists())
_DFLASH_PATH = re.compile(r"(?<![\w./-])dflash/[\w./-]*")
_SPAN = re.compile(r"`([^`\n]+)`")
_FILE_IN_SPAN = re.compile(r"(?<![\w./-])[\w./-]+\.(?:py|sh|toml)\b")
_KEY = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+)(?:\s*=.*)?$")
_SET = re.compile(r"--set\s+'?([a-z_]+(?:\.[a-z_]+)+)=")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The text without fenced code blocks (commands and program output)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _resolve(name: str) -> Path | None:
    """Where a path named in the docs lives, or None when it is not one of ours to check."""
    name = name.rstrip(".,;:")
    if name.startswith(_ROOTS):
        return ROOT / name
    if name.startswith(_SUBPACKAGES):
        return ROOT / "dflash" / name
    return None


def _named_paths(text: str) -> set[str]:
    """Every `dflash/...` path in the text, and every file path inside a `code span`."""
    found = {m.rstrip(".,;:") for m in _DFLASH_PATH.findall(text)}
    found = {p for p in found if p.endswith((".py", "/"))}
    for span in _SPAN.findall(text):
        found.update(_FILE_IN_SPAN.findall(span))
    return found


def _exists(name: str) -> bool:
    """Whether a path named in the docs is there (True for one that is not ours to check)."""
    path = _resolve(name)
    if path is not None:
        return path.exists()
    if "/" not in name and name.endswith(".py"):  # a bare module name: ours, somewhere
        return any(next((ROOT / d).rglob(name), None) for d in ("dflash", "bench", "tests"))
    return True


def _missing_paths(doc: Path) -> list[str]:
    return [name for name in sorted(_named_paths(_text(doc))) if not _exists(name)]


def _has_key(key: str) -> bool:
    """Whether `section.key` (or a deeper `section.sub.key`) is a field of the config schema."""
    model: type[BaseModel] | None = Config
    for part in key.split("."):
        if model is None or part not in model.model_fields:
            return False
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return True


def _stage_names() -> set[str]:
    """The profiler's stage names (`target.model_forward`, ...), read from its source: they look
    like config keys (`drafter.forward`) but are not."""
    src = _text(ROOT / "dflash" / "runtime" / "profiler.py")
    return set(re.findall(r'=\s*"([a-z_]+\.[a-z_]+)"', src))


def _table_keys(text: str) -> set[str]:
    """Config keys in the first column of the text's tables."""
    keys = set()
    for line in text.splitlines():
        if line.startswith("|"):
            first = line.split("|")[1]
            for span in _SPAN.findall(first):
                m = _KEY.match(span.strip())
                if m and m.group(1).split(".")[0] in Config.model_fields:
                    keys.add(m.group(1))
    return keys


def test_module_paths_named_in_docs_exist():
    """Every module or folder path the README, BENCHMARKS, its history, the architecture map and
    the experiments name (`dflash/...`, `bench/...`, `model/loss.py`, `modeling_dflash.py`) exists, so
    a reorganisation cannot leave the map pointing at files that are gone."""
    missing = {doc.name: _missing_paths(doc) for doc in DOCS}
    assert not any(missing.values()), missing


def test_architecture_names_every_package_folder():
    """The architecture map names every folder of the package (each is one layer's concern), and
    every path it names was found: a new folder must be placed on the map."""
    named = _named_paths(_text(ARCHITECTURE))
    folders = sorted(f"dflash/{p}" for p in _SUBPACKAGES)
    assert [f for f in folders if f not in named] == []


def test_readme_config_keys_exist_in_schema():
    """Every config key in the first column of the README's tables, and every `--set KEY=` in the
    README and BENCHMARKS commands, is a field of the schema (`dflash.config.Config`): a renamed or
    moved key cannot survive in the user's reference. The README's tables name the main keys of
    every section, the optimizer, schedule and loss ones included."""
    readme = _text(README)
    table = _table_keys(readme)
    sets = set(_SET.findall(readme)) | set(_SET.findall(_text(BENCHMARKS)))
    assert len(table) >= 40, sorted(table)  # the config tables are there, written `section.key`
    sections = {k.split(".")[0] for k in table}
    assert {"train", "optimizer", "schedule", "loss", "pipeline", "eval"} <= sections, sorted(sections)
    unknown = sorted(k for k in table | sets if not _has_key(k))
    assert unknown == [], f"not in the config schema: {unknown}"


def test_readme_prose_config_keys_exist_in_schema():
    """A `section.key` in the README's prose (outside code blocks; stage names such as
    `drafter.forward` excepted) is a field of the schema too."""
    stages = _stage_names()
    assert "drafter.forward" in stages  # the stage names were read
    keys = set()
    for span in _SPAN.findall(_prose(_text(README))):
        m = _KEY.match(span.strip())
        if m and m.group(1).split(".")[0] in Config.model_fields and m.group(1) not in stages:
            keys.add(m.group(1))
    assert keys, "no config key found in the README's prose"
    unknown = sorted(k for k in keys if not _has_key(k))
    assert unknown == [], f"not in the config schema: {unknown}"


def test_readme_is_short_and_speaks_of_the_tool():
    """The README stays under 300 lines, and no document speaks of who worked on the project or
    when (no 'session', 'sitting', 'yesterday', 'a lead for the next')."""
    lines = _text(README).splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines"
    found = {
        doc.name: sorted({m.group(0) for pat in DENYLIST for m in re.finditer(pat, _text(doc), re.I)}) for doc in DOCS
    }
    assert not any(found.values()), found


def test_readme_figures_say_when_where_and_how():
    """Each measured row of the README's figures table names a date, a commit and a command to
    reproduce it; a row without a measurement says so."""
    text = _text(README)
    section = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]
    assert len(rows) >= 3
    for row in rows:
        if "not yet measured" in row:
            continue
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", row), row
        assert re.search(r"\b[0-9a-f]{7}\b", row), row
        assert re.search(r"`[^`]*(make|dflash|bench/)[^`]*`\s*\|\s*$", row), row


def test_every_benchmark_script_has_a_section():
    """BENCHMARKS.md has a section heading naming each benchmark script in bench/ (a Python file
    that runs as a script, or a shell script with a #! line: not one that scripts source), so a new
    benchmark comes with its figures."""
    headings = [line for line in _text(BENCHMARKS).splitlines() if line.startswith("## ")]
    scripts = [p for p in sorted((ROOT / "bench").glob("*.py")) if "__main__" in _text(p)]
    scripts += [p for p in sorted((ROOT / "bench").glob("*.sh")) if _text(p).startswith("#!")]
    assert scripts
    missing = [p.name for p in scripts if not any(f"`bench/{p.name}`" in h for h in headings)]
    assert missing == []


def _cells(row: str) -> list[str]:
    """A markdown table row's cells (a `\\|` inside a cell does not split it)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sections(text: str) -> dict[str, str]:
    """Each `## ` section of a document by its anchor, without its heading line."""
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    return {_slug(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def _first_table(section: str) -> tuple[list[str], list[str]]:
    """A section's first table: its header cells and its data rows (the separator left out)."""
    lines = section.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        return [], []
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    table = lines[start:end]
    return _cells(table[0]), [row for row in table[1:] if not row.startswith("|---")]


def _readme_figure_rows() -> list[list[str]]:
    """The data rows of the README's "Current figures" table, as cells."""
    section = _text(README).split("## Current figures", 1)[1].split("\n## ", 1)[0]
    _, rows = _first_table(section)
    return [_cells(row) for row in rows]


def test_benchmarks_is_current_figures_within_its_length():
    """BENCHMARKS.md holds the current figures, one table per benchmark, within 350 lines (the
    superseded runs are in docs/benchmarks-history.md, which it links); each section's first
    table names, for each row, its figure, machine, date, commit and reproduce command."""
    text = _text(BENCHMARKS)
    assert len(text.splitlines()) <= BENCHMARKS_MAX_LINES, f"BENCHMARKS.md has {len(text.splitlines())} lines"
    assert "(docs/benchmarks-history.md)" in text
    sections = _sections(text)
    assert "make-demo" in sections and "make-test" in sections, sorted(sections)
    for anchor, section in sections.items():
        header, rows = _first_table(section)
        assert rows, f"BENCHMARKS.md#{anchor} has no table"
        assert {c.lower() for c in header} >= FIGURE_COLUMNS, (anchor, header)


def test_benchmarks_history_is_newest_first():
    """The history's days run newest first, each a `## YYYY-MM-DD` heading."""
    days = re.findall(r"^## (\S+)", _text(HISTORY), flags=re.M)
    assert days and all(re.fullmatch(r"20\d\d-\d\d-\d\d", d) for d in days), days
    assert days == sorted(days, reverse=True) and len(set(days)) == len(days), days


def test_readme_figures_are_the_first_rows_of_benchmarks():
    """Each row of the README's "Current figures" links a BENCHMARKS section, and every figure
    it quotes (its figure cell, split at "; ") and every commit it names is, verbatim, in the
    first data row of that section's first table: the README quotes the newest figures."""
    sections = _sections(_text(BENCHMARKS))
    rows = _readme_figure_rows()
    assert len(rows) >= 3
    for cells in rows:
        row = " | ".join(cells)
        if "not yet measured" in row:
            continue
        link = re.search(r"\(BENCHMARKS\.md#([^)\s]+)\)", row)
        assert link, f"no link to a BENCHMARKS section: {row}"
        assert link.group(1) in sections, f"BENCHMARKS.md has no section #{link.group(1)}"
        _, data = _first_table(sections[link.group(1)])
        assert data, f"BENCHMARKS.md#{link.group(1)} has no table"
        first = data[0]
        claims = [c.strip() for c in cells[1].split("; ") if c.strip()]
        assert claims
        missing = [c for c in claims if c not in first]
        when = next(c for c in cells if "BENCHMARKS.md#" in c)  # the date and commit cell
        missing += [h for h in re.findall(r"\b[0-9a-f]{7}\b", when) if h not in first]
        assert missing == [], f"not in BENCHMARKS.md#{link.group(1)}'s first row: {missing}"


# A measured figure in a comment: a speed, a τ, a ratio, a share, or an approximate number.
_MEASURED = [
    r"tok/s",
    r"(?:τ|\btau)\s*[=:]?\s*\d",
    r"\b\d+(?:\.\d+)?[x×](?![\w-])",
    r"\d\s*%",
    r"~\s*\d",
    r"\b\d+\s*min\s+\d+\s*s\b",
]


def _comment(line: str) -> str:
    """The comment of a TOML line (after a `#` outside quotes), or ''."""
    quoted = re.sub(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'', lambda m: "_" * len(m.group(0)), line)
    at = quoted.find("#")
    return line[at:] if at >= 0 else ""


def test_config_comments_carry_no_measured_figures():
    """configs/*.toml carry settings and one-line whys: a measured figure (tok/s, τ 1.8, 2.5x,
    15 %, ~4 minutes) belongs in BENCHMARKS.md, with its date, commit, machine and command."""
    assert CONFIGS
    assert re.search("|".join(_MEASURED), "# ~2.5x the steps, τ 1.84 at 10K tok/s (15 %)")
    found = [
        f"{path.name}:{n}: {_comment(line).strip()}"
        for path in CONFIGS
        for n, line in enumerate(_text(path).splitlines(), 1)
        if any(re.search(pat, _comment(line)) for pat in _MEASURED)
    ]
    assert found == []
