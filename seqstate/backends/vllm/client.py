"""HTTP to a vLLM server: a keep-alive connection pool, token ids in and out, and every
failure mapped to a typed error.

Only the OpenAI-compatible completions endpoint is used, with token-id prompts
(``prompt: [ids]``) and vLLM's extensions: ``return_token_ids``, ``return_tokens_as_token_ids``
(log-prob keys are ``"token_id:N"``), ``vllm_xargs`` (the plugin's per-request spec) and
``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hits).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import urllib3
from urllib3.exceptions import HTTPError, SSLError

from seqstate.errors import (ArgumentError, AuthenticationError, ConstraintError,
                             ContextOverflowError, EngineError, ModelMismatch, ModelNotAvailable)

__all__ = ["Client", "ServerDown", "POOL_SIZE", "PROBE_TIMEOUT"]

POOL_SIZE = 64           # kept-alive connections: concurrent requests beyond it open new ones
PROBE_TIMEOUT = 2.0      # seconds a ``/health`` probe waits


class ServerDown(EngineError):
    """The server failed as a server, not as a judge of the request: it refused the
    connection, reset it, cut a stream, or answered 5xx (``answered``: it spoke, so a pool
    asks its ``/health`` before calling it down).  A pool re-sends the request
    (`seqstate.backends.vllm.pool`); with nowhere to send it, the caller sees an
    `EngineError`."""

    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class Client:
    """A pool of keep-alive connections to one server (thread-safe).

    ``url`` is ``http://`` or ``https://`` (a server started with TLS, or a proxy in front
    of it that terminates TLS).  An https server's certificate is checked against the
    system's trusted authorities (``$SSL_CERT_FILE`` replaces them), or against
    ``ca_certs`` (a PEM file: a self-signed certificate, or a private authority's).
    ``api_key`` goes with every request as ``Authorization: Bearer ...``, the header vLLM's
    ``--api-key`` checks.
    """

    def __init__(self, url: str, *, api_key: str | None = None, ca_certs: str | None = None,
                 timeout: float = 600.0, connect_timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ArgumentError(f"a vLLM server's URL starts with http:// or https://, got "
                                f"{url!r}; for example http://127.0.0.1:8000")
        self.keyed = bool(api_key)
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        tls = {} if ca_certs is None else {"ca_certs": str(ca_certs)}
        self.pool = urllib3.PoolManager(maxsize=POOL_SIZE, block=False, retries=False,
                                        timeout=urllib3.Timeout(connect=connect_timeout,
                                                                read=timeout), **tls)
        self._open: set[Any] = set()
        self._lock = threading.Lock()

    # -- requests ----------------------------------------------------------------------------
    def get(self, path: str) -> Any:
        return self._json(self._send("GET", path, None))

    def text(self, path: str) -> str:
        """A GET's body as text (``/metrics``)."""
        return self._send("GET", path, None).data.decode(errors="replace")

    def alive(self) -> bool:
        """Whether ``/health`` answers 200 within `PROBE_TIMEOUT` seconds."""
        try:
            response = self.pool.request("GET", self.url + "/health", headers=self.headers,
                                         timeout=urllib3.Timeout(total=PROBE_TIMEOUT))
        except HTTPError:
            return False
        return response.status == 200

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        return self._json(self._send("POST", path, body, headers=headers))

    def stream(self, path: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
        """The server-sent events of a streamed request, as parsed JSON objects.  Closing
        the iterator early closes the connection, which makes vLLM abort the request.
        ``headers`` go with this request only (``X-data-parallel-rank``).  `ServerDown`
        where the stream breaks or ends without vLLM's closing ``data: [DONE]``."""
        response = self._send("POST", path, {**body, "stream": True}, stream=True,
                              headers=headers)
        with self._lock:
            self._open.add(response)
        try:
            for line in self._lines(response):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError as exc:         # a connection cut mid-event
                    raise ServerDown(f"the vLLM server at {self.url} sent a broken event "
                                     f"({data[:80]!r}): did it stop mid-request?") from exc
                if "error" in event:
                    raise _error(event["error"].get("code", 500), event["error"], self.url)
                yield event
            # vLLM ends every stream with [DONE], errors too: a stream closed before it was cut
            raise ServerDown(f"the vLLM server at {self.url} closed the stream before its "
                             "closing [DONE]: did it, or a proxy in front of it, stop "
                             "mid-request?")
        finally:
            with self._lock:
                self._open.discard(response)
            if not response.isclosed():
                response.close()          # unread events: drop the connection (aborts it)
            response.release_conn()

    def _lines(self, response) -> Iterator[bytes]:
        try:
            yield from response
        except HTTPError as exc:
            raise ServerDown(f"the vLLM server at {self.url} dropped the connection "
                             f"mid-request: {exc}") from exc

    def _send(self, method: str, path: str, body: dict[str, Any] | None, stream: bool = False,
              headers: dict[str, str] | None = None):
        data = None if body is None else json.dumps(body).encode()
        try:
            response = self.pool.request(method, self.url + path, body=data,
                                         headers={**self.headers, **(headers or {})},
                                         preload_content=not stream)
        except SSLError as exc:
            raise EngineError(f"the TLS handshake with {self.url} failed ({exc}): where the "
                              "server's certificate is self-signed or from a private "
                              "authority, pass ca_certs= its PEM file (or set $SSL_CERT_FILE); "
                              "an http:// server takes an http:// URL") from exc
        except HTTPError as exc:
            raise ServerDown(f"the vLLM server at {self.url} did not answer ({exc}); start one "
                             "with `python -m seqstate.vllm serve`") from exc
        if response.status in (401, 403):
            response.release_conn()
            raise self._refused(response.status)
        if response.status >= 400:
            payload = response.data
            response.release_conn()
            try:
                error = json.loads(payload).get("error", {})
            except (ValueError, AttributeError):
                error = {"message": payload[:500].decode(errors="replace")}
            if isinstance(error, str):
                error = {"message": error}
            raise _error(response.status, error, self.url)
        return response

    def _json(self, response) -> Any:
        try:
            return json.loads(response.data)
        except ValueError as exc:
            raise EngineError(f"the vLLM server at {self.url} sent something that is not JSON: "
                              f"{response.data[:200]!r}") from exc

    def _refused(self, status: int) -> AuthenticationError:
        if self.keyed:
            return AuthenticationError(
                f"the vLLM server at {self.url} refused the API key sent ({status}): pass "
                "api_key= (or set $SEQSTATE_VLLM_API_KEY to) the key the server was started "
                "with (`python -m seqstate.vllm serve --api-key ...`)")
        return AuthenticationError(
            f"the vLLM server at {self.url} needs an API key ({status}) and none was sent: "
            "pass api_key= to ss.models.vllm, or set $SEQSTATE_VLLM_API_KEY")

    def close(self) -> None:
        with self._lock:
            for response in list(self._open):
                response.close()
        self.pool.clear()


def _error(status: int, error: dict[str, Any], url: str = "") -> Exception:
    """The typed error for an HTTP error answer (vLLM's ``{"error": {"message", ...}}``):
    `ModelMismatch`, `ConstraintError` (a spec the plugin refused at admission),
    `ContextOverflowError`, `ModelNotAvailable`, `ArgumentError`, `ServerDown` (5xx) or
    `EngineError`."""
    message = str(error.get("message", error))
    text = f"the vLLM server {url + ' ' if url else ''}refused the request ({status}): {message}"
    lowered = message.lower()
    if "vocabulary mismatch" in lowered:
        return ModelMismatch(text)
    if "context length" in lowered or "maximum model length" in lowered or "too long" in lowered:
        return ContextOverflowError(text)
    if "seqstate spec refused" in lowered:     # the plugin's refusal at admission
        return ConstraintError(text)
    if status == 404 and "model" in lowered:
        return ModelNotAvailable(text)
    if status == 400 or status == 422:
        return ArgumentError(text)
    if status >= 500:
        return ServerDown(text, answered=True)
    return EngineError(text)
