"""The HTTP front of a ``TurnService`` (standard library ``http.server``, one thread per connection).

    GET  /health                status, model name, voices, queued requests
    GET  /v1/models             OpenAI's model list (the one served model)
    POST /v1/chat/completions   OpenAI-style chat completions (``openai_api``); ``stream: true`` answers with
                                server-sent events: the text, then base64 24 kHz PCM16 audio deltas, a last
                                chunk with the finish reason and usage, then ``data: [DONE]``

Every refusal is OpenAI's error object with a 4xx status; a failure of the model itself is a 500 (or, once a
stream has started, an ``error`` event before the stream ends).
"""

from __future__ import annotations

import json
import logging
import queue
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from .openai_api import ApiError, b64, chunk_body, completion_body, parse_chat, pcm16, usage
from .turns import Audio, Done, Failed, Text, TurnService

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20          # bytes of request JSON
EVENT_TIMEOUT_S = 600.0     # silence from the worker after which a request is answered with an error


class TurnServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: TurnService | None, model: str):
        super().__init__(address, _Handler)     # binds and listens; requests are read once serve_forever runs
        self.service, self.model = service, model

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: TurnServer
    server_version = "minicpmo-rt"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        log.info("%s %s", self.address_string(), format % args)

    # ---- plumbing ----------------------------------------------------------------------------------------

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: ApiError) -> None:
        self._json(err.status, err.body())

    def _body(self) -> object:
        n = self.headers.get("Content-Length")
        if n is None:
            raise ApiError("send the JSON body with a Content-Length header", status=411)
        if not n.isdigit() or int(n) > MAX_BODY:
            raise ApiError(f"the request body must be at most {MAX_BODY} bytes of JSON (Content-Length {n})",
                           status=413)
        raw = self.rfile.read(int(n))
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(f"the request body is not JSON: {exc}") from None

    def _sse(self, body: dict | str) -> None:
        data = body if isinstance(body, str) else json.dumps(body)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    # ---- routes ------------------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 (the base class's name)
        srv = self.server
        if self.path == "/health":
            self._json(200, {"status": "ok", "model": srv.model, "voices": list(srv.service.voices),
                             "queued": srv.service.queued})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": srv.model, "object": "model", "created": 0,
                                                         "owned_by": "minicpmo-rt"}]})
        elif self.path == "/v1/chat/completions":
            self._error(ApiError("POST a chat-completions request here", status=405))
        else:
            self._error(ApiError(f"no route {self.path}: GET /health, GET /v1/models, POST /v1/chat/completions",
                                 status=404))

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/v1/chat/completions":
            self._error(ApiError(f"no route POST {self.path}: POST /v1/chat/completions", status=404))
            return
        try:
            chat = parse_chat(self._body(), list(self.server.service.voices))
        except ApiError as err:
            self._error(err)
            return
        ticket = self.server.service.submit(chat)
        if chat.stream:
            self._stream(ticket)
        else:
            self._whole(ticket)

    def _whole(self, ticket) -> None:
        text, audio = [], []
        try:
            for ev in ticket.events(EVENT_TIMEOUT_S):
                if isinstance(ev, Text):
                    text.append(ev.text)
                elif isinstance(ev, Audio):
                    audio.append(ev.samples)
                elif isinstance(ev, Failed):
                    kind = "invalid_request_error" if ev.bad_request else "server_error"
                    self._error(ApiError(ev.message, status=400 if ev.bad_request else 500, kind=kind))
                    return
                elif isinstance(ev, Done):
                    samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
                    self._json(200, completion_body(ticket.id, self.server.model, ticket.chat, "".join(text),
                                                    samples, ev.finish_reason, ev.prompt_tokens,
                                                    ev.completion_tokens))
        except queue.Empty:
            self._error(ApiError(f"no progress for {EVENT_TIMEOUT_S:.0f} s", status=504, kind="server_error"))

    def _stream(self, ticket) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        rid, model, speak = ticket.id, self.server.model, ticket.chat.speak
        audio_id = "audio_" + rid.split("-", 1)[-1]
        started = time.perf_counter()
        try:
            self._sse(chunk_body(rid, model, {"role": "assistant", "content": None if speak else ""}))
            for ev in ticket.events(EVENT_TIMEOUT_S):
                if isinstance(ev, Text):
                    delta = {"audio": {"id": audio_id, "transcript": ev.text}} if speak else {"content": ev.text}
                    self._sse(chunk_body(rid, model, delta))
                elif isinstance(ev, Audio):
                    self._sse(chunk_body(rid, model, {"audio": {"id": audio_id, "data": b64(pcm16(ev.samples))}}))
                elif isinstance(ev, Failed):
                    kind = "invalid_request_error" if ev.bad_request else "server_error"
                    self._sse(ApiError(ev.message, kind=kind).body())
                    break
                elif isinstance(ev, Done):
                    self._sse(chunk_body(rid, model, {}, ev.finish_reason,
                                         usage(ev.prompt_tokens, ev.completion_tokens)))
            self._sse("[DONE]")
        except queue.Empty:
            self._sse(ApiError(f"no progress for {EVENT_TIMEOUT_S:.0f} s", kind="server_error").body())
            self._sse("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            log.info("%s: the client left after %.1f s; its answer is still computed", rid,
                     time.perf_counter() - started)


def parse_voices(specs: list[str]) -> dict:
    """``NAME=PATH`` or ``PATH`` (named by the file's stem) -> {name: Path}; the first is the default voice."""
    from pathlib import Path

    from ..errors import InputError

    voices: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = (name, path) if sep else (Path(spec).stem, spec)
        if not name or not path:
            raise InputError(f"--voice {spec!r}: pass PATH or NAME=PATH")
        if name in voices:
            raise InputError(f"--voice {spec!r}: the name {name!r} is taken; give each voice its own NAME=")
        if not Path(path).is_file():
            raise InputError(f"--voice {spec!r}: {path} is not a file; pass a reference recording (WAV)")
        voices[name] = Path(path)
    if not voices:
        raise InputError("pass at least one --voice (a reference recording to speak in)")
    return voices


def serve(model: str, voices: dict, host: str = "127.0.0.1", port: int = 8000, profile: str | None = None,
          device: str = "cpu", max_batch: int | None = None, min_codes: int = 50, n_timesteps: int | None = None,
          served_name: str = "minicpm-o-4.5", warm_up: bool = False, ready=None) -> None:
    """Load the turn pipeline, then serve until interrupted. ``warm_up``: answer short turns in every voice
    first (``TurnPipeline.warm_up``), so graphs and kernels are made before the first client's turn.
    ``ready(server)`` is called once the socket listens."""
    from ..runtime.turn import DEFAULT_PROFILE, TurnPipeline
    from ..talker.sampler import SamplingParams

    server = TurnServer((host, port), None, served_name)     # bound first: a taken port fails before the load
    try:
        pipe = TurnPipeline.from_snapshot(model, profile or DEFAULT_PROFILE, device=device, n_timesteps=n_timesteps,
                                          talker_params=SamplingParams(min_codes=min_codes))
        if warm_up:
            for path in voices.values():
                pipe.warm_up(path)
        service = server.service = TurnService(pipe, voices, max_batch)
    except BaseException:
        server.server_close()
        raise
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.close()
