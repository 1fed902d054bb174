"""The config schema: strict TOML loading, `--set` overrides, one-line ConfigErrors."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from dflash.config import Config, annotated_toml, apply_overrides, dump_toml, load_config, parse_config
from dflash.config._load import _section_type
from dflash.errors import ConfigError, DFlashError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def config_error(fn: Callable[[], Any]) -> str:
    """Call fn, require a ConfigError with a one-line message, and return that message."""
    with pytest.raises(ConfigError) as info:
        fn()
    msg = str(info.value)
    assert msg, "ConfigError with an empty message"
    assert "\n" not in msg, f"ConfigError message spans lines: {msg!r}"
    return msg


def load_text(tmp_path: Path, text: str, overrides: list[str] | None = None) -> Config:
    path = tmp_path / "cfg.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(path, overrides)


# -- loading -------------------------------------------------------------------------------


def test_defaults_load_without_a_file() -> None:
    """load_config() with no path gives the schema defaults."""
    cfg = load_config()
    assert cfg == Config()
    assert cfg.run.name == "dflash"
    assert cfg.drafter.num_layers == 1
    assert cfg.drafter.block_size == 16
    assert cfg.optimizer.lr == pytest.approx(6e-4)
    assert cfg.train.max_steps is None
    assert cfg.pipeline.target_devices == ["cpu"]
    assert cfg.profile.interval_s == 10.0


def test_toml_file_loads_and_keeps_defaults_for_unset_keys(tmp_path: Path) -> None:
    """Keys in the file are used; keys it leaves out keep their defaults."""
    cfg = load_text(
        tmp_path,
        '[run]\nname = "exp"\n[drafter]\nnum_layers = 3\n[optimizer]\nlr = 1e-3\nbetas = [0.8, 0.9]\n',
    )
    assert cfg.run.name == "exp"
    assert cfg.drafter.num_layers == 3
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.drafter.block_size == 16
    assert cfg.data.num_samples == 256


def test_repo_tiny_config_loads() -> None:
    """configs/tiny.toml is a valid config with its own values."""
    cfg = load_config(TINY)
    assert cfg.run.name == "tiny"
    assert cfg.drafter.block_size == 8
    assert cfg.train.epochs == 4
    assert cfg.profile.interval_s == 2.0
    assert cfg.run_dir == Path("runs") / "tiny"


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    """An empty TOML file is valid and equals the defaults."""
    assert load_text(tmp_path, "") == Config()


def test_config_error_is_a_usage_error() -> None:
    """ConfigError is a DFlashError whose exit code is 2 (as for usage errors)."""
    assert issubclass(ConfigError, DFlashError)
    assert ConfigError.exit_code == 2


# -- unknown keys --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path", "allowed"),
    [
        ("bogus = 1\n", "bogus", ["checkpoint", "data", "drafter", "loss", "optimizer", "schedule", "train"]),
        ("[drafter]\nbogus = 1\n", "drafter.bogus", ["block_size", "num_layers", "layer_types"]),
        ("[target.tiny]\nbogus = 1\n", "target.tiny.bogus", ["hidden_size", "vocab_size"]),
        ("[nosuch]\nx = 1\n", "nosuch", ["drafter", "train"]),
    ],
)
def test_unknown_key_names_path_and_allowed_keys(tmp_path: Path, text: str, path: str, allowed: list[str]) -> None:
    """An unknown key, top level or nested, is an error naming its path and the allowed keys."""
    msg = config_error(lambda: load_text(tmp_path, text))
    assert f"{path}: unknown key" in msg
    assert "allowed:" in msg
    for key in allowed:
        assert key in msg.split("allowed:", 1)[1]
    assert str(tmp_path / "cfg.toml") in msg


def test_unknown_nested_key_lists_only_that_sections_keys(tmp_path: Path) -> None:
    """The allowed list for [drafter] names drafter keys, not top-level sections."""
    msg = config_error(lambda: load_text(tmp_path, "[drafter]\nbogus = 1\n"))
    allowed = msg.split("allowed:", 1)[1]
    assert "num_layers" in allowed
    assert "pipeline" not in allowed


# -- types and ranges ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ('[drafter]\nnum_layers = "two"\n', "drafter.num_layers"),
        ("[drafter]\nnum_layers = 1.5\n", "drafter.num_layers"),
        ("[drafter]\nnum_layers = true\n", "drafter.num_layers"),
        ('[optimizer]\nlr = "1e-3"\n', "optimizer.lr"),
        ("[data]\nshuffle = 1\n", "data.shuffle"),
        ("[run]\nname = 2\n", "run.name"),
        ('[drafter]\nlayer_types = ["dense"]\n', "drafter.layer_types[0]"),
        ("drafter = 3\n", "drafter"),
    ],
)
def test_wrong_type_is_an_error_naming_the_key(tmp_path: Path, text: str, path: str) -> None:
    """A value of the wrong type is never coerced: ConfigError naming the key path."""
    msg = config_error(lambda: load_text(tmp_path, text))
    assert f"{path}:" in msg


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("[drafter]\nnum_layers = 0\n", "drafter.num_layers"),
        ("[optimizer]\nlr = -1\n", "optimizer.lr"),
        ("[optimizer]\nlr = 0\n", "optimizer.lr"),
        ("[data]\nbatch_size = 0\n", "data.batch_size"),
        ("[profile]\ninterval_s = 0\n", "profile.interval_s"),
        ("[optimizer]\nbetas = [0.9, 1.0]\n", "optimizer.betas"),
        ("[loss]\nchunk = 0\n", "loss.chunk"),
        ("[schedule]\nwarmup_ratio = 1.0\n", "schedule.warmup_ratio"),
        ("[target]\nlayer_ids = [1, 1]\n", "target.layer_ids"),
        ("[target]\nlayer_ids = []\n", "target.layer_ids"),
    ],
)
def test_out_of_range_value_is_an_error_naming_the_key(tmp_path: Path, text: str, path: str) -> None:
    """A value outside its allowed range is a ConfigError naming the key path."""
    msg = config_error(lambda: load_text(tmp_path, text))
    assert f"{path}:" in msg


def test_out_of_range_error_shows_the_bad_value(tmp_path: Path) -> None:
    """The message quotes the offending value so the user can find it."""
    msg = config_error(lambda: load_text(tmp_path, "[optimizer]\nlr = -1\n"))
    assert "(got -1)" in msg


def test_int_is_accepted_for_a_float_key(tmp_path: Path) -> None:
    """Strict mode still accepts an integer where a float is expected (lr = 1)."""
    cfg = load_text(tmp_path, "[optimizer]\nlr = 1\n[profile]\ninterval_s = 3\n")
    assert cfg.optimizer.lr == 1.0
    assert cfg.profile.interval_s == 3.0


# -- cross-field checks --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            "[pipeline]\nhs_queue_depth = 2\nhs_min_ready = 3\n",
            ["pipeline", "hs_min_ready", "hs_queue_depth"],
        ),
        (
            '[drafter]\nnum_layers = 2\nlayer_types = ["full_attention"]\n',
            ["drafter", "layer_types", "num_layers"],
        ),
        ('[target]\nkind = "hf"\n', ["target", "path"]),
        ('[pipeline]\ntarget_devices = ["gpu"]\n', ["pipeline.target_devices", "'gpu'"]),
        ('[pipeline]\ndrafter_devices = ["cuda:x"]\n', ["pipeline.drafter_devices", "'cuda:x'"]),
        ("[target.tiny]\nnum_heads = 3\nnum_kv_heads = 2\n", ["target.tiny", "num_kv_heads"]),
        ("[loss]\ngreedy_prefix_only = true\n", ["loss.greedy_prefix_only needs loss.labels = 'target'"]),
        ('[loss]\nvocab = "data"\ndistill = 0.5\n', ["loss.vocab = 'data' with loss.distill > 0"]),
        ('[schedule]\nkind = "wsd"\nwarmup_ratio = 0.5\ndecay_ratio = 0.6\n', ["schedule.warmup_ratio + schedule"]),
    ],
)
def test_cross_field_check_fails_with_named_keys(tmp_path: Path, text: str, fragments: list[str]) -> None:
    """Checks spanning several keys are ConfigErrors that name the section and keys."""
    msg = config_error(lambda: load_text(tmp_path, text))
    for fragment in fragments:
        assert fragment in msg


def test_cross_field_valid_combinations_load(tmp_path: Path) -> None:
    """The same keys in consistent combinations are accepted."""
    cfg = load_text(
        tmp_path,
        "[pipeline]\nhs_queue_depth = 3\nhs_min_ready = 3\n"
        'target_devices = ["cuda", "cuda:1"]\ndrafter_devices = ["cpu"]\n'
        '[drafter]\nnum_layers = 2\nlayer_types = ["full_attention", "sliding_attention"]\n'
        '[target]\nkind = "hf"\npath = "/models/x"\n',
    )
    assert cfg.pipeline.hs_min_ready == 3
    assert cfg.pipeline.target_devices == ["cuda", "cuda:1"]
    assert cfg.drafter.resolved_layer_types == ["full_attention", "sliding_attention"]
    assert cfg.target.path == "/models/x"


# -- keys that moved out of [train] ---------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("train.lr", "optimizer.lr"),
        ("train.betas", "optimizer.betas"),
        ("train.schedule", "schedule.kind"),
        ("train.warmup_ratio", "schedule.warmup_ratio"),
        ("train.loss_chunk", "loss.chunk"),
        ("train.loss_vocab", "loss.vocab"),
        ("train.loss_negatives", "loss.negatives"),
        ("train.labels", "loss.labels"),
        ("train.noise_reveal_end", "loss.noise_reveal_end"),
    ],
)
def test_a_moved_key_names_its_new_place(tmp_path: Path, old: str, new: str) -> None:
    """An old [train] key, in a file or a --set, is a one-line error naming where it went."""
    section, key = old.split(".")
    msg = config_error(lambda: load_text(tmp_path, f"[{section}]\n{key} = 1\n"))
    assert f"{old}: moved to {new}" in msg
    msg = config_error(lambda: load_config(TINY, [f"{old}=1"]))
    assert msg == f"--set {old}: moved to {new}"


def test_every_moved_key_exists_at_its_new_place() -> None:
    """The table of moved keys points only at keys the schema has, and no old key is still
    a [train] key."""
    from dflash.config._schema import MOVED

    for old, new in MOVED.items():
        section, key = new.split(".")
        assert key in Config.model_fields[section].annotation.model_fields, new  # type: ignore[union-attr]
        assert old.split(".")[1] not in Config.model_fields["train"].annotation.model_fields, old  # type: ignore[union-attr]


def test_an_old_config_is_mapped_to_the_new_layout() -> None:
    """A config written before the keys moved (a checkpoint's) reads as today's: each value
    at its new key, the rest untouched."""
    from dflash.config import moved_keys_mapped

    old = {"train": {"lr": 1e-3, "epochs": 2, "loss_vocab": "data", "schedule": "wsd"}, "run": {"seed": 3}}
    new = moved_keys_mapped(old)
    assert new == {
        "train": {"epochs": 2},
        "optimizer": {"lr": 1e-3},
        "loss": {"vocab": "data"},
        "schedule": {"kind": "wsd"},
        "run": {"seed": 3},
    }
    assert old["train"]["lr"] == 1e-3  # the input is left as it was
    assert parse_config(new).optimizer.lr == 1e-3


def test_a_checkpoint_written_with_the_old_keys_loads_in_the_new_layout(tmp_path: Path) -> None:
    """`load_checkpoint` maps an older checkpoint's config.toml (train.lr, ...) over."""
    import torch

    from dflash.train.checkpoint import Snapshot, load_checkpoint, write_checkpoint

    toml = "[run]\nseed = 0\n[train]\nepochs = 2\nlr = 0.001\nloss_chunk = 64\n"
    snap = Snapshot(1, {"w": torch.zeros(2)}, {"state.0.step": torch.zeros(())}, {
        "step": 1, "cursor": None, "scheduler": {}, "param_groups": [],
    }, toml)  # fmt: skip
    loaded = load_checkpoint(write_checkpoint(snap, tmp_path, keep_last=1))
    assert loaded.config["optimizer"] == {"lr": 0.001} and loaded.config["loss"] == {"chunk": 64}
    assert loaded.config["train"] == {"epochs": 2}


def test_loss_spec_carries_every_loss_setting() -> None:
    """`LossSpec.from_config`: the [loss] section whole, with the drafter's block size and γ."""
    from dflash.model.loss import LossSpec

    cfg = load_config(TINY, ['loss.position_weights="dpace"', "loss.chunk=64", 'loss.labels="target"',
                             "loss.distill=0.5", "drafter.gamma=3.0"])  # fmt: skip
    spec = LossSpec.from_config(cfg)
    assert (spec.block_size, spec.gamma, spec.chunk, spec.dpace, spec.target_labels) == (8, 3.0, 64, True, True)
    assert spec.teacher_topk == cfg.loss.distill_topk
    assert LossSpec.from_config(load_config(TINY)).teacher_topk == 0
    assert LossSpec.from_config(load_config(TINY, ['loss.labels="target"'])).teacher_topk == 1
    defaults = LossSpec(block_size=16)
    assert LossSpec.from_config(Config()) == defaults  # its defaults are the config's


# -- overrides -----------------------------------------------------------------------------


def test_override_replaces_file_value() -> None:
    """load_config(path, ["drafter.num_layers=2"]) wins over the file; other keys stay."""
    cfg = load_config(TINY, ["drafter.num_layers=2"])
    assert cfg.drafter.num_layers == 2
    assert cfg.drafter.block_size == 8
    assert load_config(TINY).drafter.num_layers == 1


def test_overrides_apply_without_a_file() -> None:
    """Overrides work on the defaults too, creating the section as needed."""
    cfg = load_config(None, ["drafter.num_layers=2", "target.tiny.hidden_size=32"])
    assert cfg.drafter.num_layers == 2
    assert cfg.target.tiny.hidden_size == 32


def test_apply_overrides_sets_nested_keys_in_the_raw_dict() -> None:
    """apply_overrides writes parsed values into the nested dict, keeping other entries."""
    data: dict[str, Any] = {"drafter": {"block_size": 8}}
    out = apply_overrides(data, ["drafter.num_layers=2", "optimizer.lr=1e-3"])
    assert out == {"drafter": {"block_size": 8, "num_layers": 2}, "optimizer": {"lr": 1e-3}}


def test_later_override_wins() -> None:
    """When a key is set twice, the last --set wins."""
    cfg = load_config(None, ["drafter.num_layers=2", "drafter.num_layers=3"])
    assert cfg.drafter.num_layers == 3


@pytest.mark.parametrize(
    ("override", "get", "expected"),
    [
        ("optimizer.lr=1e-3", lambda c: c.optimizer.lr, 1e-3),
        ("data.shuffle=false", lambda c: c.data.shuffle, False),
        ("checkpoint.export_final=true", lambda c: c.checkpoint.export_final, True),
        ('pipeline.target_devices=["cpu","cpu"]', lambda c: c.pipeline.target_devices, ["cpu", "cpu"]),
        ("optimizer.betas=[0.8, 0.99]", lambda c: c.optimizer.betas, (0.8, 0.99)),
        ('loss.vocab="data"', lambda c: c.loss.vocab, "data"),
        ("run.name=bare", lambda c: c.run.name, "bare"),
        ('run.name="12"', lambda c: c.run.name, "12"),
        ("train.max_steps=20", lambda c: c.train.max_steps, 20),
        (" drafter.num_layers = 2 ", lambda c: c.drafter.num_layers, 2),
    ],
)
def test_override_values_are_toml_literals(override: str, get: Callable[[Config], Any], expected: Any) -> None:
    """--set values parse as TOML (floats, bools, arrays, quoted strings); bare words are strings."""
    value = get(load_config(None, [override]))
    assert value == expected
    assert type(value) is type(expected)


def test_override_value_is_validated() -> None:
    """An override with a bad value fails like the same value in a file."""
    msg = config_error(lambda: load_config(TINY, ["drafter.num_layers=0"]))
    assert "drafter.num_layers:" in msg
    msg = config_error(lambda: load_config(None, ["run.name=2"]))
    assert "run.name:" in msg


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("drafter.nope=1", ["drafter.nope", "'nope'", "num_layers", "block_size"]),
        ("nope.x=1", ["nope.x", "'nope'", "top level", "drafter", "train"]),
        ("target.tiny.nope=1", ["target.tiny.nope", "'nope'", "vocab_size"]),
    ],
)
def test_override_unknown_path_is_rejected(override: str, fragments: list[str]) -> None:
    """--set on a key the schema lacks fails, naming the key and the allowed keys."""
    msg = config_error(lambda: load_config(None, [override]))
    assert "allowed:" in msg
    for fragment in fragments:
        assert fragment in msg


