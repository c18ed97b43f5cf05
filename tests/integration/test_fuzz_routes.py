"""Property-based fuzzing (hypothesis) of every ``/v1/kvbranch`` route, and of the chat route's
session and branch fields, against the real server (real vLLM, real model, real connector).

Inputs: path ids (random unicode, very long, empty, path-traversal-like, percent-encoded or
raw), JSON bodies (wrong types, huge and negative numbers, NaN/Infinity literals, 1e308 TTLs,
nested junk, malformed JSON, non-object JSON), request bodies over the server's size limit.

Properties, for every request:

* never a 5xx, and never a hang (httpx timeouts are the hang guard);
* every 4xx carries a JSON error body with a non-empty message;

and at the end: every session the fuzzing made is deleted, no other session appeared (a chat
request naming an unaddressable session id used to create a session that no route could ever
get or delete — with auto-pinned blocks), and the pinned bytes are back to where they started.

Examples are derandomized (the same inputs every run) and kept few (``MAX_EXAMPLES``) so that
the module runs in about a minute on two cores.
"""

from __future__ import annotations

import json
import re
import secrets
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from sdk.contract import ID_PATTERN
from tests.integration.helpers import chat

MAX_EXAMPLES = 40
FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
TIMEOUT = httpx.Timeout(120.0, connect=10.0)  # hang guard only
ID_RE = re.compile(ID_PATTERN)
LIMIT = 32 * 1024 * 1024  # sdk.contract.MAX_BODY_BYTES


# --- the server state this module makes (and must clean up) ----------------------------------
class Fuzzer:
    def __init__(self, server) -> None:
        self.server = server
        self.http = httpx.Client(
            base_url=server.url, timeout=TIMEOUT, headers=server.headers(), follow_redirects=False
        )
        self.created: set[str] = set()
        stats = self.stats()
        self.baseline_sessions = {s["session_id"] for s in stats["sessions"]}
        self.baseline_pinned_bytes = stats["store"]["pinned_bytes"]
        self.session = f"fuzz-{secrets.token_hex(6)}"
        r = self.http.post(
            "/v1/kvbranch/sessions", json={"session_id": self.session, "pin_ttl_s": 600}
        )
        assert r.status_code == 201, r.text
        self.created.add(self.session)
        # give its main branch a sequence, so that pin/fork/prefetch reach the engine
        chat(
            server,
            [{"role": "user", "content": "Fuzzing starts. Say hi."}],
            session=self.session,
            max_tokens=2,
        )

    def stats(self) -> dict:
        r = self.http.get("/v1/kvbranch/stats")
        assert r.status_code == 200, r.text
        return r.json()

    def send(self, method: str, path: str, **kwargs) -> httpx.Response:
        r = self.http.request(method, path, **kwargs)
        check_response(method, path, r)
        if currently_in_test_context():  # --hypothesis-show-statistics: what inputs reached
            event(f"HTTP {r.status_code}")
        return r


def check_response(method: str, path: str, r: httpx.Response) -> None:
    where = f"{method} {path[:200]!r} -> {r.status_code}: {r.text[:400]}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            raise AssertionError(f"error body is not JSON: {where}") from None
        assert isinstance(body, dict), where
        err = body.get("error")
        # kvbranch and vLLM errors: {"error": {"message": ...}}; a path that matches no route
        # at all gets Starlette's {"detail": "Not Found"} / {"detail": "Method Not Allowed"}
        message = err.get("message") if isinstance(err, dict) else body.get("detail")
        assert isinstance(message, str) and message.strip(), where


@pytest.fixture(scope="module")
def fuzzer(kvbranch_server):
    state = Fuzzer(kvbranch_server)
    yield state
    for sid in state.created:  # best effort (the last test asserts the clean-up)
        state.http.delete(f"/v1/kvbranch/sessions/{sid}")
    state.http.close()


