"""The package's layout is its architecture: each folder is one concern, and imports run one
way only. A module may import its own layer and any layer below it, never one above:

    top        dflash (the public face), cli, report, plan, regen (the command and its repliers)
    pipeline   the asyncio coordinator, topology, runner and the serial loop
    stages     one module per stage of the pipeline (prefetch … optimizer)
    train      building a run, the step's math, replicas, schedule, hooks, checkpoints
    eval       speculative decoding, tallies, prompt sets
    targets    a target whose layers run in a live vLLM engine or a remote `serve-target`
    serving    an export decoded in vLLM and llama.cpp (and llama.cpp's build, GGUF targets)
    features   the feature cache, regen's feature files, features from vLLM
    engines    what every use of vLLM shares: found, opened, sized, shut down
    data       samples, formats, tokenizing, batching, prompt sets' files
    model      target, drafter, masks, loss, export
    roofline   FLOPs per stage from models' shapes, devices' peaks
    runtime    devices and their syncs, processes, profiler, faults, channels, messages
    base       config, errors, logs, store (atomic writes, package files)

So the step's math (`train`) never imports the pipeline that drives it, and nothing but the
top imports the pipeline; nothing in the package but the pipeline imports a stage.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash"

# top to bottom; a layer is a set of module-path prefixes
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("top", ("dflash", "dflash.__main__", "dflash.cli", "dflash.report", "dflash.report_html", "dflash.plan",
             "dflash.regen")),
    ("pipeline", ("dflash.pipeline",)),
    ("stages", ("dflash.stages",)),
    ("train", ("dflash.train",)),
    ("eval", ("dflash.eval",)),
    ("targets", ("dflash.targets",)),
    ("serving", ("dflash.serving",)),
    ("features", ("dflash.features",)),
    ("engines", ("dflash.engines",)),
    ("data", ("dflash.data",)),
    ("model", ("dflash.model",)),
    ("roofline", ("dflash.roofline",)),
    ("runtime", ("dflash.runtime",)),
    ("base", ("dflash.config", "dflash.errors", "dflash.logs", "dflash.store", "dflash.trackers")),
]


def layer_of(module: str) -> int:
    """Index into LAYERS (0 = top) of a dflash module: its longest matching prefix (the
    package itself, `dflash`, matches only itself: a new module is not top by default)."""
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            inside = module.startswith(p + ".") and p != "dflash"
            if (module == p or inside) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module}: in no layer of tests/test_layers.py (add it to one)"
    return rank


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def dflash_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every dflash import in a file, at any depth (lazy ones too)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "dflash"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = ".".join(package[: len(package) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "dflash":
                continue
            if mod == "dflash":  # `from dflash import X`: X may be a module (dflash.cli) or a name
                out += [(node.lineno, f"dflash.{a.name}") if (PACKAGE / f"{a.name}.py").exists() or
                        (PACKAGE / a.name).is_dir() else (node.lineno, "dflash") for a in node.names]  # fmt: skip
            else:
                out.append((node.lineno, mod))
    return out


def upward_imports(root: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        me = layer_of(module_name(path))
        for line, mod in dflash_imports(path):
            them = layer_of(mod)
            if them < me:
                rel = path.relative_to(ROOT)
                bad.append(f"{rel}:{line}: {LAYERS[me][0]} imports {mod} ({LAYERS[them][0]}, a layer above)")
    return bad


def test_imports_run_downward_only():
    """No module imports a layer above its own (lazy imports included)."""
    assert upward_imports() == []


def test_every_module_has_a_layer():
    """A new top-level module or folder must be placed in a layer, or this test's map is stale."""
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("dflash.brand_new_module")


def test_a_planted_upward_import_is_caught(tmp_path, monkeypatch):
    """The check can fail: the step's math importing the pipeline is reported, with its line."""
    train = tmp_path / "dflash" / "train"
    train.mkdir(parents=True)
    (train / "planted.py").write_text("def f():\n    from dflash.pipeline import topology\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = upward_imports(tmp_path / "dflash")
    assert bad == ["dflash/train/planted.py:2: train imports dflash.pipeline (pipeline, a layer above)"]


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the dflash modules it imports, at any depth: at load, inside functions, under
    `if TYPE_CHECKING`. A lazy import cannot fail at load time, but it is still a dependency: a
    pair of modules each needing the other is one concern split in two, or two tangled."""
    graph: dict[str, set[str]] = {}
    modules = {module_name(p) for p in root.rglob("*.py")}
    for path in root.rglob("*.py"):
        me, deps = module_name(path), set()
        package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                mod = ".".join(x for x in (base, node.module or "") if x)
                deps.add(mod)
                deps |= {f"{mod}.{a.name}" for a in node.names}
        graph[me] = {d for d in deps if d in modules} - {me}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, found by depth-first search (each reported once, from its first module)."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append([*path[path.index(node) :], node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_no_circular_import(tmp_path, monkeypatch):
    """No module needs a module that needs it back, lazy imports included; and the check sees
    a planted cycle that only a lazy import closes."""
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    planted = tmp_path / "dflash"
    (planted / "pkg").mkdir(parents=True)
    (planted / "pkg" / "__init__.py").write_text("")
    (planted / "pkg" / "face.py").write_text("def pick():\n    from dflash.pkg import one\n")
    (planted / "pkg" / "one.py").write_text("from .face import pick\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = cycles(import_graph(planted))
    assert found == [["dflash.pkg.face", "dflash.pkg.one", "dflash.pkg.face"]], found


MAX_FUNCTION_LINES = 60


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function or method longer than `limit` lines, from its `def` to its last line."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.name} is {n} lines")
    return out


def test_no_function_over_sixty_lines(tmp_path):
    """A function reads in one go: none in dflash/ is longer than 60 lines (split it by what it
    does); and the check finds a planted long one."""
    assert long_functions() == []
    planted = tmp_path / "dflash"
    planted.mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(60))
    (planted / "long.py").write_text(f"class A:\n    def f(self):\n{body}")
    assert long_functions(planted) == ["dflash/long.py:2: f is 61 lines"]


# The pipeline's stages (dflash/stages/__init__.py), one module each.
PIPELINE_STAGES = {"prefetch", "feature_read", "target_forward", "pack", "transfer", "drafter_step", "optimizer"}


def test_the_pipeline_stages_live_in_dflash_stages():
    """`dflash/stages/` holds one module per stage of the pipeline, and nothing else but
    their shared links."""
    modules = {p.stem for p in (PACKAGE / "stages").glob("*.py")} - {"__init__", "_link"}
    assert modules == PIPELINE_STAGES


def stage_importers(root: Path = PACKAGE) -> list[str]:
    """Every import of a stage by a package module outside `dflash/pipeline/` and
    `dflash/stages/` (tests and bench/ drive the stages directly and are not scanned)."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path)
        if me.startswith(("dflash.pipeline", "dflash.stages")):
            continue
        for line, mod in dflash_imports(path):
            if mod == "dflash.stages" or mod.startswith("dflash.stages."):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {me} imports {mod}")
    return bad


def test_only_the_pipeline_imports_the_stages(tmp_path, monkeypatch):
    assert stage_importers() == []
    top = tmp_path / "dflash"
    top.mkdir()
    (top / "regen.py").write_text("from dflash.stages import target_forward\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert stage_importers(top) == ["dflash/regen.py:1: dflash.regen imports dflash.stages"]
