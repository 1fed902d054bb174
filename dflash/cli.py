"""The `dflash` command. stdout carries JSON records only; people read stderr.

bin/dflash run configs/tiny.toml                      # train; JSON lines on stdout
bin/dflash run configs/tiny.toml --set train.max_steps=20 | jq -c 'select(.event=="train_step")'
bin/dflash config show configs/tiny.toml --set drafter.num_layers=2
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import IO, Any

import click

from dflash.errors import ConfigError, DFlashError

__all__ = ["main"]

_SET_HELP = "override a config key, e.g. --set drafter.num_layers=2 (repeatable)"


def _prog() -> str:
    """`dflash`, or `dflash[rank N]` in a run of several processes (torchrun)."""
    from dflash.runtime.ranks import launched

    try:
        ranked = launched()
    except ConfigError:  # malformed RANK / WORLD_SIZE: that error is the one being reported
        ranked = None
    return f"dflash[rank {ranked[0]}]" if ranked else "dflash"


def _fail(err: BaseException) -> None:
    code = getattr(err, "exit_code", 1)
    # One line, always: a key or path with a newline in it must not split the message.
    msg = " ".join(str(err).split()) or type(err).__name__
    click.echo(f"{_prog()}: error: {msg}", err=True)
    sys.exit(code)


def _unexpected(err: Exception) -> None:
    if os.environ.get("DFLASH_DEBUG"):
        raise err
    msg = " ".join(str(err).split()) or "no message"
    click.echo(f"{_prog()}: error: {type(err).__name__}: {msg} (DFLASH_DEBUG=1 shows the traceback)", err=True)
    sys.exit(1)


def _rank_log_path(path: Path, ranked: tuple[int, int] | None) -> Path:
    """--log-file for this rank: `{rank}` in the path is replaced; without it, ranks > 0
    write beside it with `.rankN` before the suffix (rank 0 keeps the path)."""
    rank = ranked[0] if ranked else 0
    if "{rank}" in str(path):
        return Path(str(path).replace("{rank}", str(rank)))
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash")
def main() -> None:
    """Train DFlash speculative-decoding drafters."""


def _profile_overrides(profile_interval: float | None) -> list[str]:
    # The flag wins over DFLASH_PROFILE_INTERVAL, which wins over the config file.
    if profile_interval is not None:
        return [f"profile.interval_s={profile_interval!r}"]
    env = os.environ.get("DFLASH_PROFILE_INTERVAL")
    if env:
        try:
            value = float(env)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            msg = f"DFLASH_PROFILE_INTERVAL={env!r}: expected a number of seconds > 0"
            raise ConfigError(msg)
        return [f"profile.interval_s={value!r}"]
    return []


def _check_gguf_export(cfg: Any) -> None:
    """checkpoint.export_gguf: refused when llama.cpp could not convert this target's drafter."""
    from dflash.serving import llamacpp

    if cfg.target.kind == "hf":  # its vocabulary needs llama.cpp's converter
        llamacpp.require_llamacpp("checkpoint.export_gguf with an hf target")
    assert cfg.target.path is not None
    why = llamacpp.gguf_export_problem(cfg.target.kind, cfg.target.path, cfg.target.layer_ids)
    if why is not None:
        raise ConfigError(f"checkpoint.export_gguf: {why}")


def _open_log(path: Path) -> IO[str]:
    """--log-file (this rank's), opened to append."""
    try:
        return path.open("a", encoding="utf-8")
    except OSError as err:
        msg = f"--log-file {path}: {err.strerror}"
        raise ConfigError(msg) from None


