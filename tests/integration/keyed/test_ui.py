"""The agent page (``/kvbranch/ui``) in a real browser, on the package's keyed server: a
session with a fork runs, headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by selenium) opens the page, the key goes into its field, and the rendered page must
show the session's branch tree with the branch names and token counts of
``/v1/kvbranch/stats`` and each turn's prompt tokens by source as the completions reported
them — and nothing of another key's sessions.

With ``KVBRANCH_UI_SCREENSHOT=<path>`` the test also saves what the browser shows there
(docs/ui.png is made that way).
"""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

from server.common.ui_page import UI_DATA_PATH, UI_PATH
from tests.integration.helpers import system_prompt
from tests.integration.keyed.server import UI_KEYS

KEY_A, KEY_B = UI_KEYS
SESSION, SECRET = "ui-agent", "ui-b-secret"
BRANCH_HEADER = "X-KVBranch-Branch"
SOURCES = ("device", "host", "remote", "recomputed")

#: Debian's browser and its driver: scripts/setup.sh installs them (scripts/system-packages.txt)
#: as it installs selenium (the dev extra); without them this test fails, it is not skipped.
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def _client(server, key):
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=600
    )


def _streamed_turn(c, server, messages, branch="main", session=SESSION):
    """One streamed chat turn; the ``kvbranch`` split its usage chunk carried, and its text."""
    body = {
        "model": server.model,
        "messages": messages,
        "temperature": 0,
        "max_tokens": 8,
        "session_id": session,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    split, text = None, ""
    with c.stream("POST", "/v1/chat/completions", json=body, headers={BRANCH_HEADER: branch}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
            split = chunk.get("kvbranch") or split
    assert split is not None and split["branch_id"] == branch
    return split, text


def _browser() -> webdriver.Chrome:
    assert CHROMIUM and CHROMEDRIVER, (
        "Debian's chromium and chromium-driver are not installed (scripts/setup.sh installs them)"
    )
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1200,900")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def agent_session(keyed_server):
    """Key A: a session, two turns on main, a fork and a turn on it (each turn's split, by
    branch); key B: a session of its own, which A's page must never show."""
    history = [
        {"role": "system", "content": system_prompt(words=150, seed=40)},
        {"role": "user", "content": "Plan a day in Paris."},
    ]
    splits: dict[str, list[dict]] = {"main": [], "museum": []}
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b:
        made = a.post(
            "/v1/kvbranch/sessions",
            json={"session_id": SESSION, "auto_pin": True, "pin_ttl_s": 900},
        )
        assert made.status_code == 201, made.text
        split, answer = _streamed_turn(a, keyed_server, history)
        splits["main"].append(split)
        history += [{"role": "assistant", "content": answer}]
        fork = a.post(
            f"/v1/kvbranch/sessions/{SESSION}/branches",
            json={"parent": "main", "branch_id": "museum"},
        )
        assert fork.status_code == 201, fork.text
        main_next = history + [{"role": "user", "content": "Which hotel is cheaper?"}]
        splits["main"].append(_streamed_turn(a, keyed_server, main_next)[0])
        pin = a.post(f"/v1/kvbranch/sessions/{SESSION}/branches/main/pin", json={"ttl_s": 900})
        assert pin.status_code == 200, pin.text
        museum = history + [{"role": "user", "content": "Suggest a museum instead."}]
        splits["museum"].append(_streamed_turn(a, keyed_server, museum, branch="museum")[0])
        _streamed_turn(b, keyed_server, history[:2], session=SECRET)
        stats = a.get("/v1/kvbranch/stats")
        assert stats.status_code == 200, stats.text
    yield stats.json(), splits
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b:
        a.delete(f"/v1/kvbranch/sessions/{SESSION}")
        b.delete(f"/v1/kvbranch/sessions/{SECRET}")


def _rendered(driver):
    """The page's sessions as the browser rendered them: ids, branches, turns by source."""
    from selenium.webdriver.common.by import By

    out = {}
    for box in driver.find_elements(By.CSS_SELECTOR, "section.session"):
        branches = {}
        for item in box.find_elements(By.CSS_SELECTOR, "li.branch"):
            row = item.find_element(By.CSS_SELECTOR, ":scope > .branch-row")
            turns = item.find_elements(By.CSS_SELECTOR, ":scope > ol.turns > li.turn")
            parent = item.find_elements(By.XPATH, "./parent::ul/parent::li[@class='branch']")
            branches[row.find_element(By.CSS_SELECTOR, ".branch-id").text] = {
                "parent": parent[0].get_attribute("data-branch-id") if parent else None,
                "tokens": int(row.find_element(By.CSS_SELECTOR, ".tokens").text.split()[0]),
                "pin": row.find_element(By.CSS_SELECTOR, ".pin").get_attribute("class").split(),
                "pin_text": row.find_element(By.CSS_SELECTOR, ".pin").text,
                "turns": [
                    {
                        "prompt": int(t.get_attribute("data-prompt")),
                        **{s: int(t.get_attribute(f"data-{s}")) for s in SOURCES},
                        "label": t.find_element(By.CSS_SELECTOR, ".turn-tokens").text,
                        "time": t.find_element(By.CSS_SELECTOR, ".ttft").text,
                    }
                    for t in turns
                ],
            }
        out[box.find_element(By.CSS_SELECTOR, "h2").text] = branches
    return out


def test_page_shows_the_callers_branch_tree_and_turns(keyed_server, agent_session, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    stats, splits = agent_session
    page = httpx.get(keyed_server.url + UI_PATH)  # static: served without a key
    assert page.status_code == 200
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(keyed_server.url + UI_DATA_PATH).status_code == 401  # the data is keyed

    driver = _browser()
    try:
        driver.get(keyed_server.url + UI_PATH)
        driver.find_element(By.ID, "key").send_keys(KEY_A)
        driver.find_element(By.ID, "use-key").click()
        WebDriverWait(driver, 120).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, f'section[data-session-id="{SESSION}"]')
        )
        shown = _rendered(driver)
        if os.environ.get("KVBRANCH_UI_SCREENSHOT"):
            driver.save_screenshot(os.environ["KVBRANCH_UI_SCREENSHOT"])
        driver.save_screenshot(str(tmp_path / "ui.png"))
        assert KEY_A not in driver.current_url  # the key never goes in a URL
        source = driver.page_source
    finally:
        driver.quit()

    # The page lists exactly the key's sessions as stats does: never key B's.
    assert set(shown) == {s["session_id"] for s in stats["sessions"]}
    assert SECRET not in shown and SECRET not in source
    listed = next(s for s in stats["sessions"] if s["session_id"] == SESSION)
    # The branch tree: the fork under its parent; names and token counts as stats has them.
    assert {b: shown[SESSION][b]["tokens"] for b in shown[SESSION]} == {
        b["branch_id"]: b["num_tokens"] for b in listed["branches"]
    }
    assert shown[SESSION]["museum"]["parent"] == "main"
    assert shown[SESSION]["main"]["parent"] is None
    assert any(b["pinned"] for b in listed["branches"])  # the session pins its branches
    for branch in listed["branches"]:
        row = shown[SESSION][branch["branch_id"]]
        # pinned, a pin degraded to LRU (not "pinned" in the data), or neither: as stats says
        assert ("pinned" in row["pin"]) == branch["pinned"], (row, branch)
        assert ("degraded" in row["pin"]) == branch["degraded"], (row, branch)
        assert ("degraded" in row["pin_text"]) == branch["degraded"], (row, branch)
        assert ("not pinned" in row["pin_text"]) == (
            not branch["pinned"] and not branch["degraded"]
        ), (row, branch)
        if (branch["pinned"] or branch["degraded"]) and branch["pin_expires_in_s"] is not None:
            assert "s left" in row["pin_text"], row
    # Each turn's bar: the prompt tokens by source that its completion reported.
    for branch, reported in splits.items():
        turns = shown[SESSION][branch]["turns"]
        assert [{s: t[s] for s in ("prompt", *SOURCES)} for t in turns] == [
            {
                "prompt": r["prompt_tokens"],
                **{s: r[f"{s}_hit_tokens"] for s in ("device", "host", "remote")},
                "recomputed": r["recomputed_tokens"],
            }
            for r in reported
        ]
        assert all(t["label"].startswith(f"prompt {t['prompt']}:") for t in turns)
        assert all(t["time"].startswith("TTFT ") for t in turns)  # streamed: a TTFT each
