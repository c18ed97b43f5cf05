"""``--header-timeout-s``: the router's deadline on a client's request headers (slowloris
protection) is a flag, and what it parses to is the deadline the router's connections get.
A value with no deadline in it (0, negative, nan, inf) is refused by the parser, not turned
into a connection closed at once or never."""

from __future__ import annotations

import pytest

from server.launcher.settings import build_parser
from server.router import cluster
from server.router.launch import router_protocol
from server.router.limits import HEADER_TIMEOUT_S, HeaderDeadlineProtocol, client_protocol

ROUTER = ["--role", "router", "--prefill", "http://p:1", "--decode", "http://d:2"]


def parse(*argv: str):
    return build_parser().parse_args([*ROUTER, *argv])


@pytest.mark.parametrize(("given", "deadline"), [("5", 5.0), ("0.25", 0.25), ("600", 600.0)])
def test_the_flag_is_the_deadline_of_the_routers_connections(given, deadline):
    protocol = router_protocol(parse("--header-timeout-s", given))
    assert issubclass(protocol, HeaderDeadlineProtocol)
    assert protocol.header_timeout_s == deadline
    # The other bounds stay the class's own.
    assert protocol.max_connections == HeaderDeadlineProtocol.max_connections


def test_without_the_flag_the_deadline_is_the_default():
    assert parse().header_timeout_s is None
    assert router_protocol(parse()).header_timeout_s == HEADER_TIMEOUT_S == 30.0


def test_one_configured_deadline_leaves_the_default_class_alone():
    client_protocol(1.0)
    assert HeaderDeadlineProtocol.header_timeout_s == HEADER_TIMEOUT_S


@pytest.mark.parametrize("given", ["0", "-1", "-0.5", "nan", "inf", "-inf", "soon", ""])
def test_a_value_without_a_deadline_is_refused(capsys, given):
    with pytest.raises(SystemExit) as exc:
        parse(f"--header-timeout-s={given}")  # "=": "-1" is not read as a flag
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--header-timeout-s" in err
    assert "a finite number greater than 0" in err or "is not a number" in err


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_the_limits_refuse_it_too(bad):
    # A Namespace built by code, not the parser, cannot slip one past either.
    with pytest.raises(ValueError, match="finite and > 0"):
        client_protocol(bad)


def test_cluster_routers_get_the_flag():
    """--cluster passes it to every router it starts (and the router child parses it)."""
    argv = ["--cluster", "--routers", "2", "--header-timeout-s", "7", "--kv-cache-gib", "0.5"]
    routers = cluster.plan_routers(build_parser().parse_args(argv), argv, "memory", [])
    assert len(routers) == 2
    for child in routers:
        args = build_parser().parse_args([*child.argv, "--port", str(child.port)])
        assert router_protocol(args).header_timeout_s == 7.0
