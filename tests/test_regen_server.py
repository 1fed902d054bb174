"""`regen.server`: the replies come from an OpenAI-compatible server, here a fake one in a
thread (`ThreadingHTTPServer` on 127.0.0.1) that answers `/v1/models` and
`/v1/chat/completions` with "sure " + the last user message. The same prompts, held-out split
and records as the local loop; resume asks only for what is unanswered; an unreachable URL,
an error status or a malformed answer is one line, and every reply written before it is kept;
a prompt the server refuses is skipped with a warning record; passing failures are tried
again; regen.max_minutes, an error and Ctrl-C end the regen at once, with requests in flight.

The tests decide by what the fake was asked (exact counts, events when it has read N
requests); every wait has a generous limit that only keeps a broken regen from hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dflash.config import Config, load_config
from dflash.data.prompts import load_prompts
from dflash.errors import ConfigError, DFlashError
from dflash.regen import regenerate, server
from dflash.regen.server import ChatServer
from tests.conftest import ForkedPopen
from tests.test_regen_files import NUM_TRAIN, _tokenizer, regen_setup

ROOT = Path(__file__).resolve().parents[1]
MODEL = "fake-model"
HANG_GUARD_S = 120  # the longest any wait here may take: only a broken regen reaches it


@dataclass
class Fake:
    """What the fake server answers, and what it was asked."""

    fail_after: int | None = None  # chat requests answered before every next one fails
    fail_status: int = 500
    fail_body: str = '{"error": "boom: the engine died"}'
    refuse: str | None = None  # prompts whose last user message holds this word: 400, too long
    passing: list[int] = field(default_factory=list)  # the first chat requests' statuses (0: dropped)
    hang: Callable[[int], bool] | None = None  # chat requests (1, 2, ...) left unanswered until `release`
    release: threading.Event = field(default_factory=threading.Event)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    let_go: int = 0  # hung requests that `release` ended
    lock: threading.Condition = field(default_factory=threading.Condition)

    def reply(self, body: dict[str, Any]) -> tuple[int, str] | None:
        """The status and body answered; None: the connection closed without an answer."""
        with self.lock:
            self.bodies.append(body)
            n = len(self.bodies)
            self.lock.notify_all()
        if self.hang is not None and self.hang(n):
            self.release.wait(HANG_GUARD_S)
            with self.lock:
                self.let_go += 1
            return None
        if n <= len(self.passing):
            return None if self.passing[n - 1] == 0 else (self.passing[n - 1], '{"error": "busy"}')
        if self.fail_after is not None and n > self.fail_after:
            return self.fail_status, self.fail_body
        if self.refuse is not None and self.refuse in _last_user(body["messages"]):
            message = "This model's maximum context length is 16 tokens. However, you requested 99 tokens."
            return 400, json.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}})  # vLLM's
        if body.get("model") != MODEL:
            return 404, json.dumps({"error": f"The model `{body.get('model')}` does not exist."})
        last = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        message = {"role": "assistant", "content": f" sure {last}\n"}
        return 200, json.dumps({"id": str(n), "choices": [{"index": 0, "message": message}]})

    def asked(self, n: int) -> bool:
        """Whether the fake has read `n` chat requests (now)."""
        with self.lock:
            return len(self.bodies) >= n

    def wait_asked(self, n: int, unless: Callable[[], bool] = lambda: False) -> bool:
        """Waits until the fake has read `n` chat requests (True), or `unless()` holds when
        woken (`wake`): False."""
        with self.lock:
            self.lock.wait_for(lambda: len(self.bodies) >= n or unless(), HANG_GUARD_S)
            return len(self.bodies) >= n

    def wake(self) -> None:
        with self.lock:
            self.lock.notify_all()

    def still_hung(self) -> bool:
        """No hung request has been let go: whoever ended did not wait for one."""
        with self.lock:
            return self.let_go == 0


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
            answer = fake.reply(body) if self.path == "/v1/chat/completions" else (404, "{}")
            if answer is None:
                self.close_connection = True
                return
            self._send(*answer)

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    return Handler


@contextlib.contextmanager
def _serving(state: Fake) -> Iterator[str]:
    """`state` served in a thread; its URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.handle_error = lambda *_: None  # a client gone before its answer: nothing to report
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        state.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.fixture
def fake() -> Iterator[tuple[Fake, str]]:
    """A fake server and its URL, for one test."""
    state = Fake()
    with _serving(state) as url:
        yield state, url