# --- strategies ------------------------------------------------------------------------------
WEIRD_IDS = [
    "",
    " ",
    ".",
    "..",
    "../..",
    "../../etc/passwd",
    "..%2F..%2Fetc",
    "%2e%2e",
    "%00",
    "a/b",
    "a?b=c",
    "a#b",
    "a b",
    "-a",
    ".a",
    "_",
    ":",
    "a\\b",
    "\u202eevil",
    "😀",
    "null",
    "None",
    "main/../main",
    "a" * 128,
    "a" * 129,
    "b" * 5000,
    "%",
    "%zz",
]
valid_ids = st.from_regex(ID_PATTERN, fullmatch=True)
fuzz_ids = st.one_of(
    st.sampled_from(WEIRD_IDS),
    st.text(max_size=24),  # any unicode
    st.text(min_size=129, max_size=3000),  # very long
    valid_ids,  # well-formed, unknown
)
huge_numbers = st.sampled_from(
    [
        0,
        -1,
        -0.0,
        1e308,
        -1e308,
        1e-308,
        5e-324,
        2**63,
        -(2**63),
        2**64,
        10**40,
        86400,
        86400.0001,
        86399.999,
    ]
)
ttls = st.one_of(
    huge_numbers,
    st.floats(),
    st.integers(),
    st.sampled_from(
        ["NaN", "nan", "Infinity", "-Infinity", "1e308", "300", "", "0x10", None, True, [], {}]
    ),
)
junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


def body_of(fields: dict, good: st.SearchStrategy) -> st.SearchStrategy:
    """A well-formed body (``good``: the request really does something), objects with any
    subset of ``fields`` (each a strategy) and sometimes an extra key, or something that is not
    such an object at all."""
    obj = st.fixed_dictionaries({}, optional={**fields, "extra": junk})
    return st.one_of(good, obj, obj, junk)


good_ttls = st.floats(min_value=0.001, max_value=86400)
create_bodies = body_of(
    {
        "session_id": st.one_of(fuzz_ids, junk),
        "pin_ttl_s": ttls,
        "auto_pin": st.one_of(st.booleans(), junk),
    },
    st.fixed_dictionaries({}, optional={"pin_ttl_s": good_ttls, "auto_pin": st.booleans()}),
)
pin_bodies = body_of({"ttl_s": ttls}, st.fixed_dictionaries({"ttl_s": good_ttls}))
messages = st.one_of(
    junk,
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant", "system", "tool", "", "robot"]),
                "content": st.one_of(st.text(max_size=60), st.none(), junk),
            }
        ),
        max_size=3,
    ),
)
good_fork = st.one_of(
    st.fixed_dictionaries(
        {"parent": st.just("main")},
        optional={
            "branch_id": valid_ids,
            "token_offset": st.integers(min_value=0, max_value=10**6),
        },
    ),
    st.fixed_dictionaries(
        {"messages": st.just([{"role": "user", "content": "Fuzzing starts. Say hi."}])},
        optional={"branch_id": valid_ids},
    ),
)
fork_bodies = body_of(
    {
        "parent": st.one_of(st.just("main"), fuzz_ids, junk),
        "branch_id": st.one_of(fuzz_ids, junk, st.none()),
        "token_offset": st.one_of(huge_numbers, st.integers(), ttls),
        "messages": messages,
    },
    good_fork,
)


@st.composite
def payloads(draw, bodies: st.SearchStrategy):
    """Keyword arguments of a request: a JSON body (NaN/Infinity written as JS literals),
    raw bytes that are usually not JSON, or no body."""
    kind = draw(st.sampled_from(["json", "json", "json", "raw", "none"]))
    if kind == "json":
        text = json.dumps(draw(bodies))  # allow_nan: NaN / Infinity literals
        return {"content": text.encode(), "headers": {"content-type": "application/json"}}
    if kind == "raw":
        return {
            "content": draw(st.binary(max_size=200)),
            "headers": {
                "content-type": draw(
                    st.sampled_from(
                        ["application/json", "text/plain", "application/x-www-form-urlencoded"]
                    )
                )
            },
        }
    return {}


def segment(raw: str, encode: bool) -> str:
    return quote(raw, safe="") if encode else raw


def request_or_skip(fuzzer: Fuzzer, method: str, path: str, **kwargs):
    """Send; a path httpx itself refuses to put on the wire is not a server case."""
    try:
        fuzzer.http.build_request(method, path)  # builds (and so validates) the URL
    except (httpx.InvalidURL, UnicodeError, ValueError):
        return None
    return fuzzer.send(method, path, **kwargs)


# --- the routes ------------------------------------------------------------------------------
@FUZZ
@given(sid=fuzz_ids, encode=st.booleans(), method=st.sampled_from(["GET", "DELETE", "PUT"]))
def test_fuzz_session_by_id(fuzzer, sid, encode, method):
    request_or_skip(fuzzer, method, f"/v1/kvbranch/sessions/{segment(sid, encode)}")


