"""NIXL's handshake side channel of real P and D instances (the keyed cluster of
:mod:`tests.integration.trust_cluster`), attacked as a local process would: junk frames, vLLM's
own unauthenticated metadata request, a request under another secret. The instance must refuse
every one of them and still hand its metadata to a peer with the cluster secret — the proof
that the launcher's instances run :mod:`server.connector.pd.side_channel`, not upstream's
listener (which dies on the first junk frame and serves anyone)."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlAgentMetadata,
    NixlHandshakePayload,
)

from server.connector.pd.side_channel import CHALLENGE, HELLO, REFUSED, AuthenticatedRequester
from tests.integration.trust_cluster import CLUSTER_SECRET

TIMEOUT_MS = 30_000  # a guard against a hang (a dead listener answers nothing)


@pytest.fixture(scope="module")
def pd(keyed_pd):
    return keyed_pd


def _path(instance) -> str:
    return f"tcp://127.0.0.1:{instance.args[instance.args.index('--nixl-port') + 1]}"


def _socket(ctx: zmq.Context, kind: int, path: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.connect(path)
    return sock


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_side_channel_refuses_strangers_survives_junk_and_serves_the_cluster(pd, role):
    instance = pd[0] if role == "prefill" else pd[1]
    check_side_channel(_path(instance), CLUSTER_SECRET)


def check_side_channel(path: str, secret: str) -> None:
    """Junk, vLLM's own request and another secret refused; a peer with ``secret`` served
    (also run on aggregated replicas: tests/integration/test_replicas.py)."""
    with zmq.Context() as ctx:
        with _socket(ctx, zmq.DEALER, path) as dealer:
            for junk in ([b"x"], [b"a", b"b", b"c", b"d"], [b"", b"\xc1"]):
                dealer.send_multipart(junk)
            # Same connection, so answered only after the junk was read: upstream's listener
            # thread is dead by now and never answers.
            dealer.send_multipart([b"", msgspec.msgpack.encode([HELLO])])
            replies = [dealer.recv_multipart(), dealer.recv_multipart()]
        assert msgspec.msgpack.decode(replies[0][1])[0] == REFUSED  # the bad msgpack
        assert msgspec.msgpack.decode(replies[1][1])[0] == CHALLENGE

        with _socket(ctx, zmq.REQ, path) as req:  # vLLM's own request: no metadata
            req.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
            reply = req.recv_multipart()
        assert len(reply) == 1 and msgspec.msgpack.decode(reply[0])[0] == REFUSED

        with _socket(ctx, zmq.REQ, path) as raw:  # another cluster's secret
            sock = AuthenticatedRequester(raw, b"not the cluster secret")
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
            with pytest.raises(RuntimeError, match="refused"):
                sock.recv_multipart()

        with _socket(ctx, zmq.REQ, path) as raw:  # a peer of this cluster
            sock = AuthenticatedRequester(raw, secret.encode())
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
            payload, _ = sock.recv_multipart()
    handshake = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(payload)
    agent = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(handshake.agent_metadata_bytes)
    assert agent.engine_id
