"""An OpenAI-compatible chat server (vLLM, SGLang, llama.cpp's server) as regen's engine.

`ChatServer` asks it through one `httpx` client (its connections kept alive, shared by the
daemon threads of a `RequestPool`: regen keeps a few requests in flight). Every failure is a
`ServerError`, one line naming the URL and the cause: unreachable (refused, no such host,
timeout), an HTTP error status (with the server's message, at most 200 characters), or an
answer that is not a chat completion. A request that failed for a passing cause (HTTP 5xx,
408 or 429, a connection refused or lost) is tried again `ChatServer.retries` times (tenacity),
waiting `backoff_s`, then twice that, ...; no answer within the time limit is not tried again
(the server would generate the same long reply). A 4xx other than 401, 403, 404, 405, 408 and
429 refuses that one request (e.g. a prompt longer than the server's context):
`ServerError.refused`. `ChatServer.abort` ends every request at once: those waiting fail, those
in flight lose their connection (the server stops generating for them).

`ServerReplier` is regen's replier over it (see its docstring).
"""

from __future__ import annotations

import collections
import json
import queue
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import httpx
import structlog
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from dflash.config import Config
from dflash.data.prompts import Messages
from dflash.errors import DFlashError
from dflash.regen.replier import Output, Todo, seed_number

__all__ = ["ChatServer", "RequestPool", "ServerError", "ServerReplier"]

_BODY_CHARS = 200
_NOT_PER_REQUEST = frozenset({401, 403, 404, 405})  # the server's set-up, not one prompt: the same for all
_PASSING = frozenset({408, 429})
_CONNECTED = ("connection.connect_tcp.complete", "connection.start_tls.complete")  # httpcore's trace events

Reply = tuple[str, int | None]
Asked = Future[Reply]  # a server's reply to come: its text and token count