@FUZZ
@given(kwargs=payloads(create_bodies))
def test_fuzz_create_session(fuzzer, kwargs):
    r = fuzzer.send("POST", "/v1/kvbranch/sessions", **kwargs)
    if r.status_code == 201:
        sid = r.json()["session_id"]
        fuzzer.created.add(sid)
        assert ID_RE.match(sid)


@FUZZ
@given(
    sid=st.one_of(st.none(), st.none(), fuzz_ids),
    encode=st.booleans(),
    kwargs=payloads(fork_bodies),
    method=st.sampled_from(["GET", "POST", "POST", "POST"]),
)
def test_fuzz_list_and_fork_branches(fuzzer, sid, encode, kwargs, method):
    """``sid=None``: the module's real session (a well-formed fork really forks)."""
    session = fuzzer.session if sid is None else segment(sid, encode)
    r = request_or_skip(fuzzer, method, f"/v1/kvbranch/sessions/{session}/branches", **kwargs)
    if r is not None and r.status_code == 201:
        assert r.json()["session_id"] == fuzzer.session


@FUZZ
@given(
    sid=st.one_of(st.none(), st.none(), fuzz_ids),
    bid=st.one_of(st.just("main"), st.just("main"), fuzz_ids),
    encode=st.booleans(),
    kwargs=payloads(pin_bodies),
    op=st.sampled_from(
        [
            ("GET", ""),
            ("DELETE", ""),
            ("POST", "/pin"),
            ("DELETE", "/pin"),
            ("POST", "/prefetch"),
            ("GET", "/pin"),
            ("POST", "/nope"),
        ]
    ),
)
def test_fuzz_branch_routes(fuzzer, sid, bid, encode, kwargs, op):
    """get / delete branch, pin / unpin, prefetch — on the real session or a fuzzed one."""
    method, tail = op
    if sid is None and method == "DELETE" and tail == "" and bid == "main":
        bid = "not-main"  # keep the module's main branch for the other examples
    session = fuzzer.session if sid is None else segment(sid, encode)
    path = f"/v1/kvbranch/sessions/{session}/branches/{segment(bid, encode)}{tail}"
    request_or_skip(fuzzer, method, path, **(kwargs if method == "POST" else {}))


@FUZZ
@given(
    path=st.sampled_from(
        [
            "/v1/kvbranch/stats",
            "/v1/kvbranch/health",
            "/v1/kvbranch",
            "/v1/kvbranch/",
            "/v1/kvbranch/sessions",
        ]
    ),
    query=st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3),
    method=st.sampled_from(["GET", "GET", "POST", "DELETE", "PATCH"]),
)
def test_fuzz_stats_health_and_stray_methods(fuzzer, path, query, method):
    if method == "POST" and path == "/v1/kvbranch/sessions":
        return  # covered by test_fuzz_create_session (and would create sessions)
    r = fuzzer.send(method, path, params=query)
    if method == "GET" and path == "/v1/kvbranch/stats":
        assert r.status_code == 200 and "store" in r.json()


header_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200
)


@FUZZ
@given(
    session=st.one_of(st.none(), fuzz_ids, junk),
    branch=st.one_of(st.none(), fuzz_ids, junk),
    xargs=st.one_of(st.none(), junk, st.dictionaries(st.text(max_size=12), junk, max_size=3)),
    session_header=st.one_of(st.none(), header_values),
    branch_header=st.one_of(st.none(), header_values),
)
def test_fuzz_chat_session_and_branch(
    fuzzer, session, branch, xargs, session_header, branch_header
):
    body = {
        "model": fuzzer.server.model,
        "temperature": 0,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "Fuzz. Say ok."}],
    }
    if session is not None:
        body["session_id"] = session
    if branch is not None:
        xargs = dict(xargs) if isinstance(xargs, dict) else {}
        xargs["kvbranch_branch"] = branch
    if xargs is not None:
        body["vllm_xargs"] = xargs
    headers = {"content-type": "application/json"}
    if session_header is not None:
        headers["X-Session-ID"] = session_header
    if branch_header is not None:
        headers["X-KVBranch-Branch"] = branch_header
    r = fuzzer.send(
        "POST", "/v1/chat/completions", content=json.dumps(body).encode(), headers=headers
    )
    # whatever session a served request named, it must be one a route can address
    for candidate in (
        session,
        session_header,
        xargs.get("session_id") if isinstance(xargs, dict) else None,
    ):
        if isinstance(candidate, str) and candidate:
            if r.status_code == 200:
                assert ID_RE.match(candidate), r.text[:300]
                fuzzer.created.add(candidate)
            break