def _tell_summary(summary: dict[str, Any], cfg: Any, config: Path, overrides: tuple[str, ...]) -> None:
    """The run's outcome for people: its steps, loss, τ and tokens/s, its folder, and (with an
    export) the drafter's speculative_config in vLLM and, for a head-only target, its eval there."""
    from dflash import logs

    tau = (
        f"; eval tau {summary['eval_tau']:.2f} on held-out prompts"
        f" ({ {True: 'lossless', False: 'NOT lossless', None: 'sampled'}[summary['eval_lossless']] })"
        if summary["eval_tau"] is not None
        else "; end-of-run eval stopped"
        if summary.get("eval_stopped")
        else ""
    )
    logs.human(
        f"dflash: {summary['reason']} after {summary['steps']} steps in {summary['wall_s']:.1f}s; "
        f"loss {summary['final_loss']}, tau_sim {summary['final_tau_sim']}, "
        f"{summary['tokens_per_s']:.0f} tok/s{tau}; run folder {summary['run_dir']}"
    )
    for name, where in (summary.get("trackers") or {}).items():
        logs.human(f"dflash: {name}: {where}")
    if summary.get("vllm_speculative_config"):
        logs.human(f"dflash: in vLLM: speculative_config = {json.dumps(summary['vllm_speculative_config'])}")
        if cfg.target.load == "head":
            final = Path(summary["vllm_speculative_config"]["model"])
            sets = "".join(f" --set {shlex.quote(o)}" for o in overrides)
            where = f"{shlex.quote(str(config))}{sets} --drafter {shlex.quote(str(final))}"
            logs.human(f"dflash: its eval, in vLLM: dflash eval {where} --engine vllm")


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option("--log-file", type=click.Path(dir_okay=False, path_type=Path),
              help="also write the JSON records to this file; under torchrun one per rank: '{rank}' "
                   "in the name, else rank N>0 writes NAME.rankN.SUFFIX")  # fmt: skip
@click.option("--profile-interval", type=float, metavar="SEC",
              help="seconds between profile records (env: DFLASH_PROFILE_INTERVAL)")  # fmt: skip
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path),
              help="write a Chrome-trace timeline (open in Perfetto / chrome://tracing)")  # fmt: skip
@click.option("--resume", metavar="PATH|auto",
              help="continue from a checkpoint folder, or the latest complete one in the run folder "
                   "(auto: none yet starts fresh); on any number of processes, same global batch")  # fmt: skip
@click.option("--new-global-batch", is_flag=True,
              help="with --resume: allow this run's global batch per step to differ from the checkpoint's")  # fmt: skip
@click.option("--tracker", "trackers", multiple=True, metavar="NAME",
              help="also feed this experiment tracker (tensorboard, wandb, mlflow, trackio; repeatable): "
                   "added to run.trackers")  # fmt: skip
def run(
    config: Path,
    overrides: tuple[str, ...],
    log_file: Path | None,
    profile_interval: float | None,
    trace_path: Path | None,
    resume: str | None,
    new_global_batch: bool,
    trackers: tuple[str, ...],
) -> None:
    """Train a drafter as CONFIG (TOML) says."""
    from dflash.pipeline.runner import hold_signals

    hold_signals()  # first: from here on Ctrl-C / SIGTERM end the run with its run_end record
    from dflash import logs
    from dflash.config import load_config

    log_fh: IO[str] | None = None
    try:
        if profile_interval is not None and profile_interval <= 0:
            msg = f"--profile-interval must be > 0 seconds (got {profile_interval})"
            raise ConfigError(msg)
        extra = [f"profile.trace={json.dumps(str(trace_path))}"] if trace_path else []
        cfg = load_config(config, [*overrides, *_profile_overrides(profile_interval), *extra])
        if trackers:  # the config's and these
            extra.append(f"run.trackers={json.dumps([*cfg.run.trackers, *trackers])}")
            cfg = load_config(config, [*overrides, *_profile_overrides(profile_interval), *extra])
        if cfg.checkpoint.export_gguf:  # refused now rather than after training
            _check_gguf_export(cfg)
        from dflash.runtime.ranks import launched

        ranked = launched()  # under torchrun: JSON on stdout from rank 0 only
        first = ranked is None or ranked[0] == 0
        if log_file is not None:
            log_fh = _open_log(_rank_log_path(log_file, ranked))
        logs.configure(sys.stdout if first else None, log_fh)
        from dflash.pipeline.runner import run as run_training
        from dflash.train.checkpoint import ResumeFrom

        if new_global_batch and resume is None:
            msg = "--new-global-batch: only with --resume"
            raise ConfigError(msg)
        summary = run_training(cfg, resume=ResumeFrom(resume, new_global_batch) if resume else None)
        if first:
            _tell_summary(summary, cfg, config, overrides)
    finally:
        if log_fh is not None:
            log_fh.close()


