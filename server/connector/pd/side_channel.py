"""P/D: NIXL's handshake side channel, authenticated with the cluster secret and unkillable.

Every P and D instance runs upstream's *handshake listener* (a thread of the engine core, a
ZMQ ROUTER on ``--nixl-port``): a peer that is about to read this instance's KV blocks asks it
for its NIXL agent metadata (memory addresses, UCX remote keys) and registers the agent. In
vLLM 0.32 that listener hands the metadata to anyone who asks, and one malformed frame (a
``[b"x"]`` multipart, bad msgpack, an unknown rank) raises out of its loop: the thread dies and
no peer that starts or restarts later can ever handshake with the instance again.

This module replaces both ends (installed on our connectors by
:func:`server.connector.vllm_compat.install_nixl_side_channel`, the only place that knows
upstream's names):

* **The listener never dies.** Every frame is parsed defensively: a bad envelope is dropped, a
  bad request is refused with one short frame, anything else that raises is logged
  (rate-limited) and the loop goes on. Frames over :data:`MAX_FRAME_BYTES` close the
  sender's connection (ZMQ ``MAXMSGSIZE``) before they are buffered.
* **A challenge and a MAC.** The metadata goes only to a peer that proves the cluster secret
  (:func:`~server.connector.pd.transfer_auth.load_cluster_secret`) on a fresh challenge::

      requester                                   listener
      ["kvb1-hello"]                          ->
                                              <-  ["kvb1-challenge", nonce]
      ["kvb1-get", nonce, pp, tp, cnonce, mac] ->   mac = HMAC(secret, GET, nonce pp tp cnonce)
                                              <-  payload, perf_ts, HMAC(secret, META,
                                                  cnonce pp tp payload perf_ts)

  The nonce is the listener's own (its monotonic clock, a random part and a tag under a key
  only this listener process holds: no clock is compared across machines, a nonce of one
  listener is worthless at another), valid for :data:`CHALLENGE_TTL_S` and **once**. The reply
  is MAC'd over the requester's fresh ``cnonce``, so a listener without the secret (a process
  that took the port, a replay of an old answer) cannot feed a peer wrong metadata. Anything
  else — upstream's unauthenticated ``get_meta_msg``, a missing, wrong or replayed MAC, a stale
  nonce — gets ``["kvb1-refused", why]`` and no metadata.
* **The requester** (:class:`AuthenticatedRequester`) wraps the REQ socket upstream's
  ``_nixl_handshake`` uses: its one ``send``/``recv_multipart`` becomes the exchange above, and
  upstream still checks what it gets (compatibility hash, engine id, ranks).

What stays upstream's: the metadata travels in clear (a MAC, no encryption; an eavesdropper on
the network path reads it), and NIXL/UCX's data plane (the reads themselves) is not
authenticated by us: docs/security.md, "NIXL side channel".
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from server.connector.vllm_compat import install_nixl_side_channel, nixl_zmq_path

logger = logging.getLogger("kvbranch.pd.side_channel")

HELLO = b"kvb1-hello"
CHALLENGE = b"kvb1-challenge"
GET = b"kvb1-get"
REFUSED = b"kvb1-refused"
#: Domain labels of the two MACs (a request's MAC is never a valid reply's, nor the reverse).
GET_LABEL = b"kvbranch nixl side channel v1: get\x00"
META_LABEL = b"kvbranch nixl side channel v1: meta\x00"
NONCE_LABEL = b"kvbranch nixl side channel v1: nonce\x00"

#: A challenge is answered within this long (the requester asks for it right before).
CHALLENGE_TTL_S = 30.0
#: Used challenges remembered (an entry lives CHALLENGE_TTL_S; only a peer with the secret adds
#: one). Past it the listener refuses until entries expire: it never forgets a live one.
MAX_USED_NONCES = 4096
#: A request is a few dozen bytes; nothing bigger is read off the wire.
MAX_FRAME_BYTES = 4096
#: At most one warning per kind this often (a flood of junk must not flood the log).
LOG_INTERVAL_S = 10.0
POLL_MS = 250  # how soon the thread sees its stop event

_RAND_BYTES = 16
_TAG_BYTES = 16
_NONCE_BYTES = 8 + _RAND_BYTES + _TAG_BYTES


def _mac(secret: bytes, label: bytes, fields: list[Any]) -> bytes:
    return hmac.new(secret, label + msgspec.msgpack.encode(fields), hashlib.sha256).digest()


def request_mac(secret: bytes, nonce: bytes, pp: int, tp: int, cnonce: bytes) -> bytes:
    return _mac(secret, GET_LABEL, [nonce, pp, tp, cnonce])


def reply_mac(secret: bytes, cnonce: bytes, pp: int, tp: int, payload: bytes, ts: bytes) -> bytes:
    return _mac(secret, META_LABEL, [cnonce, pp, tp, payload, ts])


class Refused(Exception):
    """A request the listener answers with :data:`REFUSED` (the message says why)."""


class _Throttled:
    """Warnings of one kind at most every :data:`LOG_INTERVAL_S`, with how many were held back."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < LOG_INTERVAL_S:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        suffix = f" ({held} more like it in the last {LOG_INTERVAL_S:.0f}s)" if held else ""
        logger.warning("kvbranch: NIXL side channel: " + msg + suffix, *args, exc_info=exc_info)


