"""NIXL's handshake side channel against hostile peers, on the real listener: vLLM 0.32's
``NixlPullConnectorScheduler`` starts it (``set_xfer_handshake_metadata``, upstream's own thread
start) after :func:`server.connector.pd.side_channel.install` replaced its body, and real ZMQ
sockets talk to it on a loopback port.

Upstream's listener dies on one malformed frame and hands the metadata to anyone; each case
here fails against it (or against the planted bug named in the case)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from server.connector.pd import side_channel
from server.connector.pd.side_channel import (
    CHALLENGE,
    CHALLENGE_TTL_S,
    GET,
    HELLO,
    MAX_FRAME_BYTES,
    REFUSED,
    AuthenticatedRequester,
    SideChannelListener,
    request_mac,
)

SECRET = b"cluster-secret-of-this-test"
PAYLOAD = NixlHandshakePayload(compatibility_hash="h" * 16, agent_metadata_bytes=b"agent-meta")
ENCODED = msgspec.msgpack.encode(PAYLOAD)
WAIT_S = 10.0  # a guard against a hang only; no assertion is about time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Clock:
    """The listener's monotonic clock, moved by the test (stale challenges)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class Served:
    """A real NIXL scheduler of vLLM whose listener runs (ours when ``secret`` is set)."""

    def __init__(self, secret: bytes | None) -> None:
        self.port = _free_port()
        self.clock = Clock()
        sched = object.__new__(NixlPullConnectorScheduler)  # what its listener start reads:
        sched._nixl_handshake_listener_t = None
        sched._stop_event = threading.Event()
        sched.side_channel_host = "127.0.0.1"
        sched.side_channel_port = self.port
        self.sched = sched
        self.listener: SideChannelListener | None = (
            side_channel.install(sched, None, secret, self.clock) if secret is not None else None
        )
        sched.set_xfer_handshake_metadata({(0, 0): PAYLOAD})  # upstream starts the thread
        self.thread: threading.Thread = sched._nixl_handshake_listener_t
        self.path = f"tcp://127.0.0.1:{self.port}"
        self.ctx = zmq.Context()

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
        sock.connect(self.path)
        return sock

    def ask(self, body: bytes) -> list[bytes]:
        """One REQ round trip with a raw body."""
        with self.socket(zmq.REQ) as sock:
            sock.send(body)
            return list(sock.recv_multipart())

    def handshake(self, secret: bytes = SECRET) -> list[bytes]:
        """Upstream's requester's exact calls on our requester (``_nixl_handshake``)."""
        with self.socket(zmq.REQ) as raw:
            sock = AuthenticatedRequester(raw, secret)
            sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
            return sock.recv_multipart()

    def stop(self) -> None:
        self.sched.shutdown()
        self.ctx.destroy(linger=0)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served(SECRET)
    try:
        yield s
    finally:
        s.stop()


def _refusal(reply: list[bytes]) -> str:
    assert len(reply) == 1, f"metadata or something else came back: {len(reply)} frames"
    assert ENCODED not in reply[0]
    msg = msgspec.msgpack.decode(reply[0])
    assert msg[0] == REFUSED
    return str(msg[1])


def _challenge(s: Served, sock: zmq.Socket) -> bytes:
    sock.send(msgspec.msgpack.encode([HELLO]))
    tag, nonce = msgspec.msgpack.decode(sock.recv())
    assert tag == CHALLENGE
    return bytes(nonce)


def _get(nonce: bytes, secret: bytes = SECRET, cnonce: bytes = b"c" * 16) -> bytes:
    return msgspec.msgpack.encode(
        [GET, nonce, 0, 0, cnonce, request_mac(secret, nonce, 0, 0, cnonce)]
    )


def test_a_peer_with_the_secret_gets_the_metadata(served):
    payload, ts = served.handshake()
    assert msgspec.msgpack.Decoder(NixlHandshakePayload).decode(payload) == PAYLOAD
    assert isinstance(msgspec.msgpack.decode(ts), float)  # upstream's clock-offset echo


