"""The HTTP front of a ``TurnService`` or a ``DuplexService`` (standard library ``http.server``, one thread
per connection).

    GET    /health                         status, mode, model name, voices, load
    GET    /v1/models                      OpenAI's model list (the one served model)
  turn mode:
    POST   /v1/chat/completions            OpenAI-style chat completions (``openai_api``); ``stream: true``
                                           answers with server-sent events: the text, then base64 24 kHz PCM16
                                           audio deltas, a last chunk with the finish reason and usage, then
                                           ``data: [DONE]``
  duplex mode:
    POST   /v1/duplex/sessions             open a session {"voice", "seed"} -> {"id", ...}
    POST   /v1/duplex/sessions/ID/seconds  one second of the user's audio (and camera frame) -> the model's unit
    DELETE /v1/duplex/sessions/ID          close it -> the model's last words
    GET    /v1/duplex/realtime             the same over one WebSocket (JSON messages; ``_realtime``)

Every refusal is OpenAI's error object with a 4xx status; a failure of the model itself is a 500 (or, once a
stream has started, an ``error`` event before the stream ends).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import queue
import signal
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from .duplex import AudioBuffer, DuplexService, closed_body, opened_body, parse_second, unit_body
from .openai_api import ApiError, b64, chunk_body, completion_body, parse_chat, pcm16, usage
from .turns import Audio, Done, Failed, Text, TurnService
from .websocket import Closed as WebSocketClosed
from .websocket import Connection as WebSocket
from .websocket import accept_key as ws_accept_key

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20          # bytes of request JSON
# A browser's WebSocket cannot set headers, so it may offer its key as a subprotocol beside this one:
# new WebSocket(url, ["minicpmo-rt", "minicpmo-rt.key." + KEY]); the server then answers "minicpmo-rt".
WS_PROTOCOL = "minicpmo-rt"
WS_KEY_PREFIX = WS_PROTOCOL + ".key."
MAX_CHAT_BODY = 32 << 20    # ... of a chat completion, which may carry recordings and pictures
HANDSHAKE_TIMEOUT_S = 30.0
EVENT_TIMEOUT_S = 600.0     # silence from the worker after which a request is answered with an error


class Server(ThreadingHTTPServer):
    """``turns`` (chat completions) or ``duplex`` (duplex sessions): the service this server fronts."""

    daemon_threads = True
    # socketserver's default backlog is 5: a burst of more new connections overflows it, and the kernel drops their
    # SYNs, which the clients resend only after 1 s (on the H200, 1-2 of 8-16 requests released together arrived
    # ~1 s late and missed their batch, session 56)
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], model: str, turns: TurnService | None = None,
                 duplex: DuplexService | None = None, api_key: str | None = None, tls: ssl.SSLContext | None = None):
        super().__init__(address, _Handler)     # binds and listens; requests are read once serve_forever runs
        self.turns, self.duplex, self.model = turns, duplex, model
        self.api_key = api_key or None          # clients then send "Authorization: Bearer KEY" (not to /health)
        self.tls = tls is not None
        if tls is not None:
            # the handshake runs on the connection's own thread (_Handler.setup), not in accept(): a client that
            # stalls it holds up nobody else
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    @property
    def mode(self) -> str:
        return "duplex" if self.duplex is not None else "turn"

    @property
    def voices(self) -> list[str]:
        service = self.duplex if self.duplex is not None else self.turns
        return [] if service is None else list(service.voices)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host}:{port}"


def tls_context(cert: str, key: str):
    """A server TLS context from a PEM certificate (chain) and its private key; unreadable files are named."""
    from ..errors import InputError

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise InputError(f"--tls-cert {cert} / --tls-key {key}: cannot load them ({exc}); pass a PEM certificate "
                         "and its private key (unencrypted)") from None
    return ctx


class _Handler(BaseHTTPRequestHandler):
    server: Server
    server_version = "minicpmo-rt"
    # persistent connections: a duplex client posts a second per second without a new connection each time.
    # Every JSON answer has a Content-Length; a stream ends its connection; an answer sent before the request's
    # body was read closes it too, since the unread body would be taken for the next request.
    protocol_version = "HTTP/1.1"
    _read_body = True       # until _begin starts a request

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        log.info("%s %s", self.address_string(), format % args)

    def setup(self) -> None:
        self._tls_failed = False
        if isinstance(self.request, ssl.SSLSocket):
            try:
                self.request.settimeout(HANDSHAKE_TIMEOUT_S)
                self.request.do_handshake()
                self.request.settimeout(None)
            except (ssl.SSLError, OSError) as exc:     # plain HTTP on a TLS port, a bad client, a stall
                log.info("%s: TLS handshake failed: %s", self.client_address[0], exc)
                self._tls_failed = True
        super().setup()

    def handle(self) -> None:
        if not self._tls_failed:
            super().handle()

    # ---- plumbing ----------------------------------------------------------------------------------------

    @property
    def route(self) -> str:
        """The request's path without its query string."""
        return self.path.split("?", 1)[0]

    def _begin(self, open_route: bool = False) -> None:
        """A request's start: nothing of its body read yet; the API key checked unless ``open_route``."""
        self._read_body = False
        key = self.server.api_key
        if key is not None and not open_route:
            given = self.headers.get("Authorization", "")
            ok = hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
            realtime = self.route == "/v1/duplex/realtime"
            if not ok and realtime:
                ok = any(hmac.compare_digest(p.encode(), (WS_KEY_PREFIX + key).encode()) for p in self._protocols())
            if not ok:
                also = (f" (a browser, which cannot set headers, may offer the WebSocket subprotocols "
                        f"'{WS_PROTOCOL}' and '{WS_KEY_PREFIX}KEY')" if realtime else "")
                raise ApiError(f"this server needs an API key: send the header 'Authorization: Bearer KEY'{also}",
                               status=401, kind="authentication_error")

    def _protocols(self) -> list[str]:
        """The WebSocket subprotocols the client offered."""
        return [p.strip() for p in self.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        unread = self.command == "POST" or self.headers.get("Content-Length", "0") not in ("", "0")
        if not self._read_body and unread:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: ApiError) -> None:
        self._json(err.status, err.body())

    def _body(self, limit: int = MAX_BODY) -> object:
        n = self.headers.get("Content-Length")
        if n is None:
            raise ApiError("send the JSON body with a Content-Length header", status=411)
        if not n.isdigit() or int(n) > limit:
            raise ApiError(f"the request body must be at most {limit} bytes of JSON (Content-Length {n})",
                           status=413)
        raw = self.rfile.read(int(n))
        self._read_body = True
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
        try:
            self._begin(open_route=self.route == "/health")
        except ApiError as err:
            self._error(err)
            return
        if self.route == "/v1/duplex/realtime":
            try:
                self._realtime()
            except ApiError as err:
                self._error(err)
            return
        if self.route == "/health":
            load = ({"seats": srv.duplex.seats, "sessions": srv.duplex.open_sessions} if srv.duplex is not None
                    else {"queued": srv.turns.queued if srv.turns is not None else 0})
            self._json(200, {"status": "ok", "mode": srv.mode, "model": srv.model, "voices": srv.voices, **load})
        elif self.route == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": srv.model, "object": "model", "created": 0,
                                                         "owned_by": "minicpmo-rt"}]})
        elif self.route in ("/v1/chat/completions", "/v1/duplex/sessions") or self.route.startswith("/v1/duplex/"):
            self._error(ApiError(f"GET {self.route}: use POST (DELETE to close a duplex session)", status=405))
        else:
            self._error(ApiError(f"no route {self.route}: {self._routes()}", status=404))

    def _routes(self) -> str:
        if self.server.mode == "duplex":
            return ("GET /health, GET /v1/models, POST /v1/duplex/sessions, POST /v1/duplex/sessions/ID/seconds, "
                    "DELETE /v1/duplex/sessions/ID, GET /v1/duplex/realtime (WebSocket)")
        return "GET /health, GET /v1/models, POST /v1/chat/completions"

    def _mode_error(self, want: str) -> ApiError:
        return ApiError(f"this server runs in {self.server.mode} mode; {self.route} needs `minicpmo-rt serve --mode "
                        f"{want}` ({self._routes()} here)", status=404)

    def _duplex_session(self, suffix: str = "") -> str | None:
        """The session id of /v1/duplex/sessions/ID{suffix}, or None when the path is not that."""
        prefix = "/v1/duplex/sessions/"
        if not (self.route.startswith(prefix) and self.route.endswith(suffix)):
            return None
        sid = self.route[len(prefix):len(self.route) - len(suffix)]
        return sid if sid and "/" not in sid else None

    def do_POST(self) -> None:  # noqa: N802
        srv = self.server
        try:
            self._begin()
            if self.route == "/v1/chat/completions":
                if srv.turns is None:
                    raise self._mode_error("turn")
                chat = parse_chat(self._body(MAX_CHAT_BODY), list(srv.turns.voices))
                ticket = srv.turns.submit(chat)
                self._stream(ticket) if chat.stream else self._whole(ticket)
            elif self.route == "/v1/duplex/sessions" or self._duplex_session("/seconds") is not None:
                if srv.duplex is None:
                    raise self._mode_error("duplex")
                body = self._body()
                if self.route == "/v1/duplex/sessions":
                    if not isinstance(body, dict) or set(body) - {"voice", "seed"}:
                        raise ApiError("open a session with {'voice': NAME, 'seed': INT} (both optional)")
                    self._json(200, opened_body(srv.duplex.open(body.get("voice"), body.get("seed", 0))))
                else:
                    sid = self._duplex_session("/seconds")
                    srv.duplex.session(sid)         # an unknown session is a 404 whatever its body holds
                    second = parse_second(body)
                    self._json(200, unit_body(sid, srv.duplex.step(sid, second)))
            else:
                raise ApiError(f"no route POST {self.route}: {self._routes()}", status=404)
        except ApiError as err:
            self._error(err)

    def do_DELETE(self) -> None:  # noqa: N802
        srv = self.server
        sid = self._duplex_session()
        try:
            self._begin()
            if sid is None:
                raise ApiError(f"no route DELETE {self.route}: {self._routes()}", status=404)
            if srv.duplex is None:
                raise self._mode_error("duplex")
            self._json(200, closed_body(sid, srv.duplex.close_session(sid)))
        except ApiError as err:
            self._error(err)

    def _realtime(self) -> None:
        """A duplex session over one WebSocket: JSON messages session.open -> session.opened, input.second ->
        unit, session.close -> session.closed; a refused message is answered with an error message and the
        connection goes on. A connection that ends without session.close closes its session."""
        srv = self.server
        if srv.duplex is None:
            raise self._mode_error("duplex")
        h = self.headers
        if h.get("Upgrade", "").lower() != "websocket" or "upgrade" not in h.get("Connection", "").lower():
            raise ApiError("GET /v1/duplex/realtime is a WebSocket; connect with a WebSocket client (Upgrade: "
                           "websocket)", status=426)
        if h.get("Sec-WebSocket-Version") != "13" or not h.get("Sec-WebSocket-Key"):
            raise ApiError("a WebSocket handshake needs Sec-WebSocket-Version: 13 and a Sec-WebSocket-Key", status=426)
        self.send_response(101, "Switching Protocols")
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", ws_accept_key(h["Sec-WebSocket-Key"]))
        if WS_PROTOCOL in self._protocols():     # never the key's: the answer names a protocol, not a secret
            self.send_header("Sec-WebSocket-Protocol", WS_PROTOCOL)
        self.end_headers()
        self.close_connection = True
        ws = WebSocket(self.rfile, self.wfile, MAX_BODY)
        session, buffered = None, AudioBuffer()
        try:
            while True:
                try:
                    session, buffered = self._realtime_message(ws, ws.receive(), session, buffered)
                except ApiError as err:
                    ws.send_text(json.dumps({"type": "error", "status": err.status, **err.body()}))
        except WebSocketClosed as closed:
            if not ws.closed:
                ws.close(closed.code, closed.reason)
        except OSError:
            pass
        finally:
            if session is not None:
                try:
                    srv.duplex.close_session(session)
                except ApiError:
                    pass

    def _realtime_message(self, ws: WebSocket, text: str, session: str | None,
                          buffered: AudioBuffer) -> tuple[str | None, AudioBuffer]:
        """One message of a realtime connection, answered; returns the connection's open session and its
        ``input.audio`` buffer after it."""
        duplex = self.server.duplex
        try:
            msg = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ApiError(f"a message that is not JSON: {exc}") from None
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind not in ("session.open", "input.second", "input.audio", "session.close"):
            raise ApiError(f"message type {kind!r}: send session.open, input.second, input.audio or session.close")
        if (kind == "session.open") != (session is None):
            raise ApiError("this connection has an open session; send session.close first" if session is not None
                           else f"{kind}: no open session; send session.open first")
        fields = {k: v for k, v in msg.items() if k != "type"}
        if kind == "session.open":
            replies = [{"type": "session.opened", **opened_body(duplex.open(msg.get("voice"), msg.get("seed", 0)))}]
            session, buffered = replies[0]["id"], AudioBuffer()
        elif kind == "input.second":
            if buffered.pending_samples:
                raise ApiError(f"{buffered.pending_samples} samples of input.audio wait for the rest of their second; "
                               "keep sending input.audio", status=409)
            replies = [{"type": "unit", **unit_body(session, duplex.step(session, parse_second(fields)))}]
        elif kind == "input.audio":
            replies = [{"type": "unit", **unit_body(session, duplex.step(session, second))}
                       for second in buffered.add(fields)]
        else:
            dropped = buffered.pending_samples
            replies = [{"type": "session.closed", **closed_body(session, duplex.close_session(session)),
                        "dropped_samples": dropped}]
            session, buffered = None, AudioBuffer()
        for reply in replies:
            ws.send_text(json.dumps(reply))
        return session, buffered

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
        self.send_header("Connection", "close")     # the stream's end is the connection's (no length ahead)
        self.close_connection = True
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