@main.command("eval")
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--drafter", "drafter_path", required=True, type=click.Path(path_type=Path),
              help="an exported drafter folder (e.g. runs/tiny/final) or a checkpoint folder "
                   "(e.g. runs/tiny/checkpoints/step_000040)")  # fmt: skip
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option("--prompts", "prompt_sets", multiple=True, metavar="NAME|FILE",
              help="prompt set, repeatable: mtbench (80 two-turn questions), humaneval (164), heldout "
                   "(the run's), or a chat JSONL; default: the run's held-out (or random) prompts")  # fmt: skip
@click.option("--num-prompts", type=click.IntRange(min=1),
              help="at most N prompts per set (default: all of a named set; eval.num_prompts otherwise)")  # fmt: skip
@click.option("--max-new-tokens", type=click.IntRange(min=1), help="tokens per generation (eval.max_new_tokens)")
@click.option("--temperature", type=click.FloatRange(min=0.0),
              help="0 (default): greedy, checked lossless; > 0: sampled with speculative sampling's "
                   "verification (eval.temperature)")  # fmt: skip
@click.option("--batch-size", type=click.IntRange(min=1),
              help="prompts decoded at once, greedy only (eval.batch_size; 1: single-sequence speedup)")  # fmt: skip
@click.option("--engine", type=click.Choice(["dflash", "vllm", "llamacpp"]), default="dflash", show_default=True,
              help="vllm: decode in vLLM's offline API with the export as drafter; llamacpp: in llama.cpp's "
                   "llama-server, the drafter as GGUF; each checked against the engine's plain greedy output and "
                   "ours (needs vLLM: make engines; llama.cpp: make llamacpp)")  # fmt: skip
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="--engine vllm: vLLM's tensor_parallel_size for the target")  # fmt: skip
def eval_cmd(
    config: Path,
    drafter_path: Path,
    overrides: tuple[str, ...],
    prompt_sets: tuple[str, ...],
    num_prompts: int | None,
    engine: str,
    tensor_parallel: int,
    **decoding: Any,  # max_new_tokens, temperature, batch_size: the [eval] keys they override
) -> None:
    """Speculative decoding with a trained drafter, greedy (temperature 0, checked lossless
    against the target's own output) or sampled (--temperature): one `eval` JSON record per
    prompt set (τ, acceptance per position, speedup), and a table on stderr."""
    from dflash import logs
    from dflash.config import load_config

    sets = list(prompt_sets)
    if len(sets) == 1 and sets[0].isdigit():  # the old `--prompts N`
        if num_prompts is not None or int(sets[0]) < 1:
            msg = "--prompts N (a count) is the old spelling of --num-prompts N (N >= 1); give one of them"
            raise ConfigError(msg)
        num_prompts, sets = int(sets[0]), []
    extra = [f"eval.num_prompts={num_prompts}"] if num_prompts and not sets else []
    extra += [f"eval.{key}={value!r}" for key, value in decoding.items() if value is not None]
    cfg = load_config(config, [*overrides, *extra])
    logs.configure(sys.stdout)
    from dflash.eval.command import run_eval

    if tensor_parallel > 1 and engine != "vllm":
        msg = "--tensor-parallel: only with --engine vllm (dflash's own decoding runs on pipeline.target_devices[0])"
        raise ConfigError(msg)
    records = run_eval(cfg, drafter_path, sets, num_prompts if sets else None, engine, tensor_parallel)
    import structlog

    for record in records:
        structlog.get_logger("dflash").info("eval", **record)
    logs.human(_eval_table(records))


