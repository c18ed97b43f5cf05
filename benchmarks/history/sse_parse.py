"""SSE parsing: the sdk's own parser (sdk/sse.py) against httpx-sse, on correctness and speed.

Why: issue 16 item 5 asks for SSE parsing from a well-kept library unless ours is measurably
better. This benchmark measures both, prints a Markdown report and returns records.

Correctness: each case is a byte stream with the events the WHATWG event-stream rules give
(html.spec.whatwg.org, "Interpreting an event stream"), fed whole and one byte at a time.
Both parsers are driven the way a client reads a response: ours over the bytes
(``SSEDecoder.feed``), httpx-sse through its public ``EventSource.iter_sse`` over an
``httpx.Response`` (it decodes the text with httpx's own decoder).

Speed: an OpenAI-style chat stream of a few MB (one ``data: {json}`` event per token, a
usage chunk, ``[DONE]``) cut into chunks of several sizes, parsed to events, best of
``--repeat`` runs; both over the same ``httpx.Response`` byte stream, and the parsers alone
(ours ``SSEDecoder.feed``; httpx-sse's line decoder plus event decoder, which is what its
``iter_sse`` runs per text chunk).

    .venv/bin/pip install httpx-sse       # the rival, not a dependency of kvbranch
    .venv/bin/python -m benchmarks.history.sse_parse [--mb 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import codecs
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

try:  # the rival: installed by hand (see above), so that listing benchmarks never needs it
    import httpx_sse
    from httpx_sse._decoders import SSEDecoder as HxEventDecoder
    from httpx_sse._decoders import SSELineDecoder as HxLineDecoder
except ImportError:
    httpx_sse = None

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import cli, reporting  # noqa: E402
from benchmarks.records import Record, result  # noqa: E402
from sdk.sse import SSEDecoder, iter_sse  # noqa: E402

NAME = "sse_parse"
DESCRIPTION = "SSE parsing: the sdk's own parser against httpx-sse, on correctness and speed"
Event = tuple[str, str, str | None, int | None]  # (event, data, id, retry)


@dataclass
class Case:
    name: str
    raw: bytes
    expected: list[Event]
    note: str = ""


def _m(data: str, event: str = "message", id: str | None = None, retry: int | None = None) -> Event:
    return (event, data, id, retry)


CASES = [
    Case(
        "data lines, comment, [DONE]",
        b': keep-alive\ndata: {"a": 1}\n\ndata: [DONE]\n\n',
        [_m('{"a": 1}'), _m("[DONE]")],
    ),
    Case(
        "multi-line data",
        b"data: line one\ndata: line two\ndata:\n\n",
        [_m("line one\nline two\n")],
    ),
    Case("CRLF line ends", b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n", [_m("a\nb"), _m("c")]),
    Case("CR line ends", b"data: a\rdata: b\r\rdata: c\r\r", [_m("a\nb"), _m("c")]),
    Case("mixed line ends", b"data: a\r\n\rdata: b\n\r\n", [_m("a"), _m("b")]),
    Case(
        "event type, id, retry",
        b"event: update\nid: 7\nretry: 1500\ndata: x\n\n",
        [_m("x", "update", "7", 1500)],
    ),
    Case("space after colon optional, one stripped", b"data:a\ndata:  b\n\n", [_m("a\n b")]),
    Case("field without colon", b"data\ndata\n\n", [_m("\n")]),
    Case("unknown field and comment ignored", b"foo: bar\n:comment\ndata: x\n\n", [_m("x")]),
    Case("multi-byte UTF-8", "data: café €\n\n".encode(), [_m("café €")]),
    Case(
        "leading BOM ignored",
        b"\xef\xbb\xbfdata: x\n\n",
        [_m("x")],
        "the spec strips one leading U+FEFF",
    ),
    Case(
        "event without data is not dispatched",
        b"event: ping\n\nid: 3\n\nretry: 10\n\n",
        [],
        "spec: an empty data buffer dispatches nothing",
    ),
    Case(
        "blank lines after an id dispatch nothing",
        b"id: 1\ndata: a\n\n\n\n",
        [_m("a", id="1")],
        "a consumer that JSON-decodes data would fail on a spurious ''",
    ),
    Case(
        "retry must be ASCII digits",
        b"retry: -5\ndata: a\n\nretry: 1_000\ndata: b\n\n",
        [_m("a"), _m("b")],
    ),
    Case("NUL in id ignored", b"id: a\x00b\ndata: x\n\n", [_m("x")]),
    Case(
        "last event without blank line at EOF",
        b"data: a\n\ndata: b",
        [_m("a")],
        "spec: discarded; ours keeps it on purpose (servers that close right after it)",
    ),
]


# --- the two parsers, read the way a client reads a response ---------------------------------
def _response(chunks: list[bytes]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=iter(chunks))


def ours_over_response(chunks: list[bytes]) -> Iterator[Event]:
    for e in iter_sse(_response(chunks).iter_bytes()):
        yield (e.event, e.data, e.id, e.retry)


def httpx_sse_over_response(chunks: list[bytes]) -> Iterator[Event]:
    for e in httpx_sse.EventSource(_response(chunks)).iter_sse():
        yield (e.event, e.data, e.id or None, e.retry)


def ours_alone(chunks: list[bytes]) -> int:
    decoder = SSEDecoder()
    n = 0
    for chunk in chunks:
        n += len(decoder.feed(chunk))
    return n + len(decoder.close())


def httpx_sse_alone(chunks: list[bytes]) -> int:
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    lines = HxLineDecoder()
    events = HxEventDecoder()
    n = 0
    for chunk in chunks:
        for line in lines.decode(text.decode(chunk)):
            n += events.decode(line) is not None
    for line in lines.flush():
        n += events.decode(line) is not None
    return n


PARSERS: dict[str, Callable[[list[bytes]], Iterator[Event]]] = {
    "sdk.sse": ours_over_response,
    "httpx-sse": httpx_sse_over_response,
}


def correctness() -> list[tuple[Case, dict[str, str]]]:
    rows = []
    for case in CASES:
        verdicts = {}
        for name, parse in PARSERS.items():
            whole = list(parse([case.raw]))
            bytewise = list(parse([case.raw[i : i + 1] for i in range(len(case.raw))]))
            if whole == case.expected and bytewise == case.expected:
                verdicts[name] = "ok"
            else:
                got = whole if whole != case.expected else bytewise
                verdicts[name] = f"got {[(e[1], e[2], e[3]) for e in got]!r}"[:70]
        rows.append((case, verdicts))
    return rows


# --- speed ------------------------------------------------------------------------------------
def chat_stream(megabytes: float) -> bytes:
    """An OpenAI chat stream: one chunk per token, then usage, then [DONE]."""
    out = []
    size = 0
    i = 0
    while size < megabytes * 1e6:
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "qwen",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": f" tok{i} é"},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        line = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        out.append(line)
        size += len(line)
        i += 1
    out.append(b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\ndata: [DONE]\n\n')
    return b"".join(out)


def best_of(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def speed(megabytes: float, repeat: int) -> list[tuple[int, int, dict[str, float]]]:
    raw = chat_stream(megabytes)
    expected = raw.count(b"\n\n")
    rows = []
    for piece in (64, 1024, 16384):
        chunks = [raw[i : i + piece] for i in range(0, len(raw), piece)]
        runs: dict[str, Callable[[], int]] = {
            "sdk.sse (response)": lambda c=chunks: sum(1 for _ in ours_over_response(c)),
            "httpx-sse (response)": lambda c=chunks: sum(1 for _ in httpx_sse_over_response(c)),
            "sdk.sse (parser)": lambda c=chunks: ours_alone(c),
            "httpx-sse (parser)": lambda c=chunks: httpx_sse_alone(c),
        }
        for name, fn in runs.items():
            count = fn()
            if count != expected:
                raise SystemExit(f"{name}: {count} events, expected {expected}")
        rows.append((piece, len(raw), {name: best_of(fn, repeat) for name, fn in runs.items()}))
    return rows


def report(
    megabytes: float,
    repeat: int,
    cases: list[tuple[Case, dict[str, str]]],
    speeds: list[tuple[int, int, dict[str, float]]],
) -> str:
    lines = [
        f"## sse_parse — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"`python -m benchmarks.history.sse_parse --mb {megabytes:g} --repeat {repeat}` (Python "
        f"{platform.python_version()}, httpx {httpx.__version__}, httpx-sse "
        f"{getattr(httpx_sse, '__version__', '0.4.3')}; a shared 2-core machine, best of "
        f"{repeat}).",
        "",
        "Correctness (each case fed whole and one byte at a time):",
        "",
        "| case | sdk.sse | httpx-sse | note |",
        "|---|---|---|---|",
    ]
    for case, verdicts in cases:
        lines.append(
            f"| {case.name} | {verdicts['sdk.sse']} | {verdicts['httpx-sse']} | "
            f"{case.note} |".replace("\n", "\\n")
        )
    lines += [
        "",
        "Speed (seconds to parse the whole stream, best of the runs; MB/s of stream; the last "
        "column is httpx-sse's time over this row's, so above 1x this row is faster):",
        "",
        "| chunk bytes | parser | s | MB/s | x httpx-sse |",
        "|---|---|---|---|---|",
    ]
    for piece, size, times in speeds:
        for name, seconds in times.items():
            rival = name.replace("sdk.sse", "httpx-sse")
            ratio = times[rival] / seconds
            lines.append(
                f"| {piece} | {name} | {seconds:.3f} | {size / seconds / 1e6:.1f} | {ratio:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def records_of(
    cases: list[tuple[Case, dict[str, str]]], speeds: list[tuple[int, int, dict[str, float]]]
) -> list[Record]:
    """Cases each parser gets right, and sdk.sse's speed over httpx-sse's per chunk size."""
    out = [
        result(NAME, parser, f"cases right (of {len(cases)})", right, "cases")
        for parser in ("sdk.sse", "httpx-sse")
        for right in [sum(v[parser] == "ok" for _, v in cases)]
    ]
    for piece, _, times in speeds:
        for how in ("response", "parser"):
            ratio = times[f"httpx-sse ({how})"] / times[f"sdk.sse ({how})"]
            metric = f"speed, {how}, {piece}-byte chunks"
            out.append(result(NAME, "sdk.sse/httpx-sse", metric, ratio, "x"))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mb", type=float, default=4.0, help="stream size in MB")
    parser.add_argument("--repeat", type=int, default=5)


def run(args: argparse.Namespace) -> list[Record]:
    if httpx_sse is None:
        raise SystemExit("sse_parse compares with httpx-sse: .venv/bin/pip install httpx-sse")
    cases = correctness()
    speeds = speed(args.mb, args.repeat)
    reporting.publish(report(args.mb, args.repeat, cases, speeds), args.no_results)
    return records_of(cases, speeds)


if __name__ == "__main__":
    raise SystemExit(cli.run_study(sys.modules[__name__], sys.argv[1:]))
