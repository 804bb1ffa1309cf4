"""Choosing the container networks' block: free of the engine's networks and the host's routes."""

from __future__ import annotations

from ipaddress import IPv4Network as Net

import pytest

from testbed.deploy.base import BackendError
from testbed.deploy.subnets import COMPOSE_BASES, SWARM_BASES, parse_proc_routes, pick_base, subnets_of

pytestmark = pytest.mark.pure

# /proc/net/route of a host with a default route, docker0 and a 10.232.1.0/24 LAN (hex, little-endian).
PROC_ROUTE = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t0102A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
lan0\t0001E80A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
short line
"""


def test_proc_routes_are_decoded_and_the_default_route_left_out() -> None:
    assert parse_proc_routes(PROC_ROUTE) == [Net("172.17.0.0/16"), Net("10.232.1.0/24")]


def test_the_first_block_wins_when_nothing_is_taken() -> None:
    assert pick_base(COMPOSE_BASES, 2, [Net("172.17.0.0/16")]) == "10.232"


def test_a_block_any_of_whose_dc_subnets_is_taken_is_skipped() -> None:
    # Only the second DC's /24 collides, and a /16 route covering a block counts too.
    assert pick_base(COMPOSE_BASES, 2, [Net("10.232.1.0/24")]) == COMPOSE_BASES[1]
    assert pick_base(COMPOSE_BASES, 2, [Net("10.232.0.0/16"), Net(f"{COMPOSE_BASES[1]}.0.0/20")]) == COMPOSE_BASES[2]
    # A /24 beyond the DCs' count does not matter.
    assert pick_base(COMPOSE_BASES, 2, [Net("10.232.5.0/24")]) == "10.232"


def test_tried_blocks_are_skipped_and_exhaustion_names_what_is_taken() -> None:
    assert pick_base(SWARM_BASES, 3, [], tried=[SWARM_BASES[0]]) == SWARM_BASES[1]
    with pytest.raises(BackendError, match=r"no free block for 2 datacenter networks.*10\.0\.0\.0/8"):
        pick_base(COMPOSE_BASES, 2, [Net("10.0.0.0/8")])


def test_compose_and_swarm_blocks_are_disjoint_and_apart_from_netns() -> None:
    assert not set(COMPOSE_BASES) & set(SWARM_BASES) and "10.231" not in COMPOSE_BASES + SWARM_BASES


def test_ipam_entries_without_an_ipv4_subnet_are_ignored() -> None:
    assert subnets_of(
        [
            {"Subnet": "10.240.0.0/24", "Gateway": "10.240.0.1"},
            {"Subnet": "fd00::/64"},
            {"Gateway": "x"},
            {"Subnet": "nonsense"},
        ]
    ) == [Net("10.240.0.0/24")]
