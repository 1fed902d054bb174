"""`dflash report --html OUT LOG` and `dflash report --compare A B … --html OUT`: one
self-contained HTML page (no network: the figures are inline SVG drawn with matplotlib, which
`--plot` already uses — no JavaScript, a page of a few hundred KB that opens anywhere) with the
curves people watch a run by: loss and its parts, τ and acceptance per position, learning rate,
grad norm, tokens/s and MFU over steps, stage times and queue depth, then the bottleneck verdict
and the eval table. Several runs overlay, with a legend by run name. Each run's series is
embedded as JSON (`<script type="application/json" id="dflash-series">`) for whoever wants the
numbers behind a curve.
"""

from __future__ import annotations

import html
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash.errors import DataError
from dflash.report import analyze, busiest, format_report, timeline

Records = list[dict[str, Any]]


def series(name: str, records: Records) -> dict[str, Any]:
    """One run's curves: per step (train_step), per profile window (seconds into training), evals."""
    steps = [r for r in records if r.get("event") == "train_step" and r.get("rank", 0) == 0]
    train: dict[str, list] = {"step": [r["step"] for r in steps]}
    for key in ("loss", "lr", "grad_norm", "tau_sim", "tokens_per_s"):
        train[key] = [r.get(key) for r in steps]
    for part in sorted({p for r in steps for p in (r.get("loss_parts") or {})}):
        train[f"loss_{part}"] = [(r.get("loss_parts") or {}).get(part) for r in steps]
    accs = [r.get("acc") or [] for r in steps]
    for k in range(max(map(len, accs), default=0)):
        train[f"acc_k{k + 1}"] = [a[k] if len(a) > k else None for a in accs]
    profiles = [r for r in records if r.get("event") == "profile" and not r.get("final") and r.get("rank", 0) == 0]
    profile: dict[str, Any] = {"t": [round(x, 3) for x in timeline(profiles)], "stage_ms": {}, "mfu": {}, "queue": {}}
    for n in busiest(profiles, 5):
        profile["stage_ms"][n] = [p["stages"].get(n, {}).get("mean_ms") for p in profiles]
        mfu = [p["stages"].get(n, {}).get("mfu") for p in profiles]
        if any(m is not None for m in mfu):
            profile["mfu"][n] = mfu
    for q in sorted({q for p in profiles for q in p.get("queues", {})}):
        profile["queue"][q] = [p.get("queues", {}).get(q, {}).get("mean_depth") for p in profiles]
    profile["drafter_tokens_per_s"] = [(p.get("tokens_per_s") or {}).get("drafter") for p in profiles]
    evals = [{k: r.get(k) for k in ("prompt_set", "turn", "engine", "tau", "accept_per_position", "lossless",
                                     "prompts", "step")} for r in records if r.get("event") == "eval"]  # fmt: skip
    return {"name": name, "train": train, "profile": profile, "eval": evals}


def run_name(records: Records, fallback: str) -> str:
    start = next((r for r in records if r.get("event") == "run_start"), None)
    return str(((start or {}).get("config") or {}).get("run", {}).get("name") or fallback)


# (title, y label, where in the series, keys; a key ending in "*": every key with that prefix)
FIGURES = [
    ("Loss", "loss", "train", ["loss", "loss_*"]),
    ("τ (simulated from per-position accuracy)", "τ", "train", ["tau_sim"]),
    ("Accuracy per block position", "accuracy", "train", ["acc_k*"]),
    ("Learning rate", "lr", "train", ["lr"]),
    ("Grad norm", "norm", "train", ["grad_norm"]),
    ("Tokens/s (train_step interval)", "tokens/s", "train", ["tokens_per_s"]),
    ("Stage times", "mean ms per call", "profile", ["stage_ms.*"]),
    ("MFU per stage", "MFU", "profile", ["mfu.*"]),
    ("Queue depth", "mean depth", "profile", ["queue.*"]),
]