class ServerError(DFlashError):
    """The server cannot be reached, refused a request or answered something else.
    `status`: the HTTP status, when one came; `transient`: worth asking again."""

    def __init__(self, message: str, status: int | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.transient = transient

    @property
    def refused(self) -> bool:
        """This request refused (a 4xx about it); the next one may be answered."""
        s = self.status
        return s is not None and 400 <= s < 500 and s not in _NOT_PER_REQUEST and s not in _PASSING


def _one_line(text: str) -> str:
    return " ".join(text.split())[:_BODY_CHARS]


def _server_message(text: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}, {"error": ...},
    older vLLM's {"message": ...}), else the body."""
    try:
        body = json.loads(text)
        err = body.get("error", body)
    except (ValueError, AttributeError):
        return _one_line(text)
    msg = err.get("message") if isinstance(err, dict) else err
    return _one_line(msg if isinstance(msg, str) and msg else text)


class ChatServer:
    """`url` (with or without a trailing /v1), the model asked for (`model`, or the first the
    server lists) and each request's time limit in seconds (to connect, and between bytes of
    the answer). Proxies from the environment are not used."""

    retries = 3  # more tries of a request that failed for a passing cause
    backoff_s = 1.0  # the wait before the first of them; doubled before each next

    def __init__(self, url: str, model: str = "", timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.model = model
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # every connection's, for `abort`
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # the pool's workers bound them
        self._client = httpx.Client(timeout=timeout_s, limits=limits, trust_env=False)

    def connect(self) -> ChatServer:
        """Checks the server answers (GET /v1/models) and picks its first model when none was named."""
        listed = self._request("GET", "/v1/models")
        try:
            first = listed["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            first = None
        if not self.model:
            if not isinstance(first, str):
                msg = f"regen.server {self.url}: GET /v1/models lists no model: {_one_line(json.dumps(listed))}"
                raise ServerError(msg)
            self.model = first
        return self

    def chat(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> Reply:
        """The reply to `messages` (POST /v1/chat/completions with `options`: max_tokens,
        temperature, seed, ...) and the tokens it took, when the server counts them."""
        body = self._retrying("POST", "/v1/chat/completions", {"model": self.model, "messages": messages, **options})
        try:
            message = body["choices"][0]["message"]
            content = message.get("content") or ""
            if not isinstance(content, str):
                raise TypeError
        except (KeyError, IndexError, TypeError, AttributeError):
            msg = f"regen.server {self.url}: no choices[0].message.content in {_one_line(json.dumps(body))}"
            raise ServerError(msg) from None
        if message.get("reasoning_content"):
            msg = (
                f"regen.server {self.url}: the reply's reasoning came back apart (reasoning_content); "
                "start the server without a reasoning parser, so the reply holds all the target wrote"
            )
            raise ServerError(msg)
        usage = body.get("usage")
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return content, tokens if isinstance(tokens, int) else None

    def abort(self) -> None:
        """Ends every request: no more tries, and those in flight lose their connection."""
        self._stopped.set()
        with self._lock:
            socks = list(self._sockets)
        for sock in socks:
            _shut(sock)

    def close(self) -> None:
        """Every request ended (`abort`), the client's connections closed."""
        self.abort()
        self._client.close()

    def _retrying(self, method: str, path: str, payload: dict[str, Any]) -> Any:
        """`_request`, tried again after a passing failure (`retries` times, with backoff)."""
        tries = Retrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential(multiplier=self.backoff_s),
            retry=retry_if_exception(self._worth_again),
            sleep=self._stopped.wait,  # an abort ends the wait, and the next try is cancelled
            reraise=True,
        )
        try:
            return tries(self._request, method, path, payload)
        except ServerError as err:
            n = tries.statistics.get("attempt_number", 1)
            if n > 1:
                raise ServerError(f"{err} (tried {n} times)", err.status, err.transient) from None
            raise

    def _worth_again(self, err: BaseException) -> bool:
        return isinstance(err, ServerError) and err.transient and not self._stopped.is_set()

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        """One request's JSON answer, or a one-line ServerError."""
        where = f"regen.server {self.url}: {method} {path}"
        if self._stopped.is_set():
            raise ServerError(f"{where}: cancelled")
        try:
            resp = self._client.request(method, self.url + path, json=payload, extensions={"trace": self._trace})
        except httpx.ConnectTimeout:
            raise ServerError(f"{where}: unreachable (no connection within {self.timeout_s:g} s)", None, True) from None
        except httpx.TimeoutException:  # not retried: the server would generate the same long reply again
            msg = f"{where}: no answer within {self.timeout_s:g} s (raise regen.server_timeout_s)"
            raise ServerError(msg, None, False) from None
        except httpx.TransportError as err:
            if self._stopped.is_set():
                raise ServerError(f"{where}: cancelled") from None
            if isinstance(err, httpx.ConnectError):
                raise ServerError(f"{where}: unreachable ({_one_line(str(err))})", None, True) from None
            msg = f"{where}: connection lost ({type(err).__name__}: {_one_line(str(err))})"
            raise ServerError(msg, None, True) from None
        status, text = resp.status_code, resp.content.decode("utf-8", "replace")
        if status >= 400:
            kind = "server error" if status >= 500 else "refused"
            msg = f"{where}: {kind}, HTTP {status}: {_server_message(text)}"
            raise ServerError(msg, status, status >= 500 or status in _PASSING)
        try:
            return json.loads(resp.content)
        except ValueError:
            raise ServerError(f"{where}: HTTP {status} but not JSON: {_one_line(text)}", status) from None

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        """httpx's trace of a request: each new connection's socket kept, so that `abort` can
        shut it (closing a socket does not wake a thread blocked reading it)."""
        if event not in _CONNECTED:
            return
        sock = info["return_value"].get_extra_info("socket")
        with self._lock:
            self._sockets.add(sock)
        if self._stopped.is_set():
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class RequestPool:
    """`workers` daemon threads (named regen-server-N) asking `server` for replies: a process
    that ends (an error, Ctrl-C) never waits for them. After a request fails for good (not a
    refusal of its prompt), no worker sends another: the queued ones are cancelled. `close`
    cancels what is queued and aborts what is in flight (`abort`)."""

    def __init__(self, server: ChatServer, workers: int) -> None:
        self.server = server
        self._jobs: queue.SimpleQueue[tuple[Future[Reply], list[dict[str, Any]], dict[str, Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._queued: set[Future[Reply]] = set()
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, name=f"regen-server-{k}", daemon=True) for k in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> Future[Reply]:
        fut: Future[Reply] = Future()
        with self._lock:
            self._queued.add(fut)
        self._jobs.put((fut, messages, options))
        return fut

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, messages, options = job
            with self._lock:
                self._queued.discard(fut)
            if self._failed.is_set():
                fut.cancel()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self.server.chat(messages, options))
            except BaseException as err:  # the caller reads it from the future
                if not (isinstance(err, ServerError) and err.refused):
                    self._failed.set()  # before the caller can see the error: nothing is sent after it
                fut.set_exception(err)

    def close(self, abort: bool = True) -> None:
        """The workers told to end; `abort`: what is queued cancelled, what is in flight aborted
        (the server takes no request after it)."""
        with self._lock:
            queued, self._queued = self._queued, set()
        for fut in queued:
            fut.cancel()
        if abort:
            self.server.abort()
        for _ in self._threads:
            self._jobs.put(None)


class ServerReplier:
    """regen.server: an OpenAI-compatible server writes the replies, `batch_size` requests in
    flight (the prompts in the local loop's order), each written as soon as those before it
    are; the output is flushed whenever the next reply is still pending. An error (a request
    failing after its tries, anywhere in flight), Ctrl-C or regen.max_minutes ends the regen at
    once: the replies already back are written, in any order, the requests in flight cancelled
    (a later regen asks them again). A server's tokens come back as text: the record holds that text,
    stripped, like the local loop's decoded reply (training tokenizes it with the target's chat
    template, as any chat file); its token count is the server's usage.completion_tokens, else
    the text re-tokenized. Greedy is asked as the local loop's raw argmax: temperature 0,
    repetition_penalty 1 (a server would otherwise apply the model's generation config); each
    request's seed is regen.seed + its conversation's index (offset per turn: `seed_number`), so
    sampled replies depend neither on the requests in flight nor on a resume. A prompt the server
    refuses (a 4xx about it, e.g. longer than its context) is skipped with a `warning` record; a
    later regen asks it again."""

    engine = "server"
    target_dtype = None
    start_s = 0.0

    def __init__(self, cfg: Config, server: ChatServer) -> None:
        self.chat_server = server
        self.server = f"{server.model} at {server.url}"
        r = cfg.regen
        self.batch_size, self.seed = r.batch_size, r.seed
        self.refused = self.answered = 0
        self.options: dict[str, Any] = {
            "max_tokens": r.max_new_tokens, "temperature": r.temperature, "repetition_penalty": 1.0,
        }  # fmt: skip
        if cfg.data.chat_template_kwargs:
            self.options["chat_template_kwargs"] = cfg.data.chat_template_kwargs

    @classmethod
    def connect(cls, cfg: Config) -> ServerReplier:
        """The replier over regen.server, once it answers GET /v1/models."""
        r = cfg.regen
        server = ChatServer(r.server, r.server_model, r.server_timeout_s)
        try:
            return cls(cfg, server.connect())
        except BaseException:
            server.close()
            raise

    def answer_all(self, queue: collections.deque[Todo], out: Output, budget_s: float) -> None:
        """The queued prompts, until the queue runs out or `budget_s` seconds pass: then the
        requests still pending are cancelled, the replies already back written."""
        deadline = time.perf_counter() + budget_s
        items = (i for batch in _drained(queue) for i, _ in batch)
        ahead = 4 * self.batch_size  # requests queued: the workers never wait on a slow head
        pending: collections.deque[tuple[int, Asked]] = collections.deque()
        pool = RequestPool(self.chat_server, self.batch_size)
        done = False
        try:
            while True:
                while len(pending) < ahead and time.perf_counter() < deadline and (i := next(items, None)) is not None:
                    pending.append((i, pool.submit(out.prompt(i), self._options(out, i))))
                if not pending:
                    done = True  # every request answered: nothing in flight to abort
                    return
                if not pending[0][1].done():
                    out.flush()
                if not _wait_head(pending, deadline):  # regen.max_minutes: what is back is kept, the rest asked later
                    self._write_finished(pending, out)
                    return
                i, reply = pending.popleft()
                self._take(out, i, reply)
        except BaseException:  # an error or Ctrl-C: the replies already back are kept too
            self._write_finished(pending, out)
            raise
        finally:
            out.flush()
            pool.close(abort=not done)

    def close(self) -> None:
        self.chat_server.close()

    def _options(self, out: Output, i: int) -> dict[str, Any]:
        """Prompt i's request options: regen's, its seed, and its conversation's tools (the
        server renders them as the template does here; tool_choice none: a text reply)."""
        tools = out.tools(i)
        seed = self.seed + seed_number(out, i)
        return {**self.options, "seed": seed, **({"tools": tools, "tool_choice": "none"} if tools else {})}

    def _take(self, out: Output, i: int, reply: Asked) -> None:
        """Training prompt i's reply written, or its refusal a warning record."""
        try:
            text, tokens = reply.result()
        except ServerError as err:
            if not err.refused:
                raise
            self._refuse(out, i, err)
            return
        out.write_text(i, text, tokens)
        self.answered += 1

    def _refuse(self, out: Output, i: int, err: ServerError) -> None:
        """A warning record naming the prompt and the server's message; but when every
        prompt asked so far was refused (at least `_REFUSED_FIRST`), the server refuses them
        all (a request option it does not take, ...): one line."""
        self.refused += 1
        if not self.answered and self.refused >= _REFUSED_FIRST:
            msg = f"{err}; the first {self.refused} prompts were all refused: no prompt is answered, stopping"
            raise ServerError(msg, err.status)
        words = " ".join(_last_user_text(out.prompt(i)).split())
        about = words[:60] + ("..." if len(words) > 60 else "")
        cid, turn = out.where(i)
        at = f" turn {turn}" if turn > 1 else ""
        message = f"regen: prompt {cid}{at} ({about!r}) skipped, {err}; a later regen asks it again"
        structlog.get_logger("dflash").warning("warning", message=message, prompt_id=cid, turn=turn)

    def _write_finished(self, pending: collections.deque[tuple[int, Asked]], out: Output) -> None:
        """The replies already back among `pending`, written whatever their order; refusals and
        failures are left for a later regen."""
        for i, reply in pending:
            if reply.done() and not reply.cancelled() and reply.exception() is None:
                self._take(out, i, reply)
        pending.clear()


def _drained(queue: collections.deque[Todo]) -> Iterator[Todo]:
    """The queue's batches, each taken off it as it is reached (what is left: not yet asked)."""
    while queue:
        yield queue.popleft()


_REFUSED_FIRST = 8  # refusals before any reply that stop a server regen
_WAKE_S = 0.2  # the longest the main thread waits for replies before it looks at signals


def _failed(reply: Asked) -> bool:
    """A reply that failed for good, not a refusal of its prompt alone."""
    if not reply.done() or reply.cancelled():
        return False
    err = reply.exception()
    return err is not None and not (isinstance(err, ServerError) and err.refused)


def _wait_head(pending: collections.deque[tuple[int, Asked]], deadline: float) -> bool:
    """Waits for the first pending reply until `deadline` (perf_counter): True when it is back.
    A request failing for good meanwhile, wherever it is in the queue, raises its error at
    once (the server is down or broken: no use waiting for the others)."""
    head = pending[0][1]
    waiting = []
    for _, reply in pending:
        if _failed(reply):
            reply.result()
        if not reply.done():
            waiting.append(reply)
    while not head.done():
        left = deadline - time.perf_counter()
        if left <= 0:
            return False
        # In slices: a signal the kernel hands to a worker thread would not wake an endless wait
        # in the main thread, and Python runs its handler only when the main thread wakes.
        done, not_done = futures.wait(waiting, min(left, _WAKE_S), futures.FIRST_COMPLETED)
        for reply in done:
            if _failed(reply):
                reply.result()
        waiting = list(not_done)
    return True


def _last_user_text(messages: Messages) -> str:
    """The last user message's text (the prompt a warning names)."""
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    return ""