def _eval_table(records: list[dict]) -> str:
    """τ per prompt set, like the papers' tables."""
    if records and records[0].get("engine") in ("vllm", "llamacpp"):
        engine = records[0]["engine"]
        name = {"vllm": "vLLM", "llamacpp": "llama.cpp"}[engine]
        rows = [f"{'prompt set':<14}{'prompts':>8}{'tau ' + name:>15}{'tau dflash':>12}  same as {name} greedy / ours"]
        ours = lambda r: "-" if r["dflash_tau"] is None else f"{r['dflash_tau']:.3f}"  # noqa: E731  # head only: none
        same = lambda r: "-" if r["identical_to_dflash_greedy"] is None else r["identical_to_dflash_greedy"]  # noqa: E731
        rows += [
            f"{r['prompt_set']:<14}{r['prompts']:>8}{r['tau']:>15.3f}{ours(r):>12}  "
            f"{r[f'identical_to_{engine}_greedy']}/{r.get('generations', r['prompts'])} / "
            f"{same(r)}/{r.get('generations', r['prompts'])}"
            + (f"  {r['llamacpp_tokens_per_s']} tok/s ({r['llamacpp_plain_tokens_per_s']} plain)"
               if engine == "llamacpp" else "")
            for r in records
        ]  # fmt: skip
        return f"dflash eval --engine {engine} (greedy; tau: tokens per verify step)\n" + "\n".join(rows)
    k = min(6, max(len(r["accept_per_position"]) for r in records))
    head = (
        f"{'prompt set':<14}{'prompts':>8}{'gens':>6}{'tau':>7}{'tau/gen':>9}  "
        + " ".join(f"{'p' + str(i + 1):>5}" for i in range(k))
        + f"{'speedup':>9}  lossless"
    )
    rows = [head]
    for r in records:
        acc = " ".join(f"{x:5.2f}" for x in r["accept_per_position"][:k])
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        taus = f"{r['tau']:>7.3f}{r['tau_per_generation']:>9.3f}"
        turns = r.get("tau_per_turn") or []
        by_turn = "  tau by turn " + " / ".join(f"{t:.3f}" for t in turns) if len(turns) > 1 else ""
        rows.append(
            f"{r['prompt_set']:<14}{r['prompts']:>8}{r['generations']:>6}{taus}  "
            f"{acc}{speed:>9}  {({True: 'yes', False: 'NO', None: 'sampled'})[r['lossless']]}{by_turn}"
        )
    mode = "greedy" if not records[0].get("temperature") else f"sampled at temperature {records[0]['temperature']}"
    if records[0].get("batch_size", 1) > 1:
        mode += f", {records[0]['batch_size']} prompts at once: speedup is batched against batched plain decoding"
    if records[0].get("family_head") is False:
        mode += ", drafted from the backbone's logits alone (eval.family_head = false)"
    return f"dflash eval ({mode}; p_k: share of verify steps accepting at least k drafted tokens)\n" + "\n".join(rows)


@main.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["dflash", "speculators", "gguf"]), default="dflash",
              show_default=True,
              help="dflash: the reference format (vLLM, SGLang, AutoModel); speculators: vLLM's second DFlash "
                   "format (speculators_config, nested transformer_layer_config); gguf: one .gguf file for "
                   "llama.cpp (--gguf-type, --target)")  # fmt: skip
@click.option(
    "--gguf-type",
    type=click.Choice(["f32", "f16", "bf16", "q8_0"]),
    default="f16",
    show_default=True,
    help="--format gguf: the weights' type (norms stay f32; q8_0 falls back to f16 for short rows)",
)
@click.option("--target", "target_path", type=click.Path(path_type=Path),
              help="--format gguf: the target's GGUF file or Hugging Face folder, whose vocabulary the drafter "
                   "borrows (default: the run's target)")  # fmt: skip
@click.option("--draft-max", type=click.IntRange(min=1), default=None,
              help="--format gguf: the printed llama-server command's --spec-draft-n-max (default: every slot a "
                   "block drafts)")  # fmt: skip
@click.option("--draft-p-min", type=click.FloatRange(0, 1), default=None,
              help="--format gguf: the printed command's --spec-draft-p-min, the least probability a drafted "
                   "token needs (default: llama.cpp's); where acceptance is low, drafting every slot wastes "
                   "verification (bench/llamacpp_sweep.py measures the fastest)")  # fmt: skip
def export_cmd(
    checkpoint: Path,
    out: Path,
    fmt: str,
    gguf_type: str,
    target_path: Path | None,
    draft_max: int | None,
    draft_p_min: float | None,
) -> None:
    """Turn a checkpoint folder (mid-run, emergency or final), or a run folder's latest
    complete checkpoint, into an exported drafter in OUT (a folder; --format gguf: a .gguf
    file, from an export folder too)."""
    from dflash.model.export import export_checkpoint, is_checkpoint
    from dflash.train.checkpoint import latest_checkpoint

    source = checkpoint
    if checkpoint.is_dir() and not is_checkpoint(checkpoint) and (checkpoint / "checkpoints").is_dir():
        found = latest_checkpoint(checkpoint)
        if found is None:
            msg = f"{checkpoint}: no complete checkpoint in {checkpoint / 'checkpoints'}"
            raise DFlashError(msg)
        source = found
    from dflash import logs

    if fmt == "gguf":
        _export_gguf(source, checkpoint, out, gguf_type, target_path, (draft_max, draft_p_min))
        return
    from dflash.model.export import load_drafter, speculative_config

    out = export_checkpoint(source, out, fmt)
    spec_cfg = speculative_config(out.resolve(), load_drafter(out).spec)
    record = {"event": "export", "checkpoint": str(source), "path": str(out), "vllm_speculative_config": spec_cfg}
    click.echo(logs.render(record))
    logs.human(f"dflash export: {source} -> {out}; in vLLM: speculative_config = {json.dumps(spec_cfg)}")


