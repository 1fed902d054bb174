"""`regen.server`: the replies come from an OpenAI-compatible server, here a fake one in a
thread (`ThreadingHTTPServer` on 127.0.0.1) that answers `/v1/models` and
`/v1/chat/completions` with "sure " + the last user message. The same prompts, held-out split
and records as the local loop; resume asks only for what is unanswered; an unreachable URL,
an error status or a malformed answer is one line, and every reply written before it is kept.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dflash.config import Config, load_config
from dflash.data.prompts import load_prompts
from dflash.errors import ConfigError, DFlashError
from dflash.regen import regenerate
from tests.test_regen_files import HOLDOUT, NUM_TRAIN, _conversations, _tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "fake-model"


@dataclass
class Fake:
    """What the fake server answers, and what it was asked."""

    fail_after: int | None = None  # chat requests answered before every next one fails
    fail_status: int = 500
    fail_body: str = '{"error": "boom: the engine died"}'
    bodies: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reply(self, body: dict[str, Any]) -> tuple[int, str]:
        with self.lock:
            self.bodies.append(body)
            n = len(self.bodies)
        if self.fail_after is not None and n > self.fail_after:
            return self.fail_status, self.fail_body
        if body.get("model") != MODEL:
            return 404, json.dumps({"error": f"The model `{body.get('model')}` does not exist."})
        last = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        message = {"role": "assistant", "content": f" sure {last}\n"}
        return 200, json.dumps({"id": str(n), "choices": [{"index": 0, "message": message}]})


def _handler(fake: Fake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, text: str) -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL}, {"id": "other"}]}))
            else:
                self._send(404, "{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send(*fake.reply(body) if self.path == "/v1/chat/completions" else (404, "{}"))

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    return Handler


@pytest.fixture
def fake() -> Iterator[tuple[Fake, str]]:
    """A fake server and its URL, for one test."""
    state = Fake()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@dataclass
class Env:
    root: Path
    config: Path
    tokenizer: Any

    def cfg(self, name: str, *overrides: str) -> Config:
        return load_config(self.config, [f'run.name="{name}"', *overrides])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    """A tiny HF folder (its tokenizer is all a server run uses), a prompt file, a config."""
    import tomli_w

    from dflash.config import TinyTargetConfig
    from dflash.model.loading import load_tokenizer
    from dflash.model.target import build_tiny

    root = tmp_path_factory.mktemp("regen_server")
    tok = _tokenizer()
    build_tiny(TinyTargetConfig(vocab_size=len(tok))).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in _conversations()), encoding="utf-8")
    config = {
        "run": {"name": "main", "output_dir": str(root / "runs"), "seed": 0},
        "target": {"kind": "hf", "path": str(root / "model"), "stop_token": "<|im_end|>"},
        "regen": {"prompts": str(prompts), "holdout": HOLDOUT, "max_new_tokens": 12, "batch_size": 3},
        "data": {"cache_dir": str(root / "cache")},
    }
    path = root / "regen.toml"
    path.write_text(tomli_w.dumps(config), encoding="utf-8")
    cfg = load_config(path)
    return Env(root, path, load_tokenizer(cfg.target, cfg.data.cache_dir))


def _records(cfg: Config) -> list[dict[str, Any]]:
    return [json.loads(line) for line in cfg.regen_output.read_text(encoding="utf-8").splitlines()]


def _last_user(messages: list[dict[str, str]]) -> str:
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


def test_server_writes_the_replies_with_the_local_split_and_resumes(env, fake):
    state, url = fake
    cfg = env.cfg("main", f'regen.server="{url}/v1/"')
    stats = regenerate(cfg, None, env.tokenizer, progress=False)
    prompts = load_prompts(cfg)
    records = _records(cfg)
    assert stats["generated"] == len(records) == len(state.bodies) == NUM_TRAIN
    assert stats["server"] == f"{MODEL} at {url}" and stats["target_dtype"] is None
    # the local loop's split: the held-out file, and every training prompt answered once
    held = [json.loads(line) for line in cfg.regen_heldout.read_text(encoding="utf-8").splitlines()]
    assert held == [{"id": i, "messages": p} for i, p in enumerate(prompts.held)]
    assert sorted(r["id"] for r in records) == list(range(NUM_TRAIN))
    for r in records:
        assert r["messages"][:-1] == prompts.train[r["id"]]
        assert r["messages"][-1] == {"role": "assistant", "content": f"sure {_last_user(r['messages'][:-1])}"}
    # what was asked: the first listed model, the prompt so far, regen's settings
    body = state.bodies[0]
    assert body["model"] == MODEL and body["messages"] in prompts.train
    assert (body["max_tokens"], body["temperature"], body["seed"]) == (12, 0.0, 0)
    assert "chat_template_kwargs" not in body
    assert stats["new_tokens"] == sum(
        len(env.tokenizer(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"]) for r in records
    )
    # resume: nothing left to ask
    again = regenerate(cfg, None, env.tokenizer, progress=False)
    assert (again["generated"], again["resumed_from"], len(state.bodies)) == (0, NUM_TRAIN, NUM_TRAIN)


def test_server_options_reach_the_server(env, fake):
    """server_model, sampling and chat template options go in each request, and the records
    keep the template options as the local loop's do."""
    state, url = fake
    kwargs = "data.chat_template_kwargs={enable_thinking = false}"
    cfg = env.cfg("options", f'regen.server="{url}"', f'regen.server_model="{MODEL}"', "regen.temperature=0.7",
                  "regen.seed=5", "regen.max_prompts=8", kwargs)  # fmt: skip
    stats = regenerate(cfg, None, env.tokenizer, progress=False)
    assert stats["generated"] == 8 == len(state.bodies)  # max_prompts counts training prompts
    for body in state.bodies:
        assert (body["temperature"], body["seed"]) == (0.7, 5)
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert all(r["chat_template_kwargs"] == {"enable_thinking": False} for r in _records(cfg))


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [(500, '{"error": "boom: the engine died"}', 'server error, HTTP 500: {"error": "boom'),
     (200, "<html>" + "x" * 400, "HTTP 200 but not JSON: <html>xxx")],
    ids=["http_500", "not_json"],
)  # fmt: skip
def test_a_failure_mid_run_keeps_the_replies_written(env, fake, status, body, says):
    """Every reply received before the failure stays in the output; a resume asks the rest."""
    state, url = fake
    state.fail_after, state.fail_status, state.fail_body = 7, status, body
    cfg = env.cfg(f"mid_{status}", f'regen.server="{url}"')
    with pytest.raises(DFlashError) as err:
        regenerate(cfg, None, env.tokenizer, progress=False)
    line = str(err.value)
    assert "\n" not in line and url in line and "POST /v1/chat/completions" in line and says in line
    assert len(line) < 400  # the body's first 200 characters, no more
    kept = _records(cfg)
    assert 1 <= len(kept) <= 7 and all(r["messages"][-1]["content"].startswith("sure ") for r in kept)
    for t in threading.enumerate():  # requests still in flight when the error came end on their own
        if t.name.startswith("regen-server"):
            t.join(10)
    state.fail_after, asked = None, len(state.bodies)
    stats = regenerate(cfg, None, env.tokenizer, progress=False)
    assert (stats["resumed_from"], stats["generated"]) == (len(kept), NUM_TRAIN - len(kept))
    assert len(state.bodies) - asked == NUM_TRAIN - len(kept)
    assert sorted(r["id"] for r in _records(cfg)) == list(range(NUM_TRAIN))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_one_line_and_writes_nothing(env):
    url = f"http://127.0.0.1:{_closed_port()}"
    env_vars = {k: v for k, v in os.environ.items() if k not in {"DFLASH_DEBUG", "DFLASH_INJECT_FAULT"}}
    env_vars.update(HOME=str(env.root), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    args = [str(ROOT / "bin" / "dflash"), "regen", str(env.config), "--set", 'run.name="down"',
            "--set", f'regen.server="{url}"']  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=env_vars, cwd=env.root, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"dflash: error: regen.server {url}: GET /v1/models: unreachable (")
    assert not env.cfg("down").run_dir.exists()


def test_a_refused_request_is_one_line(env, fake):
    """An unknown model: the server's 4xx and its message, no reply written."""
    _, url = fake
    cfg = env.cfg("refused", f'regen.server="{url}"', 'regen.server_model="nope"')
    with pytest.raises(DFlashError, match=r"refused, HTTP 404: .*The model `nope` does not exist") as err:
        regenerate(cfg, None, env.tokenizer, progress=False)
    assert "\n" not in str(err.value)
    assert not cfg.regen_output.exists() or _records(cfg) == []


def test_server_refuses_save_features(env):
    with pytest.raises(ConfigError, match=r"regen\.server with regen\.save_features") as err:
        env.cfg("x", 'regen.server="http://127.0.0.1:1"', "regen.save_features=true")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"regen\.server: not an http"):
        env.cfg("x", 'regen.server="localhost:8000"')
