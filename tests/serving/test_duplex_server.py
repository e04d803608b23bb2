"""Duplex sessions over HTTP on the tiny checkpoint: real sockets and a real DuplexBatch; each session's units are
compared with the same conversation stepped on a DuplexBatch of its own (same voice, seed and seconds)."""

import base64
import hashlib
import io
import json
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import rel_err
from minicpmo_rt.runtime.duplex import DuplexBatch, DuplexInput, read_audio_16k
from minicpmo_rt.serving.duplex import DuplexService, parse_second
from minicpmo_rt.serving.http import Server
from minicpmo_rt.serving.openai_api import ApiError, pcm16

SECONDS = 3


@pytest.fixture(scope="module")
def user_audio(voice):
    """The user's side: SECONDS seconds of a real recording, as the 16-bit PCM a client sends."""
    x = read_audio_16k(voice)[: SECONDS * 16000]
    return np.round(np.clip(x, -1, 1) * 32767).astype("<i2")


@pytest.fixture(scope="module")
def server(tiny_ckpt, voice):
    batch = DuplexBatch.from_snapshot(tiny_ckpt, [voice] * 2, n_timesteps=2)
    service = DuplexService(batch, {"anna": voice})
    srv = Server(("127.0.0.1", 0), "tiny-test", duplex=service)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()
    service.close(timeout=60)


def _call(srv, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data, method=method)
    try:
        return 200, json.load(urllib.request.urlopen(req, timeout=300))
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _second(pcm: np.ndarray, k: int) -> dict:
    return {"audio": base64.b64encode(pcm[k * 16000:(k + 1) * 16000].tobytes()).decode()}


_refs: dict = {}


def _reference(tiny_ckpt, voice, user_audio, seed: int):
    """The conversation on a DuplexBatch of its own (seat 0 of 2, the other seat idle): its units."""
    if seed not in _refs:
        batch = DuplexBatch.from_snapshot(tiny_ckpt, [voice] * 2, n_timesteps=2)
        batch.reopen(0, voice, seed)
        x = user_audio.astype(np.float32) / 32768.0
        _refs[seed] = [batch.step([DuplexInput(x[k * 16000:(k + 1) * 16000]), None])[0] for k in range(SECONDS)]
        _refs[seed].append(batch.conversations[0].flush())
        batch.close()
    return _refs[seed]


def test_a_session_answers_each_second_as_the_conversation_would(server, tiny_ckpt, voice, user_audio):
    code, opened = _call(server, "POST", "/v1/duplex/sessions", {"voice": "anna", "seed": 1})
    assert code == 200 and opened["voice"] == "anna" and opened["input_sample_rate"] == 16000
    sid = opened["id"]
    ref = _reference(tiny_ckpt, voice, user_audio, 1)
    for k in range(SECONDS):
        code, unit = _call(server, "POST", f"/v1/duplex/sessions/{sid}/seconds", _second(user_audio, k))
        assert code == 200, unit
        want = ref[k]
        assert (unit["index"], unit["listen"], unit["text"], unit["turn_end"], unit["codes"]) == \
            (want.index, want.listen, want.text, want.turn_end, len(want.codes))
        assert base64.b64decode(unit["audio"]) == pcm16(want.pcm)
    code, closed = _call(server, "DELETE", f"/v1/duplex/sessions/{sid}")
    assert code == 200 and base64.b64decode(closed["audio"]) == pcm16(ref[-1])
    assert _call(server, "DELETE", f"/v1/duplex/sessions/{sid}")[0] == 404
    assert _call(server, "GET", "/health")[1]["sessions"] == 0