def test_override_cannot_set_a_section() -> None:
    """--set drafter=1 is rejected: a section cannot be replaced by a value."""
    msg = config_error(lambda: load_config(None, ["drafter=1"]))
    assert "drafter" in msg
    assert "section" in msg


def test_override_cannot_descend_into_a_scalar() -> None:
    """--set drafter.num_layers.x=1 is rejected: num_layers is not a section."""
    msg = config_error(lambda: load_config(None, ["drafter.num_layers.x=1"]))
    assert "drafter.num_layers" in msg
    assert "not a section" in msg


def test_override_into_a_non_table_in_the_file(tmp_path: Path) -> None:
    """--set under a key the file set to a scalar is a ConfigError, not a crash."""
    msg = config_error(lambda: load_text(tmp_path, "drafter = 3\n", ["drafter.num_layers=1"]))
    assert "drafter" in msg


@pytest.mark.parametrize("override", ["drafter.num_layers", "=2", "", "   =2"])
def test_malformed_override_is_rejected(override: str) -> None:
    """A --set without KEY=VALUE shape is a ConfigError that shows the expected shape."""
    msg = config_error(lambda: load_config(None, [override]))
    assert "KEY=VALUE" in msg


# -- dump ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "target.layer_ids=[1, 2]",
            "drafter.gamma=2.5",
            "drafter.layer_types=['sliding_attention']",
            "drafter.mask_token_id=7",
            "train.max_steps=5",
            "target.kind='hf'",
            "target.path='/models/x'",
            "pipeline.target_devices=['cuda:0', 'cuda:1']",
        ],
    ],
)
def test_dump_toml_round_trips(overrides: list[str]) -> None:
    """load -> dump_toml -> tomllib -> parse gives an equal Config."""
    cfg = load_config(TINY, overrides)
    again = parse_config(tomllib.loads(dump_toml(cfg)))
    assert again == cfg


