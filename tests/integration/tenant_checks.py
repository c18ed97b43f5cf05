"""What the key tests check behind a refusal, on whichever server holds the keys."""

from __future__ import annotations

import httpx

from tests.integration.helpers import live_sessions


def keyed_client(server, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=600)


def nothing_happened(server, key: str, before: dict, session: str, owners: tuple[str, ...]) -> None:
    """Behind a refusal: no engine request (the connector counts every one, whatever its
    route; read with ``key``), no new session, and none named ``session`` under any of
    ``owners``' keys."""
    with keyed_client(server, key) as c:
        after = c.get("/v1/kvbranch/stats").json()
    assert after["requests"] == before["requests"]
    assert live_sessions(server) == before["live_sessions"]
    for owner in owners:
        with keyed_client(server, owner) as c:
            assert c.get(f"/v1/kvbranch/sessions/{session}").status_code == 404