def test_two_sessions_step_together_and_a_third_waits_for_a_seat(server, tiny_ckpt, voice, user_audio, monkeypatch):
    service = server.duplex
    batch = service.batch
    stepped = []
    step = batch.step

    def recording_step(inputs):
        stepped.append(sum(x is not None for x in inputs))
        return step(inputs)

    monkeypatch.setattr(batch, "step", recording_step)
    monkeypatch.setattr(service, "tick_wait_s", 2.0)
    ids = [_call(server, "POST", "/v1/duplex/sessions", {"seed": s})[1]["id"] for s in (1, 2)]
    code, full = _call(server, "POST", "/v1/duplex/sessions", {})
    assert code == 503 and "2 duplex seats" in full["error"]["message"]
    got = {}

    def send(sid):
        got[sid] = _call(server, "POST", f"/v1/duplex/sessions/{sid}/seconds", _second(user_audio, 0))

    threads = [threading.Thread(target=send, args=(sid,)) for sid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert stepped == [2]
    for sid, seed in zip(ids, (1, 2)):
        code, unit = got[sid]
        want = _reference(tiny_ckpt, voice, user_audio, seed)[0]
        assert code == 200 and unit["text"] == want.text and unit["codes"] == len(want.codes)
        # the two sessions' Code2Wav payloads went through one push_many (another summation order) and 16-bit
        # rounding adds at most half a step: within 1e-4 of the session alone
        pcm = np.frombuffer(base64.b64decode(unit["audio"]), "<i2") / 32767.0
        assert pcm.shape == want.pcm.shape and rel_err(torch.from_numpy(pcm), torch.from_numpy(want.pcm)) < 1e-4
    for sid in ids:
        assert _call(server, "DELETE", f"/v1/duplex/sessions/{sid}")[0] == 200


def test_refusals(server, user_audio, monkeypatch):
    sid = _call(server, "POST", "/v1/duplex/sessions", {})[1]["id"]
    code, err = _call(server, "POST", f"/v1/duplex/sessions/{sid}/seconds", {"audio": "AAAA"})
    assert code == 400 and err["error"]["param"] == "audio" and "exactly one second" in err["error"]["message"]
    code, err = _call(server, "POST", "/v1/duplex/sessions/duplex-none/seconds", {"audio": "AAAA"})
    assert code == 404 and "open a new one" in err["error"]["message"]
    code, err = _call(server, "POST", "/v1/duplex/sessions", {"voice": "zoe"})
    assert code == 400 and "anna" in err["error"]["message"]
    code, err = _call(server, "POST", "/v1/chat/completions", {"messages": []})
    assert code == 404 and "--mode turn" in err["error"]["message"]
    # a second while the session's last one is still being answered: 409
    release, entered = threading.Event(), threading.Event()
    step = server.duplex.batch.step

    def slow_step(inputs):
        entered.set()
        release.wait(60)
        return step(inputs)

    monkeypatch.setattr(server.duplex.batch, "step", slow_step)
    first = threading.Thread(target=_call, args=(server, "POST", f"/v1/duplex/sessions/{sid}/seconds",
                                                 _second(user_audio, 0)))
    first.start()
    assert entered.wait(60)
    code, err = _call(server, "POST", f"/v1/duplex/sessions/{sid}/seconds", _second(user_audio, 1))
    release.set()
    first.join(300)
    assert code == 409 and "after its unit came back" in err["error"]["message"]
    assert _call(server, "DELETE", f"/v1/duplex/sessions/{sid}")[0] == 200


def test_an_idle_session_expires_and_frees_its_seat(server, monkeypatch):
    monkeypatch.setattr(server.duplex, "idle_timeout_s", 0.5)
    sid = _call(server, "POST", "/v1/duplex/sessions", {})[1]["id"]
    deadline = time.time() + 30
    while server.duplex.open_sessions and time.time() < deadline:
        time.sleep(0.2)
    code, err = _call(server, "DELETE", f"/v1/duplex/sessions/{sid}")
    assert code == 404 and "expired after 0.5 s idle" in err["error"]["message"]
    assert len(server.duplex._free) == server.duplex.seats


def test_parse_second_checks_every_field():
    one = base64.b64encode(np.zeros(16000, "<i2").tobytes()).decode()
    png = io.BytesIO()
    Image.new("L", (8, 6), 200).save(png, format="PNG")
    x = parse_second({"audio": one, "frame": base64.b64encode(png.getvalue()).decode(), "force_listen": True})
    assert x.audio.shape == (16000,) and x.frame.mode == "RGB" and x.frame.size == (8, 6) and x.force_listen
    at8k = parse_second({"audio": base64.b64encode(np.full(8000, 16384, "<i2").tobytes()).decode(),
                         "sample_rate": 8000})
    assert at8k.sample_rate == 8000 and np.all(at8k.audio == 0.5)
    for body, param in (([], None), ({"audio": one, "extra": 1}, "extra"), ({"audio": "!!"}, "audio"),
                        ({"audio": one, "sample_rate": 44}, "sample_rate"), ({"audio": one, "frame": "AAAA"}, "frame"),
                        ({"audio": one, "force_listen": 1}, "force_listen")):
        with pytest.raises(ApiError) as info:
            parse_second(body)
        assert info.value.status == 400 and info.value.param == param, info.value.message


class _WebSocketClient:
    """A minimal RFC 6455 client (masked frames, the handshake's accept key computed here), for the tests."""

    def __init__(self, server, path="/v1/duplex/realtime", headers: str = ""):
        host, port = server.server_address[:2]
        self.sock = socket.create_connection((host, port), timeout=300)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n{headers}"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        self.f = self.sock.makefile("rb")
        self.status = int(self.f.readline().split()[1])
        self.headers = {}
        while (line := self.f.readline().decode().strip()):
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        want = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        self.accepted = self.status == 101 and self.headers.get("sec-websocket-accept") == want

    def send(self, opcode: int, payload: bytes, fin: bool = True) -> None:
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([(0x80 if fin else 0) | opcode])
        head += bytes([0x80 | n]) if n < 126 else (bytes([0x80 | 126]) + struct.pack("!H", n) if n < 65536
                                                   else bytes([0x80 | 127]) + struct.pack("!Q", n))
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def send_json(self, obj) -> None:
        self.send(0x1, json.dumps(obj).encode())

    def recv(self) -> tuple[int, bytes]:
        b0, b1 = self.f.read(2)
        assert not b1 & 0x80, "server frames are never masked"
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", self.f.read(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", self.f.read(8))
        return b0 & 0x0F, self.f.read(n)

    def recv_json(self) -> dict:
        opcode, data = self.recv()
        assert opcode == 0x1, (opcode, data)
        return json.loads(data)


