"""The OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions``, answered from the coordinator's own jobs.

[Note: the HTTP API calls generation in-process] The handlers run in the coordinator's process,
so a completion opens a session with the job's ``JobGeneration.generate`` directly, the same
path the Generate RPC takes, rather than calling the coordinator's gRPC port from itself: no
second encoding of the tokens, no token for a loopback call, and the session joins the job's
continuous batching like any other. The session's steps block, so each one runs in a worker
thread (anyio's pool); the event loop only moves bytes. A streamed completion takes its first
step before answering, so a refused prompt or a full KV budget is an HTTP status, not an event
in a stream that already said 200. When the client goes away mid-stream, uvicorn reports the
disconnect, Starlette cancels the stream, and the session is closed in a shielded step: the
stages drop its caches at once (``JobGeneration`` releases them on every stage when its
generator closes), not when they expire.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pipesvc.coordinator.serve_http.access import Access
from pipesvc.coordinator.serve_http.completion import (
    BadRequest,
    Completion,
    Scored,
    Settings,
    chat_ids,
    prompt_ids,
    read_settings,
)
from pipesvc.coordinator.serve_http.served_model import ServedModels, model_name
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PipesvcError,
    ResourceExhaustedError,
    StageUnavailableError,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
"""Largest request body accepted."""
DEFAULT_MAX_TOKENS = 16
"""New tokens of a completion that names no ``max_tokens`` (OpenAI's default)."""


def error(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> tuple[int, dict[str, Any]]:
    """An HTTP status and OpenAI's error body: ``{"error": {"message", "type", "param",
    "code"}}``."""
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def classify(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The HTTP status and error body of an error of a request."""
    if isinstance(exc, BadRequest):
        return error(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, NotFoundError):
        return error(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, InvalidArgumentError | FailedPreconditionError):
        return error(400, str(exc), "invalid_request_error")
    if isinstance(exc, ResourceExhaustedError):
        return error(429, str(exc), "server_error", None, "kv_budget_full")
    if isinstance(exc, StageUnavailableError):
        return error(503, str(exc), "server_error", None, "stage_unavailable")
    if isinstance(exc, PipesvcError):
        return error(500, str(exc), "server_error")
    logger.exception("HTTP API: internal error")
    return error(500, f"internal error: {type(exc).__name__}", "server_error")


def _refusal(exc: Exception) -> JSONResponse:
    """The HTTP answer to an error of a request (before any byte of the answer went out)."""
    status, body = classify(exc)
    return JSONResponse(body, status_code=status)


class _Stream(StreamingResponse):
    """Server-sent events that close their source however the response ends (a client gone
    mid-stream cancels the send; the source's ``finally`` then frees the session)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                with anyio.CancelScope(shield=True):
                    await body.aclose()


def _event(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def routes(models: ServedModels, access: Access) -> list[Route]:
    """The API's routes over ``models``; every one needs the token as a Bearer header."""

    def unauthorized() -> JSONResponse:
        status, body = error(
            401,
            "this server needs the cluster token as an 'Authorization: Bearer TOKEN' header",
            "invalid_request_error",
            None,
            "invalid_api_key",
        )
        return JSONResponse(body, status_code=status)

    async def list_models(request: Request) -> Response:
        if not access.bearer(request):
            return unauthorized()
        jobs = await anyio.to_thread.run_sync(models.open_jobs)
        data = [
            {"id": model_name(job), "object": "model", "created": 0, "owned_by": "pipesvc"}
            for job in jobs
        ]
        return JSONResponse({"object": "list", "data": data})

    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _complete(request, chat=True)

    async def _complete(request: Request, *, chat: bool) -> Response:
        if not access.bearer(request):
            return unauthorized()
        try:
            body = await _json_body(request)
            settings = read_settings(body, chat=chat)
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise BadRequest("model must name a model (GET /v1/models lists them)", "model")
            completion, first = await _first_step(
                request, lambda gone: _start(models, body, model, settings, chat=chat, on_open=gone)
            )
        except Exception as exc:
            return _refusal(exc)
        if await request.is_disconnected():
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(completion.close)
            return Response(status_code=499)
        shape = _Shape(model, chat=chat)
        if not settings.stream:
            pieces = [first]
            try:
                # A step per worker call, as a stream: no thread is held for a whole
                # completion, and a client gone is noticed between steps.
                while completion.finish_reason is None:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    pieces.append(await anyio.to_thread.run_sync(completion.step_with_ready))
            except Exception as exc:
                return _refusal(exc)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(completion.close)
            return JSONResponse(shape.whole("".join(pieces), completion))
        return _Stream(
            _events(completion, first, shape, settings),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


async def _json_body(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BadRequest(f"the request body ({declared} bytes) is over {MAX_BODY_BYTES} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"the request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


GONE_POLL_S = 0.2
"""How often a request waiting for its first token checks that its client is still there."""


async def _watch_gone(request: Request, leave: list[Callable[[], None]]) -> None:
    """Until cancelled: when the client goes away, calls the session's ``leave`` (once it is
    open), so that a session waiting for its first token, such as one waiting for room in the
    KV budgets (see [Note: waiting for room] in coordinator/batcher.py), never runs for
    nobody."""
    while not await request.is_disconnected():
        await anyio.sleep(GONE_POLL_S)
    while not leave:  # the session is being opened
        await anyio.sleep(GONE_POLL_S / 10)
    await anyio.to_thread.run_sync(leave[0])


async def _first_step(
    request: Request, start: Callable[[list[Callable[[], None]]], tuple[Completion, str]]
) -> tuple[Completion, str]:
    """``start`` in a worker thread while ``_watch_gone`` watches the client; raises what
    ``start`` raises."""
    gone: list[Callable[[], None]] = []
    outcome: list[tuple[Completion, str] | Exception] = []
    async with anyio.create_task_group() as watching:
        watching.start_soon(_watch_gone, request, gone)
        try:
            outcome.append(await anyio.to_thread.run_sync(lambda: start(gone)))
        except Exception as exc:  # raised below, not as the task group's ExceptionGroup
            outcome.append(exc)
        finally:
            watching.cancel_scope.cancel()
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def _start(
    models: ServedModels,
    body: dict[str, Any],
    model: str,
    settings: Settings,
    *,
    chat: bool,
    on_open: list[Callable[[], None]],
) -> tuple[Completion, str]:
    """Opens the completion's session and takes its first piece of text (blocking); the
    session's ``leave`` goes into ``on_open`` when it opens."""
    job = models.find(model)
    text = models.text(job)
    ids = chat_ids(body.get("messages"), text) if chat else prompt_ids(body.get("prompt"), text)
    max_tokens = settings.max_tokens
    if max_tokens is None:
        room = text.max_positions - len(ids) if text.max_positions else DEFAULT_MAX_TOKENS
        max_tokens = max(1, room) if chat else DEFAULT_MAX_TOKENS
    steps = job.generation.generate(
        torch.tensor([ids]),
        max_tokens,
        settings.sampling,
        logprobs=settings.logprobs,
        on_open=on_open.append,
    )
    completion = Completion(steps, text, len(ids), max_tokens, settings.stop)
    try:
        return completion, completion.step()
    except BaseException:
        completion.close()
        raise


class _Shape:
    """The JSON of completions or of chat completions, whole or in chunks."""

    def __init__(self, model: str, *, chat: bool) -> None:
        self.model = model
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs(self, scored: list[Scored] | None) -> dict[str, Any] | None:
        """A choice's ``logprobs`` for ``scored`` tokens (see [Note: log-probabilities over
        HTTP] in completion.py): chat's ``content`` list, or completions' four lists."""
        if scored is None:
            return None
        if self.chat:
            return {"content": [_chat_token(s) for s in scored], "refusal": None}
        return {
            "tokens": [s.text for s in scored],
            "token_logprobs": [s.logprob for s in scored],
            # OpenAI's: the most likely tokens, and the chosen one whether or not among them.
            "top_logprobs": [dict(s.top) | {s.text: s.logprob} for s in scored],
            "text_offset": [s.offset for s in scored],
        }

    def whole(self, content: str, completion: Completion) -> dict[str, Any]:
        logprobs = self.logprobs(completion.take_logprobs())
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": content,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
            }
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [choice], "usage": usage(completion)}

    def chunk(
        self,
        piece: str | None,
        finish_reason: str | None = None,
        scored: list[Scored] | None = None,
    ) -> dict[str, Any]:
        """A chunk with ``piece`` of text and its ``scored`` tokens (chat: None is the opening
        chunk with the role)."""
        logprobs = self.logprobs(scored)
        if self.chat:
            delta: dict[str, Any] = {}
            if piece is None:
                delta = {"role": "assistant", "content": ""}
            elif piece:
                delta = {"content": piece}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [choice]}

    def usage_chunk(self, completion: Completion) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": usage(completion)}


def _chat_token(scored: Scored) -> dict[str, Any]:
    """A chat ``logprobs.content`` entry."""

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    top = [entry(text, logprob) for text, logprob in scored.top]
    return {**entry(scored.text, scored.logprob), "top_logprobs": top}


def usage(completion: Completion) -> dict[str, int]:
    """OpenAI's ``usage``: the prompt's tokens and the generated ones."""
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


async def _events(
    completion: Completion, first: str, shape: _Shape, settings: Settings
) -> AsyncIterator[bytes]:
    """The stream's events: the pieces as they come, the finish, the usage when asked, then
    ``[DONE]``; the session is closed however the stream ends."""
    step: Callable[[], str] = completion.step_with_ready  # the tokens of a run in one chunk
    try:
        if shape.chat:
            yield _event(shape.chunk(None))
        if first:
            yield _event(shape.chunk(first, scored=completion.take_logprobs()))
        while completion.finish_reason is None:
            piece = await anyio.to_thread.run_sync(step)
            if piece:
                yield _event(shape.chunk(piece, scored=completion.take_logprobs()))
        yield _event(shape.chunk("", completion.finish_reason, completion.take_logprobs()))
        if settings.include_usage:
            yield _event(shape.usage_chunk(completion))
    except PipesvcError as exc:  # after the 200: the error goes as an event, as OpenAI's does
        yield _event(classify(exc)[1])
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(completion.close)
    yield _event("[DONE]")