def _export_gguf(
    source: Path,
    given: Path,
    out: Path,
    gtype: str,
    target_path: Path | None,
    drafting: tuple[int | None, float | None],
) -> None:
    """`dflash export --format gguf`: the drafter (a checkpoint or an export folder) as one
    GGUF file, its vocabulary the target's (--target, else the run's own target); `drafting`:
    the printed command's draft count and minimum probability (None: the defaults)."""
    from dflash import logs
    from dflash.model.export import load_drafter, run_target
    from dflash.model.export_gguf import read_target_gguf, write_gguf
    from dflash.model.loading import cache_root, resolve_gguf
    from dflash.serving import llamacpp

    if out.suffix != ".gguf" or out.is_dir():
        msg = f"{out}: --format gguf writes one file; give a path ending in .gguf"
        raise ConfigError(msg)
    cache = ""
    if target_path is None:
        found = run_target(source)
        if found is None:
            msg = f"{given}: no run config names its target; give the target with --target (a GGUF file or HF folder)"
            raise ConfigError(msg)
        kind, path, cache = found
        target_path = resolve_gguf(path) if kind == "gguf" else Path(path).expanduser()
    drafter = load_drafter(source)  # before any conversion: a bad drafter fails at once
    vocab = read_target_gguf(llamacpp.vocab_gguf(target_path, cache_root(cache)), target_path)
    write_gguf(drafter.spec, drafter.state_dict(), vocab, out, gtype, name=f"dflash {drafter.spec.family} drafter")
    served = target_path if target_path.is_file() else "TARGET.gguf"  # an HF target: its GGUF, once converted
    draft_max, p_min = drafting
    serve = llamacpp.serve_command(
        served, out, drafter.spec.family, min(draft_max or 1 << 30, drafter.spec.drafts), p_min
    )
    click.echo(logs.render({"event": "export", "checkpoint": str(source), "path": str(out), "format": "gguf",
                            "gguf_type": gtype, "llama_server": serve}))  # fmt: skip
    built = "" if llamacpp.server_binary().is_file() else " (its llama-server once built: make llamacpp)"
    logs.human(f"dflash export: {source} -> {out} (GGUF, {gtype}); in llama.cpp{built}: {serve}")