def test_dump_toml_round_trips_through_a_file(tmp_path: Path) -> None:
    """A dumped config, written to a file, loads back equal (what each run folder keeps)."""
    cfg = load_config(None, ["drafter.num_layers=2", "optimizer.lr=1e-3"])
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(cfg), encoding="utf-8")
    assert load_config(path) == cfg


def test_dump_toml_fills_defaults_and_omits_none() -> None:
    """The dump lists every section with defaults filled in; unset (None) keys are left out."""
    data = tomllib.loads(dump_toml(load_config(TINY)))
    assert set(data) == set(Config.model_fields)
    assert data["optimizer"]["grad_clip"] == 1.0
    assert data["drafter"]["num_layers"] == 1
    assert "max_steps" not in data["train"]
    assert "gamma" not in data["drafter"]


def _sections(model: type[BaseModel], path: str = "") -> dict[str, dict[str, Any]]:
    """Every table of the schema ('data.files' for a list of sections) and its keys' fields."""
    out: dict[str, dict[str, Any]] = {path: {}} if path else {}
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None:
            out.update(_sections(sub, f"{path}.{name}" if path else name))
        else:
            out[path][name] = field
    return out


_HEADER = re.compile(r"^(?:# )?\[\[?([a-z0-9_.]+)\]\]?$")
_KEY_LINE = re.compile(r"^(# )?([a-z_]+) =( .+)?$")


