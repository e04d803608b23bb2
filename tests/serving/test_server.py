"""The HTTP server on the tiny checkpoint: real sockets, the real turn pipeline, answers compared with the
pipeline's own turns (same messages and seed)."""

import base64
import http.client
import io
import json
import threading
import urllib.error
import urllib.request
from functools import lru_cache

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import rel_err
from minicpmo_rt.errors import InputError
from minicpmo_rt.runtime.contracts import TurnRequest
from minicpmo_rt.runtime.turn import TurnPipeline, TurnTrace, collect
from minicpmo_rt.serving.http import Server
from minicpmo_rt.serving.openai_api import parse_chat, pcm16
from minicpmo_rt.serving.turns import Audio, Done, Failed, Text, TurnService
from minicpmo_rt.serving.voices import parse_voices
from minicpmo_rt.talker.sampler import SamplingParams

USER = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(tiny_ckpt, voice):
    pipe = TurnPipeline.from_snapshot(tiny_ckpt, capacity=2, n_timesteps=2, talker_params=SamplingParams(min_codes=5))
    service = TurnService(pipe, {"anna": voice})
    srv = Server(("127.0.0.1", 0), "tiny-test", turns=service)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    service.close(timeout=60)


def _post(srv, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + "/v1/chat/completions", data, {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300)


def _refused(srv, body=None, raw=None, method="POST", path="/v1/chat/completions") -> tuple[int, dict]:
    if method == "GET":
        req = urllib.request.Request(srv.url + path)
    else:
        req = urllib.request.Request(srv.url + path, raw if raw is not None else json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    return info.value.code, json.loads(info.value.read())


@lru_cache(maxsize=None)
def _reference(pipe, voice, seed: int, max_tokens: int = 6, max_codes: int = 30):
    """The pipeline's own turn (no server): (24 kHz samples, transcript, generated token count)."""
    trace = TurnTrace()
    req = TurnRequest.make(f"ref-{seed}", USER, voice, seed, max_tokens, max_codes)
    wav = collect(list(pipe.run([req], trace)))[req.request_id]
    return wav, trace.talker_inputs[req.request_id].text, len(trace.steps[req.request_id])


def _record_runs(monkeypatch, pipe, entry=lambda requests, kw: len(requests)) -> list:
    """``pipe.run`` patched to note each call (``entry``: what to note) before running it; the notes."""
    calls = []
    run = pipe.run

    def recording_run(requests, *args, **kw):
        calls.append(entry(requests, kw))
        return run(requests, *args, **kw)

    monkeypatch.setattr(pipe, "run", recording_run)
    return calls


def _events(resp) -> list:
    out = []
    for block in resp.read().decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_models_and_refusals(server):
    health = json.load(urllib.request.urlopen(server.url + "/health?verbose=1", timeout=60))   # a query is no route
    assert health == {"status": "ok", "mode": "turn", "model": "tiny-test", "voices": ["anna"], "queued": 0}
    models = json.load(urllib.request.urlopen(server.url + "/v1/models", timeout=60))
    assert [m["id"] for m in models["data"]] == ["tiny-test"]
    code, body = _refused(server, method="GET", path="/nope")
    assert code == 404 and "/v1/chat/completions" in body["error"]["message"]
    assert _refused(server, method="GET")[0] == 405
    assert _refused(server, {"messages": USER}, path="/v1/completions")[0] == 404
    code, body = _refused(server, {}, path="/v1/duplex/sessions")
    assert code == 404 and "--mode duplex" in body["error"]["message"]
    code, body = _refused(server, method="GET", path="/v1/duplex/realtime")
    assert code == 404 and "--mode duplex" in body["error"]["message"]
    code, body = _refused(server, raw=b"{not json")
    assert code == 400 and "not JSON" in body["error"]["message"]
    code, body = _refused(server, {"messages": USER, "modalities": ["text", "audio"], "audio": {"voice": "zoe"}})
    assert code == 400 and body["error"]["param"] == "audio.voice" and "anna" in body["error"]["message"]
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)    # no Content-Length
    conn.putrequest("POST", "/v1/chat/completions")
    conn.endheaders()
    assert conn.getresponse().status == 411
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Length": str(1 << 30)})
    assert conn.getresponse().status == 413


def test_spoken_answer_is_the_pipelines_own_turn(server, voice):
    body = json.load(_post(server, {"messages": USER, "modalities": ["text", "audio"], "seed": 3, "max_tokens": 6,
                                    "max_codes": 30}))
    wav, text, n = _reference(server.turns.pipe, voice, 3)
    choice = body["choices"][0]
    audio = choice["message"]["audio"]
    samples, sr = sf.read(io.BytesIO(base64.b64decode(audio["data"])), dtype="int16")
    assert sr == 24000 and audio["format"] == "wav" and len(samples) > 0
    assert np.array_equal(samples, np.frombuffer(pcm16(wav), "<i2"))
    assert audio["transcript"] == text and choice["message"]["content"] is None
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == n == 6


def test_stream_sends_the_transcript_then_pcm16_chunks(server, voice):
    events = _events(_post(server, {"messages": USER, "modalities": ["text", "audio"], "seed": 3, "max_tokens": 6,
                                    "max_codes": 30, "stream": True}))
    wav, text, n = _reference(server.turns.pipe, voice, 3)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": None}
    kinds = ["transcript" if "transcript" in d.get("audio", {}) else "data" for d in deltas[1:-1]]
    n_text = kinds.index("data")
    assert n_text >= 1 and kinds == ["transcript"] * n_text + ["data"] * (len(kinds) - n_text)  # text first
    assert "".join(d["audio"]["transcript"] for d in deltas[1:1 + n_text]) == text
    chunks = [base64.b64decode(d["audio"]["data"]) for d in deltas[1 + n_text:-1]]
    assert len(chunks) >= 2 and b"".join(chunks) == pcm16(wav)
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == n


def test_text_answer_is_the_thinkers_text(server):
    pipe = server.turns.pipe
    steps = [s for chunk in pipe.think(TurnRequest.make("ref", USER, None, 5, 6)) for s in chunk]
    want = "".join(s.text for s in steps if not s.is_terminator)
    body = json.load(_post(server, {"messages": USER, "seed": 5, "max_tokens": 6}))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want}
    events = _events(_post(server, {"messages": USER, "seed": 5, "max_tokens": 6, "stream": True}))
    pieces = [e["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert "".join(pieces) == want and len(pieces) == sum(not s.is_terminator for s in steps)


def test_concurrent_requests_share_a_batch_and_each_is_its_solo_turn(server, voice, monkeypatch):
    """Two clients at once: one ``TurnPipeline.run`` of both; each gets its own turn's transcript and audio."""
    pipe, service = server.turns.pipe, server.turns
    refs = {seed: _reference(pipe, voice, seed) for seed in (3, 4)}
    batches = _record_runs(monkeypatch, pipe)
    monkeypatch.setattr(service, "batch_wait_s", 2.0)
    got = {}

    def ask(seed):
        got[seed] = json.load(_post(server, {"messages": USER, "modalities": ["text", "audio"], "seed": seed,
                                             "max_tokens": 6, "max_codes": 30, "audio": {"format": "pcm16"}}))

    threads = [threading.Thread(target=ask, args=(s,)) for s in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert batches == [2]
    for seed, (wav, text, _) in refs.items():
        audio = got[seed]["choices"][0]["message"]["audio"]
        assert audio["transcript"] == text
        # batched Code2Wav calls sum in another order (test_turn: within 1e-5 of each request alone), and 16-bit
        # rounding adds at most half a step (1.5e-5 of full scale; this noise is near full scale)
        pcm = np.frombuffer(base64.b64decode(audio["data"]), "<i2") / 32767.0
        assert pcm.shape == wav.shape and rel_err(torch.from_numpy(pcm), torch.from_numpy(wav).double()) < 1e-4


def test_a_bad_request_fails_alone_and_its_batch_mate_is_answered_once(server, voice, monkeypatch):
    """The second request's prompt is refused at its prefill, after the first one's text went out: the batch
    is rerun request by request, the bad one is refused (its message names the problem), and the good one's
    text is not sent twice; its answer is its solo turn. Every refusal of the pipeline's own is made before a
    run starts (``TurnRequest.make``), so the refusal at the prefill is injected: the pipeline's prompt step
    raises the InputError it would raise for a bad prompt, for that request only."""
    service = server.turns
    monkeypatch.setattr(service, "batch_wait_s", 2.0)
    voices = list(service.voices)
    prompt = service.pipe._prompt

    def refuse_second(req):
        if req.messages[-1]["content"] == "Name a fruit.":
            raise InputError(f"request {req.request_id!r}: refused at its prefill")
        return prompt(req)

    monkeypatch.setattr(service.pipe, "_prompt", refuse_second)
    good = service.submit(parse_chat({"messages": USER, "modalities": ["text", "audio"], "max_tokens": 6,
                                      "max_codes": 30, "seed": 3}, voices))
    bad = service.submit(parse_chat({"messages": [{"role": "user", "content": "Name a fruit."}],
                                     "modalities": ["text", "audio"], "max_tokens": 6, "max_codes": 30}, voices))
    bad_events = list(bad.events(timeout=300))
    assert len(bad_events) == 1 and isinstance(bad_events[0], Failed) and bad_events[0].bad_request
    assert "refused at its prefill" in bad_events[0].message
    events = list(good.events(timeout=300))
    assert isinstance(events[-1], Done)
    wav, text, _ = _reference(service.pipe, voice, 3)
    assert "".join(e.text for e in events if isinstance(e, Text)) == text
    assert np.array_equal(np.concatenate([e.samples for e in events if isinstance(e, Audio)]), wav)


def test_a_voice_that_cannot_be_read_is_refused_at_start(server, tmp_path):
    broken = tmp_path / "broken.wav"
    broken.write_text("not audio")
    with pytest.raises(InputError, match="broken.wav: cannot be read as audio"):
        TurnService(server.turns.pipe, {"anna": broken})


def test_voices_are_named_and_checked(tmp_path, voice):
    assert parse_voices([str(voice), f"b={voice}"]) == {voice.stem: voice, "b": voice}
    for specs, words in (([], "at least one"), ([f"a={voice}", f"a={voice}"], "is taken"),
                         ([str(tmp_path / "none.wav")], "is not a file"), (["=x"], "NAME=PATH")):
        with pytest.raises(InputError, match=words):
            parse_voices(specs)


def test_connections_persist_between_json_answers_and_close_after_an_unread_body(server):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    sock = conn.sock
    assert not r.will_close and sock is not None
    conn.request("GET", "/v1/models")
    r = conn.getresponse()
    assert r.status == 200 and not r.will_close and conn.sock is sock      # the same connection
    assert json.loads(r.read())["data"]
    conn.request("POST", "/v1/nope", body=b'{"x": 1}', headers={"Content-Length": "8"})
    r = conn.getresponse()
    assert r.status == 404 and r.will_close and r.getheader("Connection") == "close"     # its body was never read
    r.read()
    conn.request("GET", "/health")          # http.client opens a new connection
    assert conn.getresponse().status == 200


def test_an_api_key_guards_every_route_but_health(server):
    keyed = Server(("127.0.0.1", 0), "tiny-test", turns=server.turns, api_key="s3cret")
    threading.Thread(target=keyed.serve_forever, daemon=True).start()
    try:
        assert urllib.request.urlopen(keyed.url + "/health", timeout=60).status == 200
        for path, data in (("/v1/models", None), ("/v1/chat/completions", json.dumps({"messages": USER}).encode())):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(urllib.request.Request(keyed.url + path, data), timeout=60)
            assert info.value.code == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"
            assert "Authorization: Bearer" in json.loads(info.value.read())["error"]["message"]
        ok = urllib.request.Request(keyed.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert json.load(urllib.request.urlopen(ok, timeout=60))["data"][0]["id"] == "tiny-test"
    finally:
        keyed.shutdown()
        keyed.server_close()


def test_a_turn_that_ends_without_its_final_chunk_fails_instead_of_hanging(server, monkeypatch):
    service = server.turns
    monkeypatch.setattr(service.pipe, "run", lambda requests, trace=None, admit=None: iter(()))
    ticket = service.submit(parse_chat({"messages": USER, "modalities": ["text", "audio"]}, list(service.voices)))
    (event,) = list(ticket.events(timeout=60))
    assert isinstance(event, Failed) and not event.bad_request and "final audio chunk" in event.message


def test_a_spoken_question_about_a_picture_is_the_pipelines_own_turn(server, voice):
    """``input_audio`` (a WAV) and ``image_url`` (a PNG data URL) parts over HTTP: the answer's transcript and
    PCM16 samples are those of ``TurnPipeline.run`` on the same recording and picture as AudioPart/ImagePart."""
    from PIL import Image

    from minicpmo_rt.runtime.contracts import AudioPart, ImagePart

    rng = np.random.default_rng(9)
    wave = (rng.standard_normal(20000) * 0.1).astype(np.float32)
    wav = io.BytesIO()
    sf.write(wav, wave, 16000, format="WAV", subtype="FLOAT")
    picture = Image.fromarray((rng.random((70, 110, 3)) * 255).astype(np.uint8))
    png = io.BytesIO()
    picture.save(png, "PNG")
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue())
                                                   .decode()}},
               {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(),
                                                       "format": "wav"}},
               {"type": "text", "text": "What is it?"}]
    body = json.load(_post(server, {"messages": [{"role": "user", "content": content}],
                                    "modalities": ["text", "audio"], "seed": 5, "max_tokens": 6, "max_codes": 30}))
    trace = TurnTrace()
    req = TurnRequest.make("ref-omni", [{"role": "user", "content": [ImagePart.from_image(picture),
                                                                     AudioPart(wave), "What is it?"]}],
                           voice, 5, 6, 30)
    ref = collect(list(server.turns.pipe.run([req], trace)))["ref-omni"]
    audio = body["choices"][0]["message"]["audio"]
    samples, _ = sf.read(io.BytesIO(base64.b64decode(audio["data"])), dtype="int16")
    assert audio["transcript"] == trace.talker_inputs["ref-omni"].text
    assert np.array_equal(samples, np.frombuffer(pcm16(ref), "<i2"))
    assert body["usage"]["prompt_tokens"] == trace.steps["ref-omni"][0].position     # the placeholders counted