def _oversized_body() -> bytes:
    pad = "x" * (LIMIT + 1024)
    return json.dumps({"session_id": "big", "pad": pad}).encode()


@pytest.mark.parametrize(
    "path",
    [
        "/v1/kvbranch/sessions",
        "/v1/kvbranch/sessions/{sid}/branches",
        "/v1/kvbranch/sessions/{sid}/branches/main/pin",
        "/v1/chat/completions",
    ],
)
def test_oversized_body_is_refused_with_413(fuzzer, path):
    body = _oversized_body()
    path = path.format(sid=fuzzer.session)
    r = fuzzer.send("POST", path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    # the same without Content-Length (chunked upload): refused while reading
    chunks = (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20))
    r = fuzzer.send("POST", path, content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    # and the server still serves the route afterwards
    assert fuzzer.http.get(f"/v1/kvbranch/sessions/{fuzzer.session}").status_code == 200


def test_nan_and_absurd_numbers_are_400_naming_the_field(fuzzer):
    """Spot checks of the fuzzed classes, with the exact expected answer."""
    cases = [
        ("/v1/kvbranch/sessions", b'{"pin_ttl_s": NaN}', "pin_ttl_s"),
        ("/v1/kvbranch/sessions", b'{"pin_ttl_s": 1e308}', "pin_ttl_s"),
        ("/v1/kvbranch/sessions", b'{"pin_ttl_s": 1e999}', "pin_ttl_s"),
        ("/v1/kvbranch/sessions", b'{"pin_ttl_s": -5}', "pin_ttl_s"),
        (
            f"/v1/kvbranch/sessions/{fuzzer.session}/branches/main/pin",
            b'{"ttl_s": Infinity}',
            "ttl_s",
        ),
        (
            f"/v1/kvbranch/sessions/{fuzzer.session}/branches/main/pin",
            b'{"ttl_s": ' + str(10**400).encode() + b"}",
            "ttl_s",
        ),
        (
            f"/v1/kvbranch/sessions/{fuzzer.session}/branches",
            b'{"token_offset": -1}',
            "token_offset",
        ),
    ]
    for path, raw, field in cases:
        r = fuzzer.send("POST", path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text[:300])
        assert field in r.text, (raw, r.text[:300])


def test_chat_with_an_unaddressable_session_id_is_400(fuzzer):
    before = {s["session_id"] for s in fuzzer.stats()["sessions"]}
    for bad in ("../../etc", "a b", "x" * 129, "😀"):
        body = {
            "model": fuzzer.server.model,
            "max_tokens": 1,
            "session_id": bad,
            "messages": [{"role": "user", "content": "hi"}],
        }
        r = fuzzer.send("POST", "/v1/chat/completions", json=body)
        assert r.status_code == 400 and "session_id" in r.text, r.text[:300]
        body = {
            "model": fuzzer.server.model,
            "max_tokens": 1,
            "session_id": fuzzer.session,
            "vllm_xargs": {"kvbranch_branch": bad},
            "messages": [{"role": "user", "content": "hi"}],
        }
        r = fuzzer.send("POST", "/v1/chat/completions", json=body)
        assert r.status_code == 400 and "kvbranch_branch" in r.text, r.text[:300]
    assert {s["session_id"] for s in fuzzer.stats()["sessions"]} == before


def test_zz_fuzzing_leaked_no_session_and_no_pin(fuzzer):
    """Runs last in this module: delete what the fuzzing created, then nothing of it is left."""
    for sid in sorted(fuzzer.created):
        r = fuzzer.http.delete(f"/v1/kvbranch/sessions/{sid}")
        assert r.status_code in (200, 404), r.text[:300]
    stats = fuzzer.stats()
    left = {s["session_id"] for s in stats["sessions"]} - fuzzer.baseline_sessions
    assert left == set(), f"sessions left behind by fuzzing: {sorted(left)[:10]}"
    # other modules' leases can only have expired or degraded meanwhile, never grown
    assert stats["store"]["pinned_bytes"] <= fuzzer.baseline_pinned_bytes