def _shown_keys(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """table -> key -> (its comment line, its key line), read from annotated_toml's output, whose
    tables list their keys as pairs of lines: the comment, then the key (commented out when unset)."""
    shown: dict[str, dict[str, tuple[str, str]]] = {}
    table = None
    lines = [ln for ln in text.splitlines()[1:] if ln]
    i = 0
    while i < len(lines):
        header = _HEADER.match(lines[i + 1]) if i + 1 < len(lines) else None
        if header:  # a table: its comment, then its header
            table = header.group(1)
            shown.setdefault(table, {})
            i += 2
            continue
        key = _KEY_LINE.match(lines[i + 1])
        assert table is not None and lines[i].startswith("# ") and key, lines[i : i + 2]
        shown[table][key.group(2)] = (lines[i], lines[i + 1])
        i += 2
    return shown


def test_every_schema_key_has_a_one_line_description() -> None:
    """config show gives every key a meaning: each field of the schema has a one-line description."""
    for table, fields in _sections(Config).items():
        for name, field in {**fields, **Config.model_fields}.items():
            assert field.description and "\n" not in field.description, f"{table}.{name}"


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["drafter.num_layers=3", "train.max_steps=7", "target.layer_ids=[1, 2]", "drafter.gamma=2.5"],
        [
            "data.source='files'",
            "data.files=[{path = 'a.jsonl', weight = 2.0}, {path = 'b.parquet', max_records = 5}]",
            "data.chat_template_kwargs={enable_thinking = false, \"odd key\" = 'x'}",
            "target.kind='hf'",
            "target.path='/models/x \"q\"'",
            "pipeline.target_devices=['cuda:0', 'cuda:1']",
        ],
    ],
)
def test_annotated_toml_shows_every_key_with_default_and_meaning_and_reads_back(
    overrides: list[str], tmp_path: Path
) -> None:
    """Every key of the schema, in its table, under a comment with its meaning and default; a
    key left unset is commented out; the text loads back as the same config."""
    cfg = load_config(TINY, overrides)
    text = annotated_toml(cfg)
    path = tmp_path / "shown.toml"
    path.write_text(text, encoding="utf-8")
    assert load_config(path) == cfg
    shown = _shown_keys(text)
    sections = _sections(Config)
    assert set(shown) == set(sections)
    values = cfg.model_dump(mode="json")
    for table, fields in sections.items():
        assert set(shown[table]) == set(fields), table
        node = values
        for part in table.split("."):
            node = node[part]
        for name, field in fields.items():
            comment, line = shown[table][name]
            assert comment.startswith(f"# {field.description} (default: "), comment
            if isinstance(node, dict):  # a list of sections shows one of them only
                assert (line == f"# {name} =") == (node[name] is None), (table, line)