@pytest.fixture(autouse=True)
def _quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChatServer, "backoff_s", 0.01)


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
    from dflash.config import TinyTargetConfig
    from dflash.model.loading import load_tokenizer
    from dflash.model.target import build_tiny

    root = tmp_path_factory.mktemp("regen_server")
    tok = _tokenizer()
    path = regen_setup(root, build_tiny(TinyTargetConfig(vocab_size=len(tok))), tok, batch_size=3)
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
    assert held == [{"id": i, "messages": p[0]} for i, p in enumerate(prompts.held)]
    assert sorted(r["id"] for r in records) == list(range(NUM_TRAIN))
    for r in records:
        assert r["messages"][:-1] == prompts.train[r["id"]][0]
        assert r["messages"][-1] == {"role": "assistant", "content": f"sure {_last_user(r['messages'][:-1])}"}
    # what was asked: the first listed model, the prompt so far, regen's settings
    for body in state.bodies:
        assert body["model"] == MODEL and [body["messages"]] in prompts.train
        assert (body["max_tokens"], body["temperature"], body["repetition_penalty"]) == (12, 0.0, 1.0)
        assert body["seed"] == prompts.train.index([body["messages"]])  # regen.seed (0) + the prompt's number
        assert "chat_template_kwargs" not in body
    assert stats["refused"] == stats["unanswered"] == 0
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
    train = load_prompts(cfg).train
    for body in state.bodies:  # each prompt's seed: regen.seed + its index, whatever the requests in flight
        assert (body["temperature"], body["seed"]) == (0.7, 5 + train.index([body["messages"]]))
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert all(r["chat_template_kwargs"] == {"enable_thinking": False} for r in _records(cfg))


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [(500, '{"error": "boom: the engine died"}', "server error, HTTP 500: boom: the engine died (tried 4 times)"),
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
    _regen_threads_end()  # the requests in flight when the error came are cancelled
    again = Fake()  # a server of its own: a cancelled request read late by the first is not counted
    with _serving(again) as url_again:
        stats = regenerate(env.cfg(f"mid_{status}", f'regen.server="{url_again}"'), None, env.tokenizer, progress=False)
    assert (stats["resumed_from"], stats["generated"]) == (len(kept), NUM_TRAIN - len(kept))
    assert len(again.bodies) == NUM_TRAIN - len(kept)
    assert sorted(r["id"] for r in _records(cfg)) == list(range(NUM_TRAIN))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_one_line_and_writes_nothing(env):
    url = f"http://127.0.0.1:{_closed_port()}"
    env_vars = {k: v for k, v in os.environ.items() if k not in {"DFLASH_DEBUG", "DFLASH_INJECT_FAULT"}}
    env_vars.update(HOME=str(env.root), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    args = ["regen", str(env.config), "--set", 'run.name="down"', "--set", f'regen.server="{url}"']
    pipe = subprocess.PIPE  # `bin/dflash`, forked from the tests' server (conftest.ForkedPopen)
    proc = ForkedPopen([str(ROOT / "bin" / "dflash"), *args], args, env_vars, env.root, pipe, pipe)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, stderr
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


def test_a_prompt_the_server_refuses_is_skipped_with_a_warning(env, fake):
    """A 4xx about one prompt (longer than the server's context): a warning record naming it
    and the server's message, the other prompts answered; a later regen asks only it again."""
    from structlog.testing import capture_logs

    state, url = fake
    state.refuse = "moon"
    cfg = env.cfg("refuse", f'regen.server="{url}"')
    train = load_prompts(cfg).train
    moons = sorted(i for i, p in enumerate(train) if "moon" in _last_user(p[0]))
    assert 0 < len(moons) < NUM_TRAIN - 8
    with capture_logs() as logs:
        stats = regenerate(cfg, None, env.tokenizer, progress=False)
    assert (stats["refused"], stats["generated"], stats["unanswered"]) == (len(moons), NUM_TRAIN - len(moons), 0)
    warnings = [w for w in logs if w["event"] == "warning"]
    assert sorted(w["prompt_id"] for w in warnings) == moons
    for w in warnings:
        i = w["prompt_id"]
        assert f"prompt {i} ('{_last_user(train[i][0])}') skipped" in w["message"] and url in w["message"]
        assert "refused, HTTP 400: This model's maximum context length is 16 tokens" in w["message"]
    assert sorted(r["id"] for r in _records(cfg)) == sorted(set(range(NUM_TRAIN)) - set(moons))
    state.refuse, asked = None, len(state.bodies)
    again = regenerate(cfg, None, env.tokenizer, progress=False)
    assert (again["generated"], len(state.bodies) - asked) == (len(moons), len(moons))


def test_a_server_refusing_every_prompt_stops_in_one_line(env, fake):
    state, url = fake
    state.refuse = "the"  # every prompt
    cfg = env.cfg("refuse_all", f'regen.server="{url}"')
    with pytest.raises(DFlashError, match=r"refused, HTTP 400: .*the first 8 prompts were all refused") as err:
        regenerate(cfg, None, env.tokenizer, progress=False)
    assert "\n" not in str(err.value) and url in str(err.value)


def test_passing_failures_are_asked_again(env, fake):
    """5xx, 429 and a dropped connection: the same request again (with backoff), no reply lost."""
    state, url = fake
    state.passing = [503, 0, 429]
    cfg = env.cfg("passing", f'regen.server="{url}"', "regen.batch_size=1")
    stats = regenerate(cfg, None, env.tokenizer, progress=False)
    assert stats["generated"] == NUM_TRAIN and len(state.bodies) == NUM_TRAIN + 3
    assert state.bodies[0] == state.bodies[1] == state.bodies[2] == state.bodies[3]  # one request, four tries
    assert sorted(r["id"] for r in _records(cfg)) == list(range(NUM_TRAIN))


def test_no_answer_within_the_time_limit_is_not_asked_again(env, fake):
    """A request the server does not answer within regen.server_timeout_s: one line, and the
    request is not tried again (the server would generate the same long reply)."""
    state, url = fake
    state.hang = lambda n: n == 1
    cfg = env.cfg("slow", f'regen.server="{url}"', "regen.server_timeout_s=0.5", "regen.batch_size=1")
    with pytest.raises(DFlashError) as err:
        regenerate(cfg, None, env.tokenizer, progress=False)
    says = "no answer within 0.5 s (raise regen.server_timeout_s)"
    assert str(err.value) == f"regen.server {url}: POST /v1/chat/completions: {says}"
    assert len(state.bodies) == 1 and state.still_hung()
    _regen_threads_end()


def _regen_threads_end() -> None:
    threads = [t for t in threading.enumerate() if t.name.startswith("regen-server")]
    assert all(t.daemon for t in threads)  # never keep the process alive
    for t in threads:
        t.join(HANG_GUARD_S)
    assert not [t for t in threads if t.is_alive()]


class _ClockAt:
    """The server replier's clock: still until the fake has read `n` requests, then far past
    any deadline. So a regen.max_minutes deadline falls exactly after those requests."""

    def __init__(self, state: Fake, n: int) -> None:
        self.state, self.n, self.still = state, n, time.perf_counter()

    def perf_counter(self) -> float:
        return time.perf_counter() + 1e6 if self.state.asked(self.n) else self.still


def test_max_minutes_cancels_the_requests_in_flight(env, fake, monkeypatch):
    """At regen.max_minutes the regen ends at once: the replies back are written, the requests
    in flight cancelled (their connections closed), a later regen answers the rest. The
    deadline passes once the fake has read 8 requests: the first 5 answered, the next 3 hung
    (one in each of regen.batch_size = 3 workers, so the 5 before are back)."""
    state, url = fake
    state.hang = lambda n: n > 5
    cfg = env.cfg("deadline", f'regen.server="{url}"', "regen.max_minutes=0.01")
    with monkeypatch.context() as m:
        m.setattr(server, "time", _ClockAt(state, 8))
        stats = regenerate(cfg, None, env.tokenizer, progress=False)
    assert state.still_hung()  # it ended without waiting for the hung requests (server_timeout_s: 600 s)
    assert (stats["generated"], stats["unanswered"]) == (5, NUM_TRAIN - 5) == (len(_records(cfg)), NUM_TRAIN - 5)
    _regen_threads_end()
    state.hang = None
    again = regenerate(env.cfg("deadline", f'regen.server="{url}"'), None, env.tokenizer, progress=False)
    assert (again["resumed_from"], again["generated"]) == (5, NUM_TRAIN - 5)
    assert sorted(r["id"] for r in _records(cfg)) == list(range(NUM_TRAIN))


def test_an_error_ends_the_regen_at_once_with_requests_in_flight(env, fake):
    """A request failing for good, wherever it is in flight, ends the regen without waiting for
    the others (here never answered)."""
    state, url = fake
    state.hang = lambda n: n != 2
    state.fail_after, state.fail_status = 1, 404
    cfg = env.cfg("fail_fast", f'regen.server="{url}"')
    with pytest.raises(DFlashError, match=r"refused, HTTP 404"):
        regenerate(cfg, None, env.tokenizer, progress=False)
    assert state.still_hung()
    _regen_threads_end()


def test_ctrl_c_exits_at_once_with_requests_in_flight(env, fake):
    state, url = fake
    state.hang = lambda n: True
    env_vars = {k: v for k, v in os.environ.items() if k not in {"DFLASH_DEBUG", "DFLASH_INJECT_FAULT"}}
    env_vars.update(HOME=str(env.root), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    args = [str(ROOT / "bin" / "dflash"), "regen", str(env.config), "--set", 'run.name="ctrl_c"',
            "--set", f'regen.server="{url}"']  # fmt: skip
    # SIGINT back to its default in the child: a parent that ignores it (a job started in the
    # background) would have Python ignore it too.
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_vars, cwd=env.root,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    threading.Thread(target=lambda: (proc.wait(), state.wake()), daemon=True).start()  # an early exit wakes the wait
    try:
        assert state.wait_asked(3, unless=lambda: proc.poll() is not None), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert state.still_hung()  # it exited without waiting for a request in flight
    assert proc.returncode == 130 and "regen interrupted" in err, err


def test_server_refuses_save_features(env):
    with pytest.raises(ConfigError, match=r"regen\.server with regen\.save_features") as err:
        env.cfg("x", 'regen.server="http://127.0.0.1:1"', "regen.save_features=true")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"regen\.server: not an http"):
        env.cfg("x", 'regen.server="localhost:8000"')


def test_a_server_answers_every_turn_with_its_own_replies_in_context(env, fake):
    """Multi-turn chats: turn 2 is asked with the server's own reply to turn 1; the tools of an
    agent's conversation go with its requests (tool_choice none: a text reply); a conversation
    stopped mid-way (the server fails) resumes at its next turn, no turn asked twice."""
    state, url = fake
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    chats = env.root / "turns.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"tell me about the {w} sea"},
                           {"role": "assistant", "content": "no"}, {"role": "user", "content": f"why {w}"}],
              **({"tools": tools} if w == "red" else {})} for w in ("red", "blue", "green", "one")]  # fmt: skip
    chats.write_text("".join(json.dumps(c) + "\n" for c in lines), encoding="utf-8")
    cfg = env.cfg("turns", f'regen.server="{url}"', f"regen.prompts={json.dumps(str(chats))}", "regen.holdout=0",
                  "regen.batch_size=1")  # fmt: skip
    state.fail_after = 5  # four first turns, one second: then the server fails
    with pytest.raises(DFlashError):
        regenerate(cfg, None, env.tokenizer, progress=False)
    assert sorted(r["turn"] for r in _records(cfg)) == [1, 1, 1, 1, 2]
    state.fail_after, asked = None, len(state.bodies)
    again = regenerate(cfg, None, env.tokenizer, progress=False)
    assert (again["resumed_from"], again["generated"], len(state.bodies) - asked) == (5, 3, 3)
    records = _records(cfg)
    assert sorted((r["id"], r["turn"]) for r in records) == [(i, k) for i in range(4) for k in (1, 2)]
    for r in (r for r in records if r["turn"] == 2):
        first, reply = r["messages"][0]["content"], r["messages"][1]
        assert reply == {"role": "assistant", "content": f"sure {first}"}  # the server's own, not the file's "no"
        assert r.get("tools") == (tools if "red" in first else None)
    red = [b for b in state.bodies if "red" in b["messages"][0]["content"]]
    assert red and all(b["tools"] == tools and b["tool_choice"] == "none" for b in red)
    assert all("tools" not in b for b in state.bodies if b not in red)