def test_malformed_frames_never_kill_the_listener(served):
    """The probe of issue 37: ``[b"x"]`` killed upstream's thread; a valid request afterwards
    got no answer. (Planted bug: upstream's ``identity, _, msg = frames`` and no catch.)"""
    with served.socket(zmq.DEALER) as dealer:
        dealer.send_multipart([b"x"])  # no REQ envelope: ROUTER sees [identity, b"x"]
        dealer.send_multipart([b"a", b"b", b"c", b"d"])
        # Answered only after the junk before it on this connection was read (upstream's
        # thread is dead by then and answers nothing: zmq.Again).
        dealer.send_multipart([b"", msgspec.msgpack.encode([HELLO])])
        assert msgspec.msgpack.decode(dealer.recv_multipart()[1])[0] == CHALLENGE
        dealer.send_multipart([b"", b"x" * (MAX_FRAME_BYTES + 1)])  # over the cap: cut off
    for body in (
        b"x",
        b"\xc1",  # never valid msgpack
        msgspec.msgpack.encode((GET_META_MSG, 7, 7)),  # upstream's KeyError on an unknown rank
        msgspec.msgpack.encode([GET, b"n", "pp", None, b"c", b"m"]),
        msgspec.msgpack.encode([GET, b"\0" * 40, 1 << 40, -1, b"c" * 16, b"m"]),
        msgspec.msgpack.encode({"a": [[[[[]]]]]}),
        b"\x91" * 2000,  # deep nesting
    ):
        _refusal(served.ask(body))
    assert served.thread.is_alive()
    payload, _ = served.handshake()
    assert payload == ENCODED
    assert served.listener.stats.dropped == 2 and served.listener.stats.served == 1


def test_a_request_without_the_secret_gets_no_metadata(served):
    """Upstream's unauthenticated request, a request without a MAC and one with a wrong MAC.
    (Planted bug: upstream's listener, i.e. ``install`` not called: it answers all three.)"""
    assert "unauthenticated" in _refusal(served.ask(msgspec.msgpack.encode((GET_META_MSG, 0, 0))))
    with served.socket(zmq.REQ) as sock:
        nonce = _challenge(served, sock)
        sock.send(msgspec.msgpack.encode([GET, nonce, 0, 0, b"c" * 16]))
        _refusal(sock.recv_multipart())
        nonce = _challenge(served, sock)
        sock.send(_get(nonce, secret=b"another secret"))
        assert "MAC" in _refusal(sock.recv_multipart())
    with pytest.raises(RuntimeError, match="refused"):
        served.handshake(secret=b"another secret")
    assert served.listener.stats.served == 0
    payload, _ = served.handshake()  # and it still serves the cluster
    assert payload == ENCODED


def test_a_replayed_request_is_refused(served):
    """A captured request sent again (on a new connection, as a local sniffer would).
    (Planted bug: the used-challenge check skipped.)"""
    with served.socket(zmq.REQ) as sock:
        request = _get(_challenge(served, sock))
        sock.send(request)
        assert sock.recv_multipart()[0] == ENCODED
    assert "already used" in _refusal(served.ask(request))


def test_a_stale_challenge_is_refused(served):
    """(Planted bug: the challenge's age not checked.)"""
    with served.socket(zmq.REQ) as sock:
        nonce = _challenge(served, sock)
        served.clock.offset = CHALLENGE_TTL_S + 1
        sock.send(_get(nonce))
        assert "stale" in _refusal(sock.recv_multipart())


def test_another_listeners_challenge_is_refused(served):
    """A challenge (and a request made on it) from another instance's listener is worthless
    here, whatever the clocks say. (Planted bug: nonces tagged with the cluster secret.)"""
    other = Served(SECRET)
    try:
        with other.socket(zmq.REQ) as sock:
            nonce = _challenge(other, sock)
        assert "challenge" in _refusal(served.ask(_get(nonce)))
    finally:
        other.stop()


class FakeListener:
    """A process that took the port (no secret): a challenge, then whatever it wants."""

    def __init__(self, answer: list[bytes]) -> None:
        self.port = _free_port()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for reply in ([msgspec.msgpack.encode([CHALLENGE, b"\0" * 40])], self.answer):
            identity, _, _ = self.sock.recv_multipart()
            self.sock.send_multipart([identity, b"", *reply])

    def close(self) -> None:
        self.thread.join(WAIT_S)
        self.ctx.destroy(linger=0)


def test_metadata_without_a_valid_mac_is_not_used(served):
    """A fake listener: metadata with a wrong MAC, and a real answer replayed from another
    exchange (its MAC covers another request's nonce). (Planted bug: the reply's MAC not
    checked.)"""
    with served.socket(zmq.REQ) as sock:
        sock.send(_get(_challenge(served, sock)))
        replayed = list(sock.recv_multipart())
    assert len(replayed) == 3
    for answer in ([ENCODED, replayed[1], b"\0" * 32], replayed, [ENCODED, replayed[1]]):
        fake = FakeListener(answer)
        try:
            with zmq.Context() as ctx, ctx.socket(zmq.REQ) as raw:
                raw.setsockopt(zmq.LINGER, 0)
                raw.connect(f"tcp://127.0.0.1:{fake.port}")
                sock = AuthenticatedRequester(raw, SECRET)
                sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
                sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
                with pytest.raises(RuntimeError, match="MAC|unexpected reply"):
                    sock.recv_multipart()
        finally:
            fake.close()