@dataclass
class ListenerStats:
    """What the listener did (read by tests and logs; written by the listener thread only)."""

    challenges: int = 0
    served: int = 0
    refused: int = 0
    dropped: int = 0  # frames without a REQ envelope: no reply possible
    errors: int = 0  # an exception of ours, caught


def _small_int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 16:
        raise Refused("bad rank")
    return value


def _nonce_bytes(value: Any, size: int) -> bytes:
    if not isinstance(value, bytes) or len(value) != size:
        raise Refused("bad nonce")
    return value


class SideChannelListener:
    """This instance's end of the side channel: serves the encoded NIXL handshake payload per
    (pp rank, tp rank) to peers that prove the cluster secret on a fresh challenge.

    :meth:`handle` is the whole protocol on one message (no I/O); :meth:`run` is the thread
    body that upstream starts, with upstream's signature."""

    def __init__(
        self,
        secret: bytes,
        path_of: Callable[[str, int], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._secret = secret
        self._path_of = path_of
        self._clock = clock
        self._nonce_key = secrets.token_bytes(32)  # this listener process's own
        self._used: OrderedDict[bytes, float] = OrderedDict()
        self._log = _Throttled(clock)
        self.stats = ListenerStats()

    # --- challenges -----------------------------------------------------------------------
    def _tag(self, issued: bytes, rand: bytes) -> bytes:
        return hmac.new(self._nonce_key, NONCE_LABEL + issued + rand, hashlib.sha256).digest()[
            :_TAG_BYTES
        ]

    def new_challenge(self) -> bytes:
        issued = struct.pack(">d", self._clock())
        rand = secrets.token_bytes(_RAND_BYTES)
        return issued + rand + self._tag(issued, rand)

    def _check_challenge(self, nonce: bytes) -> float:
        """When ``nonce`` stops being valid; :class:`Refused` if it is not ours or too old."""
        issued, rand, tag = nonce[:8], nonce[8 : 8 + _RAND_BYTES], nonce[8 + _RAND_BYTES :]
        if not hmac.compare_digest(tag, self._tag(issued, rand)):
            raise Refused("not this listener's challenge")
        at = float(struct.unpack(">d", issued)[0])
        now = self._clock()
        if not at <= now < at + CHALLENGE_TTL_S:
            raise Refused("stale challenge")
        return at + CHALLENGE_TTL_S

    def _use(self, nonce: bytes, until: float) -> None:
        now = self._clock()
        while self._used and next(iter(self._used.values())) <= now:
            self._used.popitem(last=False)
        if nonce in self._used:
            raise Refused("challenge already used")
        if len(self._used) >= MAX_USED_NONCES:
            raise Refused("too many handshakes: retry shortly")
        self._used[nonce] = until

    # --- one message ----------------------------------------------------------------------
    def handle(self, frames: list[bytes], encoded_data: Mapping[tuple[int, int], bytes]) -> Any:
        """The reply frames (after the REQ envelope) to one message's ``frames`` (with its
        envelope), or None when the message has no REQ envelope to answer. Never raises
        at all (a refusal frame answers whatever went wrong)."""
        if len(frames) != 3 or frames[1] != b"":
            self.stats.dropped += 1
            self._log.warning(
                "malformed", "dropped a message of %d frame(s) without a REQ envelope", len(frames)
            )
            return None
        try:
            return self._answer(frames[2], encoded_data)
        except Refused as why:
            reason = str(why)
            self._log.warning("refused", "refused a peer's request: %s", reason)
        except Exception:  # a peer's input we did not foresee: still only a refusal
            self.stats.errors += 1
            reason = "unreadable request"
            self._log.warning("error", "a peer's request failed; refused", exc_info=True)
        self.stats.refused += 1
        return [msgspec.msgpack.encode([REFUSED, reason])]

    def _answer(self, body: bytes, encoded_data: Mapping[tuple[int, int], bytes]) -> list[bytes]:
        try:
            msg = msgspec.msgpack.decode(body)
        except (msgspec.DecodeError, RecursionError):
            raise Refused("not msgpack") from None
        if not isinstance(msg, list) or not msg or not isinstance(msg[0], bytes):
            raise Refused("not a kvbranch side-channel request (unauthenticated peer?)")
        if msg[0] == HELLO and len(msg) == 1:
            self.stats.challenges += 1
            return [msgspec.msgpack.encode([CHALLENGE, self.new_challenge()])]
        if msg[0] != GET or len(msg) != 6:
            raise Refused("not a kvbranch side-channel request (unauthenticated peer?)")
        _, nonce, pp, tp, cnonce, mac = msg
        nonce = _nonce_bytes(nonce, _NONCE_BYTES)
        cnonce = _nonce_bytes(cnonce, _RAND_BYTES)
        pp, tp = _small_int(pp), _small_int(tp)
        until = self._check_challenge(nonce)
        expected = request_mac(self._secret, nonce, pp, tp, cnonce)
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, expected):
            raise Refused("bad MAC (another cluster secret?)")
        self._use(nonce, until)
        payload = encoded_data.get((pp, tp))
        if payload is None:
            raise Refused(f"no rank ({pp}, {tp}) here")
        # Our perf_counter, as upstream sends it: the peer estimates its clock offset to ours
        # (the listener runs in the process that stamps block expiry deadlines).
        ts = msgspec.msgpack.encode(time.perf_counter())
        self.stats.served += 1
        return [payload, ts, reply_mac(self._secret, cnonce, pp, tp, payload, ts)]

    # --- the thread -----------------------------------------------------------------------
    def run(
        self,
        encoded_data: Mapping[tuple[int, int], bytes],
        ready_event: threading.Event,
        stop_event: threading.Event,
        host: str,
        port: int,
    ) -> None:
        """Upstream's listener thread body (same arguments): bind, then answer until
        ``stop_event``; nothing a peer sends ends the loop."""
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            path = self._path_of(host, port)
            if path.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(path)
            logger.info("kvbranch: NIXL side channel (authenticated) on %s", path)
        except BaseException:
            ready_event.set()  # upstream waits on it: never leave the engine hanging
            ctx.destroy(linger=0)
            raise
        ready_event.set()
        try:
            self._loop(sock, encoded_data, stop_event)
        finally:
            ctx.destroy(linger=0)

    def _loop(
        self, sock: Any, encoded_data: Mapping[tuple[int, int], bytes], stop: threading.Event
    ) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            try:
                if not poller.poll(POLL_MS):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
                reply = self.handle(frames, encoded_data)
                if reply is not None:
                    sock.send_multipart([frames[0], b"", *reply], zmq.NOBLOCK)
            except zmq.ContextTerminated:
                return
            except Exception:  # ours or zmq's on a peer's doing: log, go on
                self.stats.errors += 1
                self._log.warning("error", "a message failed; still listening", exc_info=True)


class AuthenticatedRequester:
    """Upstream's handshake REQ socket, seen through the challenge: ``send`` of upstream's
    ``(get_meta_msg, pp, tp)`` runs the hello round trip and sends the MAC'd request;
    ``recv_multipart`` returns upstream's ``[payload, perf_ts]`` only if the reply's MAC proves
    a listener with the cluster secret answered *this* request. Anything else raises: upstream
    then fails the handshake (logged; the request recomputes).

    (The hello round trip happens inside ``send``, after upstream stamped its start time: its
    clock-offset estimate is off by half a round trip, microseconds against block deadlines of
    seconds.)"""

    def __init__(self, sock: Any, secret: bytes) -> None:
        self._sock = sock
        self._secret = secret
        self._pending: tuple[bytes, int, int] | None = None

    def setsockopt(self, option: int, value: Any) -> None:
        self._sock.setsockopt(option, value)

    def _exchange_hello(self) -> bytes:
        self._sock.send(msgspec.msgpack.encode([HELLO]))
        parts = self._sock.recv_multipart()
        msg = _decode_one(parts)
        if len(msg) != 2 or msg[0] != CHALLENGE:
            raise RuntimeError("NIXL side channel: the peer sent no challenge")
        return _nonce_bytes(msg[1], _NONCE_BYTES)

    def send(self, msg: bytes) -> None:
        _, pp, tp = msgspec.msgpack.decode(msg)  # upstream's (GET_META_MSG, pp, tp)
        nonce = self._exchange_hello()
        cnonce = secrets.token_bytes(_RAND_BYTES)
        mac = request_mac(self._secret, nonce, pp, tp, cnonce)
        self._sock.send(msgspec.msgpack.encode([GET, nonce, pp, tp, cnonce, mac]))
        self._pending = (cnonce, pp, tp)

    def recv_multipart(self) -> list[bytes]:
        if self._pending is None:
            raise RuntimeError("NIXL side channel: recv without a request")
        cnonce, pp, tp = self._pending
        self._pending = None
        parts = self._sock.recv_multipart()
        if len(parts) == 3:
            payload, ts, mac = parts
            if hmac.compare_digest(mac, reply_mac(self._secret, cnonce, pp, tp, payload, ts)):
                return [payload, ts]
            raise RuntimeError(
                "NIXL side channel: the peer's metadata carries no valid MAC (another "
                "cluster secret, or not a kvbranch instance): not used"
            )
        _decode_one(parts)  # raises with the refusal's reason
        raise RuntimeError("NIXL side channel: unexpected reply")


def _decode_one(parts: list[bytes]) -> list[Any]:
    """A one-frame msgpack list; a refusal raises with its reason."""
    if len(parts) != 1:
        raise RuntimeError(f"NIXL side channel: unexpected reply of {len(parts)} frames")
    try:
        msg = msgspec.msgpack.decode(parts[0])
    except msgspec.DecodeError:
        raise RuntimeError("NIXL side channel: unreadable reply") from None
    if not isinstance(msg, list) or not msg:
        raise RuntimeError("NIXL side channel: unexpected reply")
    if msg[0] == REFUSED:
        raise RuntimeError(f"NIXL side channel: the peer refused the handshake: {msg[1:]!r}")
    return msg


def install(
    sched: Any, worker: Any, secret: bytes, clock: Callable[[], float] = time.monotonic
) -> SideChannelListener | None:
    """Put this side channel on one NIXL connector's scheduler (the listener: returned, for
    its ``stats``) and worker (the requester)."""
    listener = SideChannelListener(secret, nixl_zmq_path, clock) if sched is not None else None
    install_nixl_side_channel(
        sched,
        worker,
        listener.run if listener is not None else _no_listener,
        lambda sock: AuthenticatedRequester(sock, secret),
    )
    return listener


def _no_listener(*args: Any) -> None:  # pragma: no cover - a worker has no scheduler
    raise RuntimeError("no NIXL scheduler on this connector")