def test_annotated_toml_shows_overrides_and_the_defaults_beside_them() -> None:
    """A value changed by --set shows as set, the schema default in its comment; unset keys commented out."""
    text = annotated_toml(load_config(TINY, ["drafter.num_layers=3", "train.max_steps=7"]))
    drafter = _shown_keys(text)["drafter"]
    assert drafter["num_layers"] == ("# draft decoder layers (default: 1)", "num_layers = 3")
    assert drafter["gamma"][1] == "# gamma ="
    assert _shown_keys(text)["train"]["max_steps"][1] == "max_steps = 7"
    assert "# [[data.files]]" in text.splitlines()  # no files: the table commented out, with its keys


# -- file errors ---------------------------------------------------------------------------


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    """A path that does not exist gives a one-line ConfigError naming the file."""
    path = tmp_path / "missing.toml"
    msg = config_error(lambda: load_config(path))
    assert str(path) in msg
    assert "not found" in msg


def test_folder_path_is_a_config_error(tmp_path: Path) -> None:
    """A folder given as the config gives a one-line ConfigError naming it."""
    msg = config_error(lambda: load_config(tmp_path))
    assert str(tmp_path) in msg
    assert "folder" in msg


@pytest.mark.parametrize("text", ["[drafter\nnum_layers = 1\n", "a = \n", "x = 1\nx = 2\n"])
def test_invalid_toml_is_a_config_error(tmp_path: Path, text: str) -> None:
    """A file that is not valid TOML gives a one-line ConfigError naming the file."""
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    msg = config_error(lambda: load_config(path))
    assert str(path) in msg
    assert "TOML" in msg


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    """A file with bytes that are not UTF-8 gives a one-line ConfigError naming the file."""
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[run]\nname = "caf\xe9"\n')
    msg = config_error(lambda: load_config(path))
    assert str(path) in msg
    assert "UTF-8" in msg