def _lines(run: dict[str, Any], where: str, keys: list[str]) -> list[tuple[str, list, list]]:
    """(label, x, y) for each curve of a figure in one run."""
    part = run[where]
    x = part["step"] if where == "train" else part["t"]
    out = []
    for key in keys:
        if "." in key:  # a nested family: profile["stage_ms"][name]
            group = part.get(key.split(".")[0], {})
            out += [(name, x, ys) for name, ys in group.items()]
        elif key.endswith("*"):
            out += [(k, x, ys) for k, ys in part.items() if k.startswith(key[:-1]) and k != key[:-1]]
        elif key in part:
            out.append((key, x, part[key]))
    return [(label, xs, ys) for label, xs, ys in out if any(y is not None for y in ys)]


def _svg(title: str, ylabel: str, where: str, keys: list[str], runs: list[dict[str, Any]]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [(run["name"], *c) for run in runs for c in _lines(run, where, keys)]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        for name, label, xs, ys in (c for c in curves if c[0] == run["name"]):
            pts = [(x, y) for x, y in zip(xs, ys, strict=False) if y is not None]
            text = label if len(runs) == 1 else f"{name}: {label}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[i % len(styles)], label=text, linewidth=1.2)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("step" if where == "train" else "seconds")
    ax.grid(alpha=0.3)
    if len(curves) <= 16:
        ax.legend(fontsize=6, ncol=2 if len(curves) > 6 else 1)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _accepts(e: dict[str, Any]) -> str:
    return ", ".join(f"{p:.2f}" for p in e.get("accept_per_position") or [] if p is not None)


def _eval_table(runs: list[dict[str, Any]]) -> str:
    rows = [(run["name"], e) for run in runs for e in run["eval"]]
    if not rows:
        return "<p>No eval records.</p>"
    head = "<tr><th>run</th><th>prompts</th><th>turn</th><th>engine</th><th>τ</th><th>acceptance per position</th>" \
           "<th>lossless</th></tr>"  # fmt: skip
    body = "".join(
        f"<tr><td>{html.escape(n)}</td><td>{html.escape(str(e.get('prompt_set') or 'held-out'))}</td>"
        f"<td>{e.get('turn') or ''}</td><td>{html.escape(str(e.get('engine') or 'dflash'))}</td>"
        f"<td>{e.get('tau')}</td><td>{_accepts(e)}</td>"
        f"<td>{e.get('lossless')}</td></tr>"
        for n, e in rows
    )
    return f"<table>{head}{body}</table>"


STYLE = """body{font-family:system-ui,sans-serif;margin:24px;max-width:1500px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}.grid{display:flex;flex-wrap:wrap;gap:8px}
.grid>div{flex:0 0 auto}svg{width:520px;height:auto}pre{background:#f6f6f6;padding:10px;font-size:12px;
overflow-x:auto}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px}"""


def write_html(runs: Sequence[tuple[str, Records]], out: str | Path) -> Path:
    """The page for `runs` ((name, records) each), written to `out`."""
    if not runs:
        raise DataError("report --html: no runs to draw")
    data = [series(name, records) for name, records in runs]
    if not any(d["train"]["step"] or d["profile"]["t"] for d in data):
        raise DataError("report --html: no train_step or profile records in the logs")
    figures = [s for s in (_svg(*f, data) for f in FIGURES) if s]
    verdicts = []
    for name, records in runs:
        try:
            text = format_report(analyze(records))
        except DataError as err:
            text = str(err)
        verdicts.append(f"<h3>{html.escape(name)}</h3><pre>{html.escape(text)}</pre>")
    names = ", ".join(html.escape(d["name"]) for d in data)
    embedded = json.dumps({"runs": data}, allow_nan=False, default=str).replace("</", "<\\/")
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>dflash report: {names}</title>"
        f"<style>{STYLE}</style></head><body><h1>dflash report: {names}</h1>"
        f"<div class='grid'>{''.join(f'<div>{s}</div>' for s in figures)}</div>"
        f"<h2>Eval</h2>{_eval_table(data)}<h2>Where the time goes</h2>{''.join(verdicts)}"
        f"<script type='application/json' id='dflash-series'>{embedded}</script></body></html>"
    )
    path = Path(out)
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as err:
        msg = f"report --html: cannot write {path}: {err.strerror or err}"
        raise DataError(msg) from None
    return path