def serve(model: str, voices: dict, host: str = "127.0.0.1", port: int = 8000, mode: str = "turn",
          profile: str | None = None, device: str = "cpu", max_batch: int | None = None, seats: int = 4,
          min_codes: int = 50, n_timesteps: int | None = None, dtype: str = "auto", served_name: str = "minicpm-o-4.5",
          warm_up: bool = False, idle_timeout_s: float = 60.0, api_key: str | None = None, ready=None,
          tls_cert: str | None = None, tls_key: str | None = None, join_running: bool = False,
          talker_lead_s: float | None = None) -> None:
    """Bind, load the models for ``mode`` (turn: a TurnPipeline for chat completions; duplex: a DuplexBatch of
    ``seats`` seats), then serve until interrupted. ``warm_up``: graphs and kernels made before the first
    client (turn: short turns in every voice; duplex: ``DuplexBatch.warm_up``). ``ready(server)`` is called
    once the socket listens and the models are loaded. ``tls_cert`` and ``tls_key`` (PEM files): HTTPS and
    wss:// instead of HTTP. ``join_running`` (turn mode, opt-in): spoken requests join a running batch;
    ``talker_lead_s`` (with it): ``TurnPipeline.talker_lead_s``."""
    from ..errors import InputError

    if mode not in ("turn", "duplex"):
        raise InputError(f"--mode {mode!r}: choose turn (chat completions) or duplex (duplex sessions)")
    if seats < 1:
        raise InputError(f"--seats must be >= 1, got {seats}")
    if (tls_cert is None) != (tls_key is None):
        raise InputError("pass --tls-cert and --tls-key together (the certificate and its private key)")
    if talker_lead_s is not None and not (mode == "turn" and join_running):
        raise InputError("--talker-lead orders the stages of a turn batch that others join: pass it with --mode turn "
                         "and --join-running")
    if talker_lead_s is not None and not (talker_lead_s >= 0 and math.isfinite(talker_lead_s)):
        raise InputError(f"--talker-lead must be a number of seconds >= 0, got {talker_lead_s}")
    tls = tls_context(tls_cert, tls_key) if tls_cert is not None else None
    server = Server((host, port), served_name, api_key=api_key, tls=tls)    # bound first: a taken port fails early
    try:
        if mode == "turn":
            from ..runtime.turn import DEFAULT_PROFILE, TurnPipeline
            from ..talker.sampler import SamplingParams

            pipe = TurnPipeline.from_snapshot(model, profile or DEFAULT_PROFILE, device=device, n_timesteps=n_timesteps,
                                              talker_params=SamplingParams(min_codes=min_codes),
                                              talker_lead_s=talker_lead_s)
            if warm_up:
                for path in voices.values():
                    pipe.warm_up(path)
            server.turns = TurnService(pipe, voices, max_batch, join_running=join_running)
        else:
            from ..runtime.duplex import DEFAULT_DUPLEX_PROFILE, DuplexBatch
            from ..runtime.jobs import duplex_options

            profile = profile or DEFAULT_DUPLEX_PROFILE
            _, torch_dtype, decode = duplex_options(profile, "greedy", 0, None, n_timesteps, device, dtype)
            default = next(iter(voices.values()))
            batch = DuplexBatch.from_snapshot(model, [default] * seats, profile=profile, device=device,
                                              dtype=torch_dtype, n_timesteps=n_timesteps, decode=decode)
            if warm_up:
                batch.warm_up()
            server.duplex = DuplexService(batch, voices, idle_timeout_s=idle_timeout_s)
    except BaseException:
        server.server_close()
        raise
    if ready is not None:
        ready(server)
    # SIGTERM (what systemd, docker stop and kill send) stops like Ctrl-C: the socket closed, the worker joined.
    # Only the main thread may set a handler; a server run on another thread (tests) stops by shutdown().
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if on_main else None
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
        server.server_close()
        for service in (server.turns, server.duplex):
            if service is not None:
                service.close()