def test_validation_errors_name_the_source_file(tmp_path: Path) -> None:
    """Schema errors from a file start with that file's path; from --set, say so."""
    msg = config_error(lambda: load_text(tmp_path, "[drafter]\nnum_layers = 0\n"))
    assert msg.startswith(str(tmp_path / "cfg.toml"))
    msg = config_error(lambda: load_config(None, ["drafter.num_layers=0"]))
    assert "--set" in msg


def test_several_errors_are_reported_on_one_line(tmp_path: Path) -> None:
    """Every invalid key is named, joined on a single line."""
    msg = config_error(lambda: load_text(tmp_path, "[drafter]\nnum_layers = 0\nbogus = 1\n[optimizer]\nlr = -1\n"))
    assert "drafter.num_layers" in msg
    assert "drafter.bogus" in msg
    assert "optimizer.lr" in msg


def test_lr_schedules_cosine_and_warmup_stable_decay():
    """`schedule.kind`: cosine decays from the end of warmup; wsd holds the peak, then decays
    linearly to min_lr_ratio over the last decay_ratio of the steps."""
    from dflash.train.schedule import lr_lambda

    cos = lr_lambda(100, 0.1, 0.1, "cosine")
    wsd = lr_lambda(100, 0.1, 0.1, "wsd", 0.2)
    assert cos(0) == wsd(0) == 0.1 and cos(9) == wsd(9) == 1.0  # the same warmup
    assert cos(50) < 0.8 and wsd(50) == 1.0 and wsd(80) == 1.0  # stable until the decay starts
    assert abs(wsd(90) - 0.55) < 1e-9 and wsd(100) == wsd(200) == 0.1  # linear, then the floor
    assert abs(cos(100) - 0.1) < 1e-9
    # With a clock (train.max_minutes), the schedule is at whichever is further along
    frac = [0.0]
    timed = lr_lambda(100, 0.1, 0.1, "cosine", clock=lambda: frac[0])
    assert timed(0) == cos(0) and timed(50) == cos(50)  # the clock behind the steps: the steps lead
    frac[0] = 0.5
    assert timed(3) == cos(50) and timed(70) == cos(70)  # the clock ahead: it leads
    frac[0] = 0.095  # inside the warm-up at 9.5 "steps": capped at the peak
    assert timed(0) == 1.0
    frac[0] = 1.0
    assert abs(timed(10) - 0.1) < 1e-9  # the budget spent: the floor
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["schedule.kind='wsd'", "schedule.decay_ratio=0.3"])
    assert (cfg.schedule.kind, cfg.schedule.decay_ratio) == ("wsd", 0.3)
    with pytest.raises(ConfigError, match=r"schedule\.kind"):
        load_config(ROOT / "configs" / "tiny.toml", ["schedule.kind='linear'"])
    msg = config_error(lambda: load_config(TINY, ["schedule.kind='wsd'", "schedule.decay_ratio=0.99"]))
    assert "schedule.warmup_ratio + schedule.decay_ratio" in msg and "no stable phase" in msg