def test_a_spoken_request_that_arrives_mid_batch_waits_for_the_next_by_default(server, voice, monkeypatch):
    """Without join_running (the default), a spoken request submitted while a run is under way gets a run of its
    own after it, and its answer is its solo turn."""
    pipe, service = server.turns.pipe, server.turns
    wav4, text4, _ = _reference(pipe, voice, 4)
    batches = _record_runs(monkeypatch, pipe, lambda requests, kw: (len(requests), kw.get("admit") is not None))
    monkeypatch.setattr(service, "batch_wait_s", 0.0)
    voices = list(service.voices)
    body = {"messages": USER, "modalities": ["text", "audio"], "max_tokens": 6, "max_codes": 30}
    a = service.submit(parse_chat({**body, "seed": 3}, voices))
    events_a = a.events(timeout=300)
    assert isinstance(next(events_a), Text)
    b = service.submit(parse_chat({**body, "seed": 4}, voices))
    list(events_a)
    events_b = list(b.events(timeout=300))
    assert batches == [(1, False), (1, False)]
    assert "".join(e.text for e in events_b if isinstance(e, Text)) == text4
    assert np.array_equal(np.concatenate([e.samples for e in events_b if isinstance(e, Audio)]), wav4)


@pytest.mark.parametrize("lead", [None, 1.0])
def test_a_spoken_request_that_arrives_mid_batch_joins_it(server, voice, monkeypatch, lead):
    """With join_running, a second spoken request submitted while the first one's run is under way joins that run (one
    ``TurnPipeline.run`` in all) and both answers are their solo turns, with the Talker's lead too (``serve
    --talker-lead``); a text-only request that arrives meanwhile is set aside and answered after the batch."""
    pipe, service = server.turns.pipe, server.turns
    monkeypatch.setattr(pipe, "talker_lead_s", lead)
    refs = {seed: _reference(pipe, voice, seed) for seed in (3, 4)}
    steps = [s for chunk in pipe.think(TurnRequest.make("ref", USER, None, 5, 6)) for s in chunk]
    want_text = "".join(s.text for s in steps if not s.is_terminator)
    batches = _record_runs(monkeypatch, pipe)
    monkeypatch.setattr(service, "batch_wait_s", 0.0)
    monkeypatch.setattr(service, "join_running", True)
    voices = list(service.voices)

    def spoken(seed):
        return parse_chat({"messages": USER, "modalities": ["text", "audio"], "seed": seed, "max_tokens": 6,
                           "max_codes": 30}, voices)

    a = service.submit(spoken(3))
    events_a = a.events(timeout=300)
    first = next(events_a)
    assert isinstance(first, Text)                                  # a's run is under way
    b = service.submit(spoken(4))
    c = service.submit(parse_chat({"messages": USER, "seed": 5, "max_tokens": 6}, voices))
    got = {3: [first, *events_a], 4: list(b.events(timeout=300))}
    text_events = list(c.events(timeout=300))
    assert batches == [1]                                           # b joined a's run
    for seed, events in got.items():
        wav, text, _ = refs[seed]
        assert isinstance(events[-1], Done)
        assert "".join(e.text for e in events if isinstance(e, Text)) == text
        samples = np.concatenate([e.samples for e in events if isinstance(e, Audio)])
        assert samples.shape == wav.shape and rel_err(torch.from_numpy(samples), torch.from_numpy(wav)) < 1e-5
    assert isinstance(text_events[-1], Done)
    assert "".join(e.text for e in text_events if isinstance(e, Text)) == want_text


