"""The one rule for how long the index offers a hold (:func:`offered_hold_ttl_s`): the router
offering D's holds and an aggregated replica offering its own both follow it."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from server.index.publisher import index_hold_ttl_s
from server.index.sessions import HOLD_OFFER_MARGIN_S, offered_hold_ttl_s
from server.router.launch import router_ttl


def test_a_hold_is_offered_the_margin_less_but_never_under_half():
    assert offered_hold_ttl_s(30.0) == 25.0
    assert offered_hold_ttl_s(120.0) == 115.0
    assert offered_hold_ttl_s(10.0) == 5.0  # where the two sides meet
    assert offered_hold_ttl_s(4.0) == 2.0  # a short hold keeps half, not nothing


@given(st.floats(min_value=0.01, max_value=1e6, allow_nan=False))
def test_an_offered_hold_ends_before_its_holder_lets_go(hold_ttl_s):
    offered = offered_hold_ttl_s(hold_ttl_s)
    assert hold_ttl_s / 2 <= offered < hold_ttl_s
    assert offered >= hold_ttl_s - HOLD_OFFER_MARGIN_S


@given(st.floats(min_value=0.5, max_value=1e5, allow_nan=False))
def test_the_router_and_a_replica_offer_the_same_hold_alike(hold_ttl_s):
    """D's hold through the router and a replica's own, for the same ``--pd-hold-ttl-s``."""
    transfer = SimpleNamespace(kv_connector_extra_config={"decoder_kv_blocks_ttl": hold_ttl_s})
    replica = SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=transfer))
    router = router_ttl(argparse.Namespace(pd_hold_ttl_s=hold_ttl_s))
    assert index_hold_ttl_s(replica) == router == offered_hold_ttl_s(hold_ttl_s)
