"""The agent page through the P/D router (the keyed pair's): the router serves the same static
page without a key, and its data route — behind the router's edge, so only with one of the
cluster's keys — answers with the caller's sessions as the router's stats lists them and the
last turns the instances recorded for them, each naming where it ran; another key sees none
of them. The page in a browser is tests/integration/keyed/test_ui.py."""

from __future__ import annotations

import httpx

from sdk.contract import STATS_PATH
from server.common.ui_page import UI_DATA_PATH, UI_PATH
from tests.integration.helpers import chat
from tests.integration.trust_cluster import KEY_A, KEY_B

SESSION = "ui-router"


def _client(server, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=600)


def test_the_router_serves_the_page_and_only_the_callers_data(keyed_pd):
    prefill, _, router = keyed_pd
    chat(router, [{"role": "user", "content": "Name a lake."}], session=SESSION, max_tokens=4)
    with _client(router) as anonymous, _client(prefill) as direct:
        page = anonymous.get(UI_PATH)
        assert page.status_code == 200
        assert page.content == direct.get(UI_PATH).content  # the instances' own page
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-content-type-options"] == "nosniff"
        assert anonymous.get(UI_PATH + ".js").status_code == 200
        refused = anonymous.get(UI_DATA_PATH)
        assert refused.status_code == 401 and "sessions" not in refused.text
    with _client(router, KEY_A) as a, _client(router, KEY_B) as b:
        try:
            data = a.get(UI_DATA_PATH)
            assert data.status_code == 200, data.text
            mine = data.json()
            stats = a.get(STATS_PATH).json()
            assert [s["session_id"] for s in mine["sessions"]] == [
                s["session_id"] for s in stats["sessions"]
            ]
            turns = [t for t in mine["turns"] if t["session_id"] == SESSION]
            assert turns and {t["instance"] for t in turns} <= {"prefill", "decode"}
            assert all(t["branch_id"] == "main" and t["prompt_tokens"] > 0 for t in turns)
            theirs = b.get(UI_DATA_PATH).json()
            assert SESSION not in {s["session_id"] for s in theirs["sessions"]}
            assert not [t for t in theirs["turns"] if t["session_id"] == SESSION]
        finally:
            a.delete(f"/v1/kvbranch/sessions/{SESSION}")
