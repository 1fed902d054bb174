"""An OpenAI-compatible chat server (vLLM, SGLang, llama.cpp's server) as regen's engine.

The standard library only: `http.client` and `json`, one blocking request per call, from the
daemon threads of a `RequestPool` (regen keeps a few in flight). Every failure is a
`ServerError`, one line naming the URL and the cause: unreachable (refused, no such host,
timeout), an HTTP error status (with the server's message, at most 200 characters), or an
answer that is not a chat completion. A request that failed for a passing cause (HTTP 5xx,
408 or 429, a timeout, a connection lost) is tried again `ChatServer.retries` times, waiting
`backoff_s`, then twice that, ...; a 4xx other than 401, 403, 404, 405, 408 and 429 refuses
that one request (e.g. a prompt longer than the server's context): `ServerError.refused`.
`ChatServer.abort` ends every request at once: those waiting fail, those in flight lose their
connection (the server stops generating for them).
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
import urllib.parse
from concurrent.futures import Future
from typing import Any

from dflash.errors import DFlashError

__all__ = ["ChatServer", "RequestPool", "ServerError"]

_BODY_CHARS = 200
_NOT_PER_REQUEST = frozenset({401, 403, 404, 405})  # the server's set-up, not one prompt: the same for all
_PASSING = frozenset({408, 429})

Reply = tuple[str, int | None]


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
    server lists) and each request's time limit in seconds."""

    retries = 3  # more tries of a request that failed for a passing cause
    backoff_s = 1.0  # the wait before the first of them; doubled before each next

    def __init__(self, url: str, model: str = "", timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.model = model
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()

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
            conns = list(self._open)
        for conn in conns:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _retrying(self, method: str, path: str, payload: dict[str, Any]) -> Any:
        """`_request`, tried again after a passing failure (`retries` times, with backoff)."""
        for attempt in range(self.retries + 1):
            try:
                return self._request(method, path, payload)
            except ServerError as err:
                last = err
                if not err.transient or attempt == self.retries or self._stopped.is_set():
                    break
            if self._stopped.wait(self.backoff_s * 2**attempt):
                break
        if attempt:
            raise ServerError(f"{last} (tried {attempt + 1} times)", last.status, last.transient)
        raise last

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        """One request's JSON answer, or a one-line ServerError."""
        where = f"regen.server {self.url}: {method} {path}"
        if self._stopped.is_set():
            raise ServerError(f"{where}: cancelled")
        parts = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.netloc, timeout=self.timeout_s)
        with self._lock:
            self._open.add(conn)
        try:
            return self._exchange(conn, where, method, parts.path + path, payload)
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _exchange(
        self, conn: http.client.HTTPConnection, where: str, method: str, path: str, payload: dict[str, Any] | None
    ) -> Any:
        try:
            conn.connect()
        except TimeoutError:
            raise ServerError(f"{where}: unreachable (no connection within {self.timeout_s:g} s)", None, True) from None
        except OSError as err:
            raise ServerError(f"{where}: unreachable ({_one_line(str(err))})", None, True) from None
        if self._stopped.is_set():
            raise ServerError(f"{where}: cancelled")
        data = json.dumps(payload).encode() if payload is not None else None
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
        except TimeoutError:  # not retried: the server would generate the same long reply again
            msg = f"{where}: no answer within {self.timeout_s:g} s (raise regen.server_timeout_s)"
            raise ServerError(msg, None, False) from None
        except (OSError, http.client.HTTPException) as err:
            msg = f"{where}: connection lost ({type(err).__name__}: {_one_line(str(err))})"
            raise ServerError(msg, None, True) from None
        text = raw.decode("utf-8", "replace")
        if status >= 400:
            kind = "server error" if status >= 500 else "refused"
            msg = f"{where}: {kind}, HTTP {status}: {_server_message(text)}"
            raise ServerError(msg, status, status >= 500 or status in _PASSING)
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{where}: HTTP {status} but not JSON: {_one_line(text)}", status) from None


class RequestPool:
    """`workers` daemon threads (named regen-server-N) asking `server` for replies: a process
    that ends (an error, Ctrl-C) never waits for them. `close` cancels what is queued and
    aborts what is in flight."""

    def __init__(self, server: ChatServer, workers: int) -> None:
        self.server = server
        self._jobs: queue.SimpleQueue[tuple[Future[Reply], list[dict[str, Any]], dict[str, Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._queued: set[Future[Reply]] = set()
        self._lock = threading.Lock()
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
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self.server.chat(messages, options))
            except BaseException as err:  # the caller reads it from the future
                fut.set_exception(err)

    def close(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, set()
        for fut in queued:
            fut.cancel()
        self.server.abort()
        for _ in self._threads:
            self._jobs.put(None)