def test_a_realtime_websocket_session_answers_as_the_conversation_would(server, tiny_ckpt, voice, user_audio):
    ws = _WebSocketClient(server)
    assert ws.accepted, (ws.status, ws.headers)
    ws.send_json({"type": "session.open", "seed": 1})
    opened = ws.recv_json()
    assert opened["type"] == "session.opened" and opened["voice"] == "anna"
    ref = _reference(tiny_ckpt, voice, user_audio, 1)
    for k in range(SECONDS):
        msg = json.dumps({"type": "input.second", **_second(user_audio, k)}).encode()
        if k == 1:      # a fragmented message with a ping between its fragments: the pong comes first
            ws.send(0x1, msg[:100], fin=False)
            ws.send(0x9, b"hi")
            ws.send(0x0, msg[100:])
            assert ws.recv() == (0xA, b"hi")
        else:
            ws.send(0x1, msg)
        unit = ws.recv_json()
        assert unit["type"] == "unit" and unit["session"] == opened["id"]
        assert (unit["index"], unit["text"], unit["listen"]) == (ref[k].index, ref[k].text, ref[k].listen)
        assert base64.b64decode(unit["audio"]) == pcm16(ref[k].pcm)
    ws.send_json({"type": "session.close"})
    closed = ws.recv_json()
    assert closed["type"] == "session.closed" and base64.b64decode(closed["audio"]) == pcm16(ref[-1])
    ws.send(0x8, struct.pack("!H", 1000))
    assert ws.recv() == (0x8, struct.pack("!H", 1000))
    assert server.duplex.open_sessions == 0


def test_realtime_refusals_keep_the_connection_and_a_dropped_one_frees_its_seat(server):
    ws = _WebSocketClient(server)
    for msg, words in (({"type": "input.second", "audio": ""}, "send session.open first"),
                       ({"type": "hello"}, "input.second, input.audio or session.close"), ("[1]", "message type")):
        ws.send_json(msg) if isinstance(msg, dict) else ws.send(0x1, msg.encode())
        err = ws.recv_json()
        assert err["type"] == "error" and err["status"] == 400 and words in err["error"]["message"], err
    ws.send(0x1, b"{not json")
    assert "not JSON" in ws.recv_json()["error"]["message"]
    ws.send_json({"type": "session.open"})
    assert ws.recv_json()["type"] == "session.opened" and server.duplex.open_sessions == 1
    ws.send_json({"type": "input.second", "audio": "AAAA"})
    err = ws.recv_json()
    assert err["error"]["param"] == "audio" and "exactly one second" in err["error"]["message"]
    ws.send(0x2, b"\x00\x01")       # binary: the protocol is JSON text
    opcode, data = ws.recv()
    assert opcode == 0x8 and struct.unpack("!H", data[:2])[0] == 1003
    ws.sock.close()
    deadline = time.time() + 30
    while server.duplex.open_sessions and time.time() < deadline:
        time.sleep(0.1)
    assert server.duplex.open_sessions == 0 and len(server.duplex._free) == server.duplex.seats


def test_realtime_needs_a_websocket_handshake(server):
    code, err = _call(server, "GET", "/v1/duplex/realtime")
    assert code == 426 and "WebSocket" in err["error"]["message"]


