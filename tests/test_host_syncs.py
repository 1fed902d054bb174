"""No unnamed host sync on the hot path: a read of the hot-path modules' source.

A host sync (the host waiting for a device) hides in ordinary-looking calls: `.item()`,
`.tolist()`, `.cpu()`, `.numpy()`, `bool()` / `int()` / `float()` of a tensor, an event's
or the device's `synchronize()`, a `.to(device)` or `.cuda()` (even `non_blocking`: from
pageable memory the copy is staged and may wait). On the hot path every intended one goes
through `dflash.runtime.devices.host_sync` (or `Device.synchronize` for an event) inside a span
named for it, and host tensors go up through `devices.upload` (pinned); any other such
call must say on its line why it is no sync (`# no-sync: <why>`, e.g. a host tensor; on a
`def` line it covers a load-time function) or that it is a named one (`# sync: <stage>`).
A new sync of these forms therefore cannot slip in unnoticed; syncs hidden inside torch
ops (`nonzero`, boolean indexing, `if tensor:`) are beyond a source read: that is what
`set_sync_debug_mode` on a GPU is for.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

HOT = [
    *sorted((ROOT / "dflash" / "stages").glob("*.py")),
    *sorted(p for p in (ROOT / "dflash" / "model").glob("*.py") if not p.name.startswith("export")),  # exports: off it
    ROOT / "dflash" / "runtime" / "devices.py",
    ROOT / "dflash" / "runtime" / "profiler.py",
    ROOT / "dflash" / "roofline" / "flops.py",
    ROOT / "dflash" / "train" / "hooks.py",
    ROOT / "dflash" / "train" / "step.py",
    ROOT / "dflash" / "train" / "reduce.py",
    ROOT / "dflash" / "pipeline" / "serial.py",
]
_READS = {"item", "tolist", "cpu", "numpy", "synchronize"}


def _mentions_device(node: ast.AST) -> bool:
    for n in ast.walk(node):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if "dev" in name.lower() or (isinstance(n, ast.Constant) and n.value in ("cpu", "cuda")):
            return True
    return False


def suspects(source: str) -> list[tuple[int, str]]:
    """(line, what) of every call that may make the host wait for a device."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and f.attr in _READS:
            found.append((n.lineno, f".{f.attr}()"))
        elif isinstance(f, ast.Name) and f.id in ("bool", "int", "float") and n.args:
            if not isinstance(n.args[0], ast.Constant):
                found.append((n.lineno, f"{f.id}()"))
        elif isinstance(f, ast.Attribute) and f.attr == "cuda":
            found.append((n.lineno, ".cuda()"))
        elif (
            isinstance(f, ast.Attribute)
            and f.attr == "to"  # even non_blocking: from pageable host memory the copy is staged and may wait
            and (any(_mentions_device(a) for a in n.args) or any(k.arg == "device" for k in n.keywords))
        ):
            found.append((n.lineno, ".to(device) (host tensors go up through devices.upload)"))
    return found


def _exempt_functions(tree: ast.AST, lines: list[str]) -> list[range]:
    """Functions whose `def` line says `# no-sync:` (load-time code): their lines."""
    return [
        range(n.lineno, (n.end_lineno or n.lineno) + 1)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and any("# no-sync:" in lines[i - 1] for i in range(n.lineno, n.body[0].lineno))
    ]


def unnamed(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    exempt = _exempt_functions(ast.parse("\n".join(lines)), lines)
    out = []
    for lineno, what in suspects("\n".join(lines)):
        line = lines[lineno - 1]
        if "host_sync(" in line or "# sync:" in line or "# no-sync:" in line or any(lineno in r for r in exempt):
            continue
        out.append(f"{path.relative_to(ROOT)}:{lineno}: {what}: {line.strip()}")
    return out


def test_the_hot_path_has_no_unnamed_host_sync():
    """Every possible host sync in stages/, model/, devices, steps and the serial loop is the
    named function or says why it is none."""
    found = [hit for path in HOT for hit in unnamed(path)]
    assert not found, "\n".join(found)


def test_the_check_catches_each_kind_of_sync():
    """The reader flags each kind of sync it promises to, and leaves non-syncs alone."""
    src = "\n".join(
        [
            "a = x.item()",
            "b = x.tolist()",
            "c = x.cpu()",
            "d = bool(x.any())",
            "e = float(loss)",
            "torch.cuda.synchronize()",
            "f = x.to(dev)",
            "g = x.to(device=target.device)",
            "h = x.to(dev, non_blocking=True)",
            "i = x.cuda()",
            "j = x.to(torch.float32)",
            "k = float('nan')",
        ]
    )
    assert [line for line, _ in suspects(src)] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_the_batch_knows_whether_it_is_packed():
    """`Batch.packed` (decided on the host by collate) agrees with what the doc ids say, so the
    target needs no device read to choose its attention mask."""
    import torch

    from dflash.data.samples import Sample, collate

    def sample(i: int, n: int) -> Sample:
        return Sample(i, torch.arange(n), torch.ones(n, dtype=torch.bool))

    for rows in ([[sample(0, 5)], [sample(1, 3)]], [[sample(0, 5), sample(1, 3)], [sample(2, 4)]], [sample(3, 2)]):
        b = collate(rows, 0, 0)
        d = b.doc_ids
        assert b.packed == bool(((d[:, 1:] != d[:, :-1]) & (d[:, 1:] >= 0)).any())
    assert collate([[sample(0, 5), sample(1, 3)]], 0, 0).packed
