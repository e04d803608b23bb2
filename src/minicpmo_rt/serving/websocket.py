"""The server side of RFC 6455 WebSockets, as much as a JSON message protocol needs (standard library only).

``accept_key`` answers the opening handshake; ``Connection`` reads whole messages (fragments joined, every
client frame unmasked, pings answered with pongs) and sends text frames and the close handshake. Messages past
``max_bytes`` and protocol errors end the connection with the matching close code.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import threading
from typing import BinaryIO

import numpy as np

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
# close codes
NORMAL, PROTOCOL_ERROR, UNSUPPORTED_DATA, INVALID_PAYLOAD, TOO_BIG = 1000, 1002, 1003, 1007, 1009


def accept_key(key: str) -> str:
    """Sec-WebSocket-Accept for a client's Sec-WebSocket-Key."""
    return base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()


class Closed(Exception):
    """The connection is over: the peer closed it (``code``), or it broke a rule (``code``, ``reason``)."""

    def __init__(self, code: int, reason: str = ""):
        super().__init__(f"{code} {reason}".strip())
        self.code, self.reason = code, reason


class Connection:
    """One upgraded connection: ``receive()`` the next text message, ``send_text``, ``close``."""

    def __init__(self, rfile: BinaryIO, wfile: BinaryIO, max_bytes: int = 1 << 20):
        self.rfile, self.wfile, self.max_bytes = rfile, wfile, max_bytes
        self._send_lock = threading.Lock()
        self.closed = False

    def _read(self, n: int) -> bytes:
        data = self.rfile.read(n)
        if len(data) < n:
            raise Closed(PROTOCOL_ERROR, "the connection ended inside a frame")
        return data

    def _frame(self) -> tuple[bool, int, bytes]:
        b0, b1 = self._read(2)
        fin, opcode = bool(b0 & 0x80), b0 & 0x0F
        if b0 & 0x70:
            raise Closed(PROTOCOL_ERROR, "reserved bits set (no extension was negotiated)")
        if not b1 & 0x80:
            raise Closed(PROTOCOL_ERROR, "client frames must be masked")
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", self._read(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", self._read(8))
        if opcode >= CLOSE and (n > 125 or not fin):
            raise Closed(PROTOCOL_ERROR, "a control frame must be whole and at most 125 bytes")
        if n > self.max_bytes:
            raise Closed(TOO_BIG, f"a frame of {n} bytes; messages are at most {self.max_bytes}")
        mask = self._read(4)
        data = _unmask(self._read(n), mask)
        return fin, opcode, data

    def receive(self) -> str:
        """The next text message (pings answered on the way); ``Closed`` when the peer closes or errs."""
        parts: list[bytes] = []
        kind = None
        while True:
            fin, opcode, data = self._frame()
            if opcode == PING:
                self._send(PONG, data)
                continue
            if opcode == PONG:
                continue
            if opcode == CLOSE:
                code = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else NORMAL
                self.close(code)
                raise Closed(code, "closed by the client")
            if opcode == CONTINUATION:
                if kind is None:
                    raise Closed(PROTOCOL_ERROR, "a continuation frame with no message to continue")
            elif opcode in (TEXT, BINARY):
                if kind is not None:
                    raise Closed(PROTOCOL_ERROR, "a new message began before the last one ended")
                kind = opcode
            else:
                raise Closed(PROTOCOL_ERROR, f"unknown opcode {opcode}")
            parts.append(data)
            if sum(map(len, parts)) > self.max_bytes:
                raise Closed(TOO_BIG, f"messages are at most {self.max_bytes} bytes")
            if fin:
                break
        if kind == BINARY:
            raise Closed(UNSUPPORTED_DATA, "send JSON text messages (audio as base64 inside them)")
        try:
            return b"".join(parts).decode("utf-8")
        except UnicodeDecodeError:
            raise Closed(INVALID_PAYLOAD, "a text message that is not UTF-8") from None

    def _send(self, opcode: int, data: bytes) -> None:
        n = len(data)
        head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else
                                         bytes([126]) + struct.pack("!H", n) if n < 1 << 16 else
                                         bytes([127]) + struct.pack("!Q", n))
        with self._send_lock:
            self.wfile.write(head + data)
            self.wfile.flush()

    def send_text(self, text: str) -> None:
        self._send(TEXT, text.encode("utf-8"))

    def close(self, code: int = NORMAL, reason: str = "") -> None:
        """Send the close frame once (the peer's close is answered with the same code)."""
        if not self.closed:
            self.closed = True
            try:
                self._send(CLOSE, struct.pack("!H", code) + reason.encode("utf-8")[:123])
            except OSError:
                pass


def _unmask(data: bytes, mask: bytes) -> bytes:
    """XOR with the repeating 4-byte mask."""
    return (np.frombuffer(data, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), len(data))).tobytes()