def _per_set(counts: dict[str, int]) -> str:
    """'chatterbot 1765, ShareGPT_V3_....json 412; ' for several prompt sets, else ''."""
    if len(counts) < 2:
        return ""
    return ", ".join(f"{Path(src.removeprefix('pkg:')).name} {n}" for src, n in counts.items()) + "; "


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
def regen(config: Path, overrides: tuple[str, ...]) -> None:
    """Let the target write the assistant turns for the [regen] prompts (resumable)."""
    from dflash import logs
    from dflash.config import load_config

    try:
        cfg = load_config(config, list(overrides))
        if cfg.regen.engine == "vllm":  # before anything loads
            from dflash.regen.vllm import require_vllm_for_regen

            require_vllm_for_regen()
        logs.configure(sys.stdout)
        import structlog
        import torch

        from dflash.model.loading import load_tokenizer
        from dflash.model.target import load_target
        from dflash.regen import regenerate
        from dflash.runtime.devices import check_device

        if cfg.target.kind == "tiny":
            msg = "regen needs a real target with a tokenizer (target.kind = 'hf' or 'gguf')"
            raise ConfigError(msg)
        from dflash.data.prompts import load_prompts

        elsewhere = bool(cfg.regen.server) or cfg.regen.engine == "vllm"  # the target's weights never load here
        if not elsewhere and cfg.target.load == "head":
            msg = "target.load = 'head': regen's own loop runs the whole target; set regen.engine = 'vllm'"
            raise ConfigError(msg)
        dev = None if elsewhere else check_device(cfg.pipeline.target_devices[0], "pipeline.target_devices[0]")
        with warnings.catch_warnings(record=True) as caught:  # skipped records: warning records, as in a run
            warnings.simplefilter("always")
            prompts = load_prompts(cfg)  # before the model: a bad prompt file fails in a second
        for w in caught:
            structlog.get_logger("dflash").warning("warning", message=str(w.message))
        tokenizer = load_tokenizer(cfg.target, cfg.data.cache_dir)
        target = None if dev is None else load_target(cfg.target, dev, cfg.drafter.num_layers, cfg.data.cache_dir)
        torch.manual_seed(cfg.regen.seed)
        stats = regenerate(cfg, target, tokenizer, prompts=prompts)
        structlog.get_logger("dflash").info("regen", **stats)
        logs.human(
            f"dflash regen: {stats['generated']} replies (turns) written "
            f"({_per_set(stats['generated_per_set'])}{stats['resumed_from']} already there), "
            f"{stats['tokens_per_s']} tok/s, {stats['wall_s']}s -> {stats['output']}"
            + (f" (+ features, {stats['features_mb']} MB)" if stats["features"] else "")
            + (f"; vLLM's start, {stats['engine_start_s']}s, not in tok/s" if stats.get("engine_start_s") else "")
            + (f"; {stats['too_long']} turns over regen.max_prompt_tokens / max_context_tokens skipped"
               if stats["too_long"] else "")
            + (f"; {stats['refused']} prompts refused by the server skipped (warning records)"
               if stats.get("refused") else "")
            + (f"; regen.max_minutes reached with {stats['unanswered']} turns unanswered (a later regen "
               "answers them)" if stats["unanswered"] else "")
        )  # fmt: skip
    except KeyboardInterrupt:
        click.echo("dflash: regen interrupted; run it again to resume", err=True)
        sys.exit(130)


@main.command("features")
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option("--engine", type=click.Choice(["vllm"]), default="vllm", show_default=True,
              help="vllm: the target served by vLLM's offline API (needs vLLM: make engines)")  # fmt: skip
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="vLLM's tensor_parallel_size")  # fmt: skip
@click.option("--pipeline-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="vLLM's pipeline_parallel_size")  # fmt: skip
@click.option("--upgrade", is_flag=True,
              help="only rewrite feature folders of an earlier format beside the data files (no engine)")  # fmt: skip
def features_cmd(config: Path, overrides: tuple[str, ...], engine: str, tensor_parallel: int,
                 pipeline_parallel: int, upgrade: bool) -> None:  # fmt: skip
    """Compute the target features of the [data] files' samples in an engine and write them
    beside each data file (data.jsonl -> data.features/), the feature store `dflash run`
    reads instead of running the target (resumable)."""
    from dflash import logs
    from dflash.config import load_config
    from dflash.engines.vllm import require_vllm

    if upgrade:
        _upgrade_features(load_config(config, list(overrides)))
        return
    require_vllm()  # before anything loads
    cfg = load_config(config, list(overrides))
    logs.configure(sys.stdout)
    import structlog

    from dflash.features.vllm import EngineSettings, extract_features

    stats = extract_features(cfg, EngineSettings(tensor_parallel, pipeline_parallel))
    structlog.get_logger("dflash").info("features", **stats)
    logs.human(
        f"dflash features ({engine}): {stats['written']} samples written ({stats['tokens']} tokens, "
        f"{stats['parts']} parts), {stats['already_stored']} already there, {stats['wall_s']}s -> "
        + ", ".join(stats["folders"])
    )


@main.command("plan")
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    help="devices per node, split into target chains and drafter replicas  [default: the config's]",
)
@click.option("--gpu", default="h100", show_default=True,
              help="a100, h100, h200, b200, mi300x (published dense peaks), or cpu (this machine's probe)")  # fmt: skip
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="nodes, each with --gpus")
@click.option("--mfu", type=click.FloatRange(min=1e-4, max=1.0), default=None,
              help="the MFU every stage runs at  [default: 0.35 on a GPU, 0.1 on a CPU]")  # fmt: skip
@click.option("--calibrate", "calibrate", type=click.Path(path_type=Path), default=None,
              help="a run's JSON log (or run folder): each stage's measured MFU and the run's mean batch")  # fmt: skip
