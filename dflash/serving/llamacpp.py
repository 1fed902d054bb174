"""llama.cpp at the serving end: its build, the target as GGUF, and greedy decoding in
`llama-server` with a drafter GGUF, against the server's own plain greedy decoding.

Facts this module encodes (llama.cpp as vendored by llama-cpp-python 0.3.36, commit 0c1e570):
- `make llamacpp` builds `llama-server` from that source package once per machine (into the
  user's cache, `~/.cache/dflash/llama.cpp/<version>-<key>`, shared by every clone) and links
  the clone's `.llamacpp/<version>` (git-ignored) to it; nothing downloaded but the PyPI
  package. Its tree also holds the converter (`convert_hf_to_gguf.py`, `gguf-py`) that turns
  an `hf` target into GGUF.
- `--spec-type draft-dflash` serves DFlash and DFlash2 drafters, `draft-dspark` DSpark ones;
  `--spec-draft-n-max` is clamped to block size − 1 (DSpark: block size); a DSpark
  confidence threshold is `--spec-draft-p-min`.
- The server takes prompts as token ids (`/completion`), returns the generated ids
  (`return_tokens`), the end of a generation included (its end-of-generation token), and
  counts drafts on `/metrics` (`--metrics`): `llamacpp:spec_decode_num_drafts_total`,
  `…num_draft_tokens_total`, `…num_accepted_tokens_total`,
  `…num_accepted_tokens_per_pos_total{position=…}`.
The server listens on loopback only, on a port it picks (`--port 0`); it is stopped on every
exit path, and dies with dflash if dflash is killed (PR_SET_PDEATHSIG, Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError, DFlashError
from dflash.serving import EngineRun

__all__ = [
    "VERSION",
    "Server",
    "convert_hf",
    "decode",
    "home",
    "require_llamacpp",
    "serve_command",
    "spec_args",
    "target_vocab",
    "vocab_gguf",
]

VERSION = "0.3.36"  # llama-cpp-python's source package; it vendors llama.cpp at 0c1e570
HOW = "make llamacpp (builds llama.cpp from llama-cpp-python's source package on PyPI once a machine, ~6 min)"


def home() -> Path:
    """Where `make llamacpp` puts llama.cpp: `$DFLASH_LLAMACPP`, else `.llamacpp/<version>`
    in the dflash checkout (a link to the machine's shared build)."""
    env = os.environ.get("DFLASH_LLAMACPP")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".llamacpp" / VERSION


def server_binary() -> Path:
    return home() / "build" / "bin" / "llama-server"


def require_llamacpp(what: str = "--engine llamacpp") -> Path:
    """The llama-server binary, or one line saying how to build it (`what` needs it)."""
    binary = server_binary()
    if not binary.is_file() or not (home() / "src" / "convert_hf_to_gguf.py").is_file():
        msg = f"{what}: llama.cpp is not built in {home()}; {HOW}"
        raise ConfigError(msg)
    return binary


def convert_hf(
    folder: Path, out: Path, outtype: str = "f32", vocab_only: bool = False, target_dir: Path | None = None
) -> Path:
    """An HF model folder → GGUF at `out`, with llama.cpp's own converter (written whole or not
    at all); one line with the converter's last words when it fails. `target_dir`: for a
    drafter folder, its target's (the converter borrows the target's vocabulary)."""
    from dflash.store.atomic import atomic_path

    require_llamacpp("converting a Hugging Face model to GGUF")
    src = home() / "src"
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(tmp),
               "--outtype", outtype, *(["--vocab-only"] if vocab_only else []),
               *(["--target-model-dir", str(target_dir)] if target_dir else [])]  # fmt: skip
        paths = [str(src / "gguf-py"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "no output")
            msg = f"llama.cpp's converter failed on {folder}: {last.strip()}"
            raise DFlashError(msg)
    return out


def cached_hf_gguf(folder: Path, cache: Path, vocab_only: bool = False) -> Path:
    """An `hf` target's GGUF, converted once and kept in `cache`, keyed on the folder's config
    and weight files: float32 (the weights dflash decodes with), or its vocabulary and shape
    alone (`vocab_only`: what a drafter's GGUF borrows)."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file())
    sig = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    key = hashlib.sha256(f"{folder.resolve()}|{sig}".encode()).hexdigest()[:16]
    out = cache / "gguf" / f"{folder.name}-{key}-{'vocab' if vocab_only else 'f32'}.gguf"
    if not out.is_file():
        print(f"dflash: converting {folder} to GGUF once into {out}", file=sys.stderr, flush=True)
        convert_hf(folder, out, vocab_only=vocab_only)
    return out


def vocab_gguf(target: Path, cache: Path) -> Path:
    """A GGUF holding the target's vocabulary and shape: a target GGUF as it is; a Hugging
    Face folder converted once (vocabulary only) with llama.cpp's converter."""
    if target.is_file():
        return target
    if (target / "config.json").is_file():
        return cached_hf_gguf(target, cache, vocab_only=True)
    msg = f"{target}: neither a GGUF file nor a Hugging Face model folder (config.json)"
    raise ConfigError(msg)


def target_vocab(kind: str, path: str, cache_dir: str = "") -> Path:
    """A GGUF with the vocabulary and shape of a config's target (`target.kind`, `.path`)."""
    from dflash.model.loading import cache_root, resolve_gguf

    target = resolve_gguf(path) if kind == "gguf" else Path(path).expanduser()
    return vocab_gguf(target, cache_root(cache_dir))


def gguf_export_problem(kind: str, path: str, layer_ids: Sequence[int] | None) -> str | None:
    """Why a run's end could not write its drafter as GGUF beside this `gguf` target (its
    architecture, a last-layer capture in `target.layer_ids`), read from the file's header
    before training; None when nothing is wrong or it cannot be told yet."""
    from dflash.model.export_gguf import HOOKED_ARCHS, read_target_gguf
    from dflash.model.loading import resolve_gguf

    if kind != "gguf":
        return None
    target = read_target_gguf(resolve_gguf(path))
    if target.arch not in HOOKED_ARCHS:
        return f"llama.cpp cannot give a drafter the hidden states of a {target.arch!r} target"
    if layer_ids and max(layer_ids) >= target.num_layers - 1:
        return f"target.layer_ids reads layer {max(layer_ids)}, the last; llama.cpp hooks layer inputs only"
    return None


def spec_args(drafter_gguf: Path, family: str, drafts: int, confidence: float = 0.0) -> list[str]:
    """llama-server's flags that draft with this drafter."""
    args = ["-md", str(drafter_gguf), "--spec-type", "draft-dspark" if family == "dspark" else "draft-dflash",
            "--spec-draft-n-max", str(drafts)]  # fmt: skip
    if family == "dspark" and confidence > 0:
        args += ["--spec-draft-p-min", f"{confidence:g}"]
    return args


def serve_command(
    target_gguf: Path | str, drafter_gguf: Path | str, family: str, drafts: int, p_min: float | None = None
) -> str:
    """The llama-server command that serves the target with this drafter: `make llamacpp`'s
    server (where it is or will be built; relative to here when below), at most `drafts` drafted
    tokens a step, each with at least `p_min` probability (None: llama.cpp's default)."""
    binary = server_binary()
    with contextlib.suppress(ValueError):
        binary = binary.relative_to(Path.cwd())
    flags = spec_args(Path(drafter_gguf), family, drafts)
    if p_min is not None:
        flags += ["--spec-draft-p-min", f"{p_min:g}"]
    return f"{binary} -m {target_gguf} {' '.join(flags)}"


def _prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _prctl()  # looked up here: the child only calls it (nothing loads between fork and exec)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


class Server:
    """A running `llama-server` on loopback, stopped by `close` (or leaving the `with` block,
    however it is left). `port=None`: the server binds a free port itself (`--port 0`) and its
    log says which."""

    START_TIMEOUT_S = 300.0

    def __init__(self, target_gguf: Path, extra: Sequence[str] = (), ctx: int = 2048, port: int | None = None,
                 threads: int | None = None) -> None:  # fmt: skip
        self.binary = require_llamacpp()
        fd, name = tempfile.mkstemp(prefix="dflash-llama-server-", suffix=".log")
        os.close(fd)
        self.log, self.port = Path(name), port
        self.proc: subprocess.Popen[bytes] | None = None
        cmd = [str(self.binary), "-m", str(target_gguf), *extra, "--metrics", "--host", "127.0.0.1",
               "--port", str(port or 0), "-c", str(ctx), "-np", "1", "-t", str(threads or _cpus()),
               "--no-webui"]  # fmt: skip
        try:
            why = self._start(cmd)
        except BaseException:
            self.close()
            raise
        if why is not None:
            self.close()
            msg = f"llama-server did not start ({why})"
            raise DFlashError(msg)

    def _start(self, cmd: list[str]) -> str | None:
        import httpx

        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exit code {self.proc.returncode}: {self.last_words()}"
            if self.port is None:
                found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log.read_text(errors="replace"))
                self.port = int(found.group(1)) if found else None
            if self.port is not None:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).status_code == 200:
                        return None
            time.sleep(0.2)
        return f"not ready after {self.START_TIMEOUT_S:.0f} s: {self.last_words()}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def last_words(self) -> str:
        """The server log's last error line (or last line)."""
        try:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        errors = [ln for ln in lines if re.search(r"couldn't bind|error|failed|abort|assert|exception", ln, re.I)]
        bind = [ln for ln in errors if "couldn't bind" in ln]  # before its "exiting due to HTTP server error"
        return (bind or errors or lines or ["no log"])[-1][:300]

    def _call(self, method: str, path: str, **kwargs: object) -> object:
        import httpx

        try:
            r = httpx.request(method, f"{self.url}{path}", timeout=600.0, trust_env=False, **kwargs)  # type: ignore[arg-type]
            r.raise_for_status()
        except httpx.HTTPError as err:
            time.sleep(0.2)  # a dying server: let it exit, to say so
            code = self.proc.poll() if self.proc else None
            if code is not None:
                msg = f"llama-server died mid-eval (exit code {code}): {self.last_words()}"
                raise DFlashError(msg) from None
            msg = f"llama-server: {path} failed: {err}"
            raise DFlashError(msg) from None
        return r.json() if path != "/metrics" else r.text

    def complete(self, prompt: Sequence[int], max_new: int) -> tuple[list[int], str, dict]:
        """Greedy generation from token ids: (the generated ids, why it stopped, the server's
        timings: `predicted_n`, `predicted_ms`, ...)."""
        body = {"prompt": list(prompt), "n_predict": max_new, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True}  # fmt: skip
        out = self._call("POST", "/completion", json=body)
        assert isinstance(out, dict)
        return [int(t) for t in out.get("tokens", [])], str(out.get("stop_type", "")), dict(out.get("timings", {}))

    def counters(self) -> _Counters:
        """The spec-decode counters of `/metrics` (`--metrics`)."""
        totals: dict[str, int] = {}
        per_pos: dict[int, int] = {}
        for line in str(self._call("GET", "/metrics")).splitlines():
            m = re.fullmatch(r'llamacpp:spec_decode_(\w+?)(?:\{position="(\d+)"\})?\s+([0-9.eE+-]+)', line.strip())
            if m and m.group(2) is not None:
                per_pos[int(m.group(2))] = int(float(m.group(3)))
            elif m:
                totals[m.group(1)] = int(float(m.group(3)))
        positions = tuple(per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1))
        return _Counters(
            totals.get("num_drafts_total", 0), totals.get("num_draft_tokens_total", 0),
            totals.get("num_accepted_tokens_total", 0), positions,
        )  # fmt: skip

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Counters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: tuple[int, ...] = ()

    def __sub__(self, o: _Counters) -> _Counters:
        n = max(len(self.per_pos), len(o.per_pos))
        pad = lambda t: (*t, *([0] * (n - len(t))))  # noqa: E731
        return _Counters(self.drafts - o.drafts, self.draft_tokens - o.draft_tokens, self.accepted - o.accepted,
                         tuple(a - b for a, b in zip(pad(self.per_pos), pad(o.per_pos), strict=True)))  # fmt: skip


def decode(
    target_gguf: Path,
    sets: Sequence[Sequence[Sequence[int]]],
    max_new: int,
    extra: Sequence[str] = (),
    ctx: int = 2048,
) -> list[EngineRun]:
    """Every prompt set decoded greedily in one llama-server (with `extra`: the drafter's
    flags), one prompt at a time; each set's counters are its own, its tokens/s the server's
    (generated tokens over generation time, prompt processing and requests excluded)."""
    runs = []
    with Server(target_gguf, extra, ctx=ctx) as server:
        for prompts in sets:
            before, t0 = server.counters(), time.perf_counter()
            done = [server.complete(p, max_new) for p in prompts]
            seconds, c = time.perf_counter() - t0, server.counters() - before
            outputs, stops = [o for o, _, _ in done], [s for _, s, _ in done]
            ms = sum(float(t.get("predicted_ms", 0.0)) for _, _, t in done)
            rate = round(1000 * sum(int(t.get("predicted_n", 0)) for _, _, t in done) / ms, 1) if ms else None
            runs.append(EngineRun(outputs, c.drafts, c.draft_tokens, c.accepted, list(c.per_pos), seconds, stops, rate))
    return runs
