"""`minicpmo-rt serve` as a user runs it: a process that listens, answers, and stops on Ctrl-C."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def _serve(tiny_ckpt, voice, *extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minicpmo_rt.cli", "serve", "--model", str(tiny_ckpt), "--voice", f"anna={voice}",
           "--min-codes", "5", "--n-timesteps", "2", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # a shell without job control starts `cmd &` with SIGINT ignored, exec keeps that, and Python then installs no
    # Ctrl-C handler: a test run launched that way would see the server ignore SIGINT. Start it as a terminal would.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _url(proc: subprocess.Popen, timeout: float = 240.0) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("serving "):
            return line.split(" on ", 1)[1].split(" ", 1)[0]
    proc.kill()
    pytest.fail(f"serve did not start: {proc.stderr.read()[-2000:]}")


def test_serve_answers_then_stops_on_ctrl_c(tiny_ckpt, voice):
    proc = _serve(tiny_ckpt, voice, "--port", "0")
    try:
        url = _url(proc)
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "modalities": ["text", "audio"],
                           "max_tokens": 4, "max_codes": 30}).encode()
        answer = json.load(urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", body),
                                                  timeout=240))
        assert answer["choices"][0]["message"]["audio"]["format"] == "wav"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_taken_port_fails_with_a_message_before_loading(tiny_ckpt, voice):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _serve(tiny_ckpt, voice, "--port", str(port))
        _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err, err


def test_serve_duplex_mode_opens_a_session_steps_a_second_and_stops_on_sigterm(tiny_ckpt, voice):
    import base64

    proc = _serve(tiny_ckpt, voice, "--port", "0", "--mode", "duplex", "--seats", "1")
    try:
        url = _url(proc)

        def call(method, path, body):
            req = urllib.request.Request(url + path, json.dumps(body).encode(), method=method)
            return json.load(urllib.request.urlopen(req, timeout=240))

        sid = call("POST", "/v1/duplex/sessions", {"seed": 3})["id"]
        second = base64.b64encode(bytes(32000)).decode()       # one second of silence
        unit = call("POST", f"/v1/duplex/sessions/{sid}/seconds", {"audio": second})
        assert unit["index"] == 0 and unit["sample_rate"] == 24000
        assert call("DELETE", f"/v1/duplex/sessions/{sid}", {})["closed"]
        proc.send_signal(signal.SIGTERM)      # as systemd or docker stop would
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_certificate_without_its_key_is_refused_before_loading(tiny_ckpt, voice, tmp_path):
    proc = _serve(tiny_ckpt, voice, "--port", "0", "--tls-cert", str(tmp_path / "cert.pem"))
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2 and "--tls-cert and --tls-key together" in err, err
    proc = _serve(tiny_ckpt, voice, "--port", "0", "--tls-cert", str(tmp_path / "c.pem"), "--tls-key",
                  str(tmp_path / "k.pem"))
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2 and "cannot load them" in err, err


def test_a_talker_lead_without_joining_is_refused_before_loading(tiny_ckpt, voice):
    proc = _serve(tiny_ckpt, voice, "--port", "0", "--talker-lead", "1.0")
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2 and "pass it with --mode turn and --join-running" in err, err
    proc = _serve(tiny_ckpt, voice, "--port", "0", "--join-running", "--talker-lead", "-1")
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2 and "--talker-lead must be a number of seconds >= 0, got -1.0" in err, err