@click.option("--fill", type=click.FloatRange(min=0.01, max=1.0), default=None,
              help="real tokens over the token budget  [default: modelled from data.num_buckets]")  # fmt: skip
@click.option("--row-length", type=click.IntRange(min=1), default=None,
              help="a batch's padded row length, may pass data.max_seq_len  [default: data.max_seq_len]")  # fmt: skip
@click.option("--target-s", type=click.FloatRange(min=1e-6), default=None,
              help="a measured target forward (seconds a batch): every stage's MFU fitted to it")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="print the plan as one JSON object")
def plan_cmd(config: Path, overrides: tuple[str, ...], gpus: int | None, gpu: str, nodes: int, mfu: float | None,
             calibrate: Path | None, fill: float | None, row_length: int | None, target_s: float | None,
             as_json: bool) -> None:  # fmt: skip
    """Plan a run before renting its devices: memory per device, whether it fits, the best
    split into target chains and drafter replicas, tokens/s and the bottleneck — from the
    configs alone (no weights read)."""
    from dflash.config import load_config
    from dflash.plan import Calibration, format_plan, plan

    cfg = load_config(config, list(overrides))
    cal = None
    if calibrate is not None:
        from dflash.report import read_logs

        cal = Calibration.from_records(read_logs([str(calibrate)]))
    out = plan(cfg, gpus, gpu.lower(), nodes, mfu, fill, row_length, cal, target_s)
    click.echo(json.dumps(out) if as_json else format_plan(out))


@main.command("serve-target")
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option("--engine", type=click.Choice(["vllm", "local"]), default="vllm", show_default=True,
              help="vllm: the target in vLLM (needs vLLM: make engines); local: the target in PyTorch")  # fmt: skip
@click.option("--spool", type=click.Path(path_type=Path), default=None,
              help="the shared folder to answer in  [default: the config's target.engine_spool]")  # fmt: skip
@click.option("--device", default=None, help="--engine local: the target's device  [default: the config's first "
              "pipeline.target_devices]")  # fmt: skip
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=None,
              help="--engine vllm: vLLM's tensor_parallel_size  [default: target.engine_tensor_parallel]")  # fmt: skip
def serve_target(config: Path, overrides: tuple[str, ...], engine: str, spool: Path | None, device: str | None,
                 tensor_parallel: int | None) -> None:  # fmt: skip
    """Serve the target's features to a run with target.engine = "remote" on other hosts,
    through a folder both reach: answers each batch the run's target stage sends, until the
    run ends."""
    from dflash import logs
    from dflash.config import load_config

    if engine == "vllm":
        from dflash.engines.vllm import require_vllm

        require_vllm()  # before anything loads
    cfg = load_config(config, list(overrides))
    folder = spool or (Path(cfg.target.engine_spool) if cfg.target.engine_spool else None)
    if folder is None:
        raise ConfigError("dflash serve-target: no folder to serve in: --spool DIR or target.engine_spool")
    logs.configure(sys.stdout)
    import shutil
    import signal
    import tempfile
    import threading
    import time

    import structlog

    from dflash.targets import spool_server as spooled

    log = structlog.get_logger("dflash")
    asked = threading.Event()  # Ctrl-C / SIGTERM: stop after the request in hand, folder left clean
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: asked.set())
    heart = spooled.start_serving(folder)
    scratch = Path(tempfile.mkdtemp(prefix="dflash-serve-target-"))  # vLLM's own files, on this host
    llm = None
    last = [time.monotonic()]

    def progress(stats: dict[str, Any]) -> None:
        if time.monotonic() - last[0] >= 30:
            last[0] = time.monotonic()
            logs.human(f"dflash serve-target: {stats['requests']} batches, {stats['documents']} documents answered")

    try:
        compute, meta, llm = _spool_compute(cfg, engine, scratch, tensor_parallel, device)
        log.info("serve_start", engine=engine, spool=str(folder), layer_ids=meta.layer_ids, dtype=meta.dtype)
        logs.human(f'dflash serve-target ({engine}): serving {folder}; start the run with target.engine = "remote"')
        stats = spooled.serve(folder, compute, meta, engine, progress, asked)
    finally:
        heart.stop()
        if llm is not None:
            from dflash.engines.vllm import shut_down

            shut_down(llm)
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("serve_end", **stats)
    why = "stopped" if stats.get("stopped") == "signal" else "the run ended"
    logs.human(f"dflash serve-target: {why}; {stats['requests']} batches, {stats['documents']} documents, "
               f"{stats['tokens']} tokens answered in {stats['wall_s']}s")  # fmt: skip