def test_a_browser_may_send_the_api_key_as_a_websocket_subprotocol(server):
    """Browsers cannot set Authorization on a WebSocket: with --api-key, the realtime route also takes the key
    as the subprotocol 'minicpmo-rt.key.KEY' beside 'minicpmo-rt', and answers 'minicpmo-rt' (never the key).
    A wrong key, or none, is refused with 401 before the upgrade; other routes still need the header."""
    keyed = Server(("127.0.0.1", 0), "tiny-test", duplex=server.duplex, api_key="s3cret")
    threading.Thread(target=keyed.serve_forever, daemon=True).start()
    try:
        for headers in ("", "Sec-WebSocket-Protocol: minicpmo-rt, minicpmo-rt.key.wrong\r\n"):
            ws = _WebSocketClient(keyed, headers=headers)
            assert ws.status == 401 and not ws.accepted
            ws.sock.close()
        ws = _WebSocketClient(keyed, headers="Sec-WebSocket-Protocol: minicpmo-rt, minicpmo-rt.key.s3cret\r\n")
        assert ws.accepted and ws.headers.get("sec-websocket-protocol") == "minicpmo-rt"
        ws.send(0x8, b"")                                   # close
        ws.sock.close()
        ws = _WebSocketClient(keyed, headers="Authorization: Bearer s3cret\r\n")
        assert ws.accepted and "sec-websocket-protocol" not in ws.headers
        ws.send(0x8, b"")
        ws.sock.close()
        req = urllib.request.Request(keyed.url + "/v1/duplex/sessions", b"{}",
                                     headers={"Sec-WebSocket-Protocol": "minicpmo-rt.key.s3cret"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=60)
        assert info.value.code == 401
    finally:
        keyed.shutdown()
        keyed.server_close()


def test_realtime_audio_in_pieces_of_any_length_is_cut_into_the_conversations_seconds(server, tiny_ckpt, voice,
                                                                                      user_audio):
    """``input.audio`` pieces of a quarter second (as a microphone sends them): a unit comes back each time a
    whole second has arrived, equal to the same conversation fed whole seconds; an input.second while part of
    a second waits is refused (409), as is a change of sample rate; closing reports the samples left over."""
    ws = _WebSocketClient(server)
    ws.send_json({"type": "session.open", "seed": 1})
    opened = ws.recv_json()
    ref = _reference(tiny_ckpt, voice, user_audio, 1)
    piece = 4000
    for j in range(SECONDS * 16000 // piece):
        chunk = user_audio[j * piece:(j + 1) * piece]
        ws.send_json({"type": "input.audio", "audio": base64.b64encode(chunk.tobytes()).decode()})
        if (j + 1) * piece % 16000 == 0:
            unit = ws.recv_json()
            k = (j + 1) * piece // 16000 - 1
            assert unit["type"] == "unit" and unit["session"] == opened["id"] and unit["index"] == ref[k].index
            assert (unit["text"], unit["listen"]) == (ref[k].text, ref[k].listen)
            assert base64.b64decode(unit["audio"]) == pcm16(ref[k].pcm)
    ws.send_json({"type": "input.audio", "audio": base64.b64encode(bytes(2000)).decode()})      # 1000 samples
    ws.send_json({"type": "input.second", **_second(user_audio, 0)})
    err = ws.recv_json()
    assert err["status"] == 409 and "1000 samples" in err["error"]["message"]
    ws.send_json({"type": "input.audio", "audio": base64.b64encode(bytes(2000)).decode(), "sample_rate": 24000})
    err = ws.recv_json()
    assert err["status"] == 400 and err["error"]["param"] == "sample_rate"
    ws.send_json({"type": "session.close"})
    closed = ws.recv_json()
    assert closed["type"] == "session.closed" and closed["dropped_samples"] == 1000
    assert base64.b64decode(closed["audio"]) == pcm16(ref[-1])
    ws.send(0x8, struct.pack("!H", 1000))
    assert ws.recv() == (0x8, struct.pack("!H", 1000))


def test_audio_buffer_carries_the_latest_frame_and_any_barge_in_to_its_second():
    from minicpmo_rt.serving.duplex import AudioBuffer

    buf = AudioBuffer()
    png = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(png, "PNG")
    frame = base64.b64encode(png.getvalue()).decode()
    half = base64.b64encode(np.arange(8000, dtype="<i2").tobytes()).decode()
    assert buf.add({"audio": half, "frame": frame}) == [] and buf.pending_samples == 8000
    (second,) = buf.add({"audio": half, "force_listen": True})
    assert second.frame.size == (8, 6) and second.force_listen and second.audio.shape == (16000,)
    assert np.array_equal(second.audio[:8000] * 32768, np.arange(8000))
    (second,) = buf.add({"audio": base64.b64encode(bytes(32000)).decode()})
    assert second.frame is None and not second.force_listen and buf.pending_samples == 0
    with pytest.raises(ApiError, match="whole number"):
        buf.add({"audio": base64.b64encode(b"abc").decode()})