def _self_signed(tmp_path):
    """A throwaway certificate for 127.0.0.1 (the openssl command makes it; the standard library cannot)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_tls_serves_https_and_a_plain_http_client_does_not_stop_it(server, tmp_path):
    """With a certificate the server speaks HTTPS only: a client that trusts the certificate gets its answers
    while another connection stalls its handshake (each handshake runs on its connection's thread), a plain-HTTP
    client on the same port is dropped and the next HTTPS client is served; unreadable certificate files are
    named."""
    import ssl

    from minicpmo_rt.errors import InputError
    from minicpmo_rt.serving.http import tls_context

    cert, key = _self_signed(tmp_path)
    secure = Server(("127.0.0.1", 0), "tiny-test", turns=server.turns, tls=tls_context(str(cert), str(key)))
    threading.Thread(target=secure.serve_forever, daemon=True).start()
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        assert secure.url.startswith("https://")
        import socket

        staller = socket.create_connection(secure.server_address[:2])      # connects, never says hello
        health = json.load(urllib.request.urlopen(secure.url + "/health", timeout=20, context=trust))
        assert health["status"] == "ok"
        staller.close()
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
            urllib.request.urlopen(secure.url.replace("https", "http") + "/health", timeout=60)
        with pytest.raises(urllib.error.URLError):                       # a client that does not trust it
            urllib.request.urlopen(secure.url + "/health", timeout=60)
        body = json.load(urllib.request.urlopen(urllib.request.Request(
            secure.url + "/v1/chat/completions", json.dumps({"messages": USER, "max_tokens": 3}).encode()),
            timeout=300, context=trust))
        assert body["choices"][0]["message"]["content"]
    finally:
        secure.shutdown()
        secure.server_close()
    with pytest.raises(InputError, match="cannot load them"):
        tls_context(str(tmp_path / "missing.pem"), str(key))


def test_a_burst_of_connections_is_queued_not_dropped(server):
    """More new connections at once than socketserver's default backlog (5) all complete their handshake at once
    (the kernel drops the SYNs past the backlog, and clients resend them only after a second)."""
    import socket

    idle = Server(("127.0.0.1", 0), "tiny-test", turns=server.turns)     # listening, not yet accepting
    try:
        assert idle.request_queue_size >= 32
        conns = []
        for _ in range(32):
            conns.append(socket.create_connection(idle.server_address[:2], timeout=0.5))
        for c in conns:
            c.close()
    finally:
        idle.server_close()