def _spool_compute(
    cfg: Any, engine: str, scratch: Path, tensor_parallel: int | None, device: str | None
) -> tuple[Any, Any, Any]:
    """What answers each batch and its features' description: the target in vLLM (with its LLM,
    to shut down after) or in PyTorch on `device` (no LLM)."""
    import torch

    from dflash.targets import spool_server as spooled

    if engine == "vllm":
        tp = tensor_parallel or cfg.target.engine_tensor_parallel
        return spooled.vllm_compute(cfg, scratch, tp)
    dev = torch.device(device or cfg.pipeline.target_devices[0])
    compute, meta = spooled.local_compute(cfg, dev)
    return compute, meta, None


def _upgrade_features(cfg: Any) -> None:
    from dflash import logs
    from dflash.features.files import folder_for, upgrade_folder
    from dflash.store.packages import local_path

    folders = [folder_for(local_path(f.path)) for f in cfg.data.files] if cfg.data.source == "files" else []
    for folder in (f for f in folders if f.is_dir()):
        logs.human(f"dflash features --upgrade: {upgrade_folder(folder)} parts rewritten in {folder}")


@main.command()
@click.argument("logs", metavar="[LOG]...", nargs=-1, type=click.Path(exists=True, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="print the analysis as one JSON object")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="draw stage times and queue depth (PNG)")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="write one self-contained HTML page: loss, τ, acceptance, lr, grad norm, tokens/s, MFU, stage "
                   "times and queues over the run, the bottleneck, the eval table")  # fmt: skip
@click.option("--compare", is_flag=True, help="each LOG is a run of its own (a file or run folder): reported one "
              "after another, and --html overlays their curves")  # fmt: skip
def report(logs: tuple[str, ...], as_json: bool, plot_path: str | None, html_path: str | None, compare: bool) -> None:
    """Read a run's JSON logs and name the bottleneck stage.

    LOG: a log file, - for stdin (the default), or a run folder (its records.jsonl and
    records.rankN.jsonl). Several ranks' logs (torchrun) add a per-rank table and the slowest rank."""
    from dflash.report import analyze, format_report, plot, read_logs
    from dflash.report_html import run_name, write_html

    if compare and len(logs) < 2:
        raise ConfigError("report --compare: name two runs or more (log files or run folders)")
    runs = [(run_name(r, Path(p).stem), r) for p in logs for r in [read_logs([p])]] if compare else []
    names = [n for n, _ in runs]
    runs = [(n if names.count(n) == 1 else f"{n} ({p})", r) for (n, r), p in zip(runs, logs, strict=False)]
    records = read_logs(logs) if not compare else []
    for name, recs in runs or [("", records)]:
        a = analyze(recs)
        click.echo(json.dumps(a) if as_json else (f"== {name}\n" if compare else "") + format_report(a))
    if plot_path:
        plot(runs[0][1] if compare else records, plot_path)
    if html_path:
        out = write_html(runs or [(run_name(records, "run"), records)], html_path)
        click.echo(f"dflash report: {out}", err=True)


@main.group()
def config() -> None:
    """Inspect configs."""


@config.command("show")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
def config_show(config_file: Path, overrides: tuple[str, ...]) -> None:
    """Print CONFIG_FILE resolved (overrides applied) as TOML: every key of the schema, each
    under a comment with its meaning and default; keys left unset are commented out."""
    from dflash.config import annotated_toml, load_config

    click.echo(annotated_toml(load_config(config_file, list(overrides))), nl=False)


def entry() -> None:
    """Console entry point, and the one place errors become a single stderr line:
    click's usage errors and ours (DFlashError) with their exit codes (2 for usage and
    config), anything else as exit 1 (DFLASH_DEBUG=1 shows its traceback), Ctrl-C as 130."""
    try:
        main.main(prog_name="dflash", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:  # click turns KeyboardInterrupt into Abort
        click.echo("dflash: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"dflash: error: {' '.join(e.format_message().split())}", err=True)
        sys.exit(e.exit_code)
    except DFlashError as err:
        _fail(err)
    except Exception as err:  # not ours: still one line, the traceback on request
        _unexpected(err)


if __name__ == "__main__":
    entry()
