"""An OpenAI-compatible chat server (vLLM, SGLang, llama.cpp's server) as regen's engine.

The standard library only: `urllib.request` and `json`, one blocking request per call (regen
keeps a few in flight from threads). Every failure is a `ServerError`, one line naming the
URL and the cause: unreachable (refused, no such host, timeout), an HTTP error status (with
the first 200 characters of its body), or an answer that is not a chat completion.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from dflash.errors import DFlashError

__all__ = ["ChatServer", "ServerError"]

_BODY_CHARS = 200


class ServerError(DFlashError):
    """The server cannot be reached, refused a request or answered something else."""


def _one_line(text: str) -> str:
    return " ".join(text.split())[:_BODY_CHARS]


class ChatServer:
    """`url` (with or without a trailing /v1), the model asked for (`model`, or the first the
    server lists) and each request's time limit in seconds."""

    def __init__(self, url: str, model: str = "", timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.model = model

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

    def chat(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> tuple[str, int | None]:
        """The reply to `messages` (POST /v1/chat/completions with `options`: max_tokens,
        temperature, seed, ...) and the tokens it took, when the server counts them."""
        body = self._request("POST", "/v1/chat/completions", {"model": self.model, "messages": messages, **options})
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

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        """One request's JSON answer, or a one-line ServerError."""
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        where = f"regen.server {self.url}: {method} {path}"
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            text = err.read().decode("utf-8", "replace")
            kind = "server error" if err.code >= 500 else "refused"
            raise ServerError(f"{where}: {kind}, HTTP {err.code}: {_one_line(text)}") from None
        except urllib.error.URLError as err:
            raise ServerError(f"{where}: unreachable ({_one_line(str(err.reason))})") from None
        except TimeoutError:
            raise ServerError(f"{where}: no answer within {self.timeout_s:g} s (regen.server_timeout_s)") from None
        except (OSError, http.client.HTTPException) as err:
            raise ServerError(f"{where}: connection lost ({type(err).__name__}: {_one_line(str(err))})") from None
        try:
            return json.loads(raw)
        except ValueError:
            text = raw.decode("utf-8", "replace")
            raise ServerError(f"{where}: HTTP {status} but not JSON: {_one_line(text)}") from None
