"""netem's netlink options, encoded as `tc` (iproute2) does; the executor registers this module as
pyroute2's codec for kind "netem" in place of pyroute2 0.9.7's own, which

- leaves `rate` in the request, where the generic layer sends it again as a top-level TCA_RATE
  (a rate estimator): the kernel rejects that with ERANGE, so netem's rate could not be set at
  all (pyroute2's htb and tbf codecs drop it in `fix_request`; its netem codec has none);
- has no TCA_NETEM_RATE64, so rates of 2^32 bytes/s (34.4 Gbit/s) and more would wrap;
- sends TCA_NETEM_CORR only when a correlation is non-zero: the kernel keeps the attributes a
  `change` leaves out, so a change to uncorrelated loss kept the old correlation.

Correlated loss is sent as netem's Gilbert-Elliott model (TCA_NETEM_LOSS, NETEM_LOSS_GE), not as
`loss P C`: netem's "correlated" random loss blends each random number with the previous one,
which narrows their spread, so far fewer than P of the packets are lost (a profile's 1% with 25%
correlation loses a small fraction of that). The two-state chain with P(drop | previous dropped)
= C + (1 - C) P and P(drop | previous kept) = (1 - C) P is the delay line's (core/delayline_model):
its stationary loss is exactly P and its lag-1 correlation exactly C.

The keyword arguments are the executor's own (`delay_us`, `jitter_us`, `loss`, `loss_corr` as
fractions, `limit` packets, `rate_bytes` per second or None for no netem rate).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pyroute2.netlink import nla  # type: ignore[import-untyped]
from pyroute2.netlink.rtnl import TC_H_ROOT  # type: ignore[import-untyped]
from pyroute2.netlink.rtnl.tcmsg.common import time2tick  # type: ignore[import-untyped]

parent = TC_H_ROOT
U32_MAX = (1 << 32) - 1
ARG_KEYS = ("delay_us", "jitter_us", "loss", "loss_corr", "limit", "rate_bytes")


def fraction_to_u32(f: float) -> int:
    """A probability as netem's u32 scale (1.0 -> 2^32 - 1), as `tc` rounds it."""
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"probability {f!r} is not in [0, 1]")
    return min(round(f * U32_MAX), U32_MAX)


def gilbert(loss: float, correlation: float) -> dict[str, int]:
    """NETEM_LOSS_GE for the chain above: p good->bad, r bad->good, every packet in the bad state
    lost (h = 0: no chance to pass), none in the good state (k1 = 0)."""
    return {
        "p": fraction_to_u32((1.0 - correlation) * loss),
        "r": fraction_to_u32((1.0 - correlation) * (1.0 - loss)),
        "h": 0,
        "k1": 0,
    }


def _num(kwarg: Mapping[str, object], key: str, default: float) -> float:
    v = kwarg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"netem argument {key!r}: {v!r} is not a number")
    return v


def get_parameters(kwarg: Mapping[str, object]) -> dict[str, object]:
    loss_f = float(_num(kwarg, "loss", 0.0))
    corr_f = float(_num(kwarg, "loss_corr", 0.0))
    loss = fraction_to_u32(loss_f)
    attrs: list[list[Any]] = [
        # Always sent, zeros included, so a change resets what it does not set.
        ["TCA_NETEM_CORR", {"delay_corr": 0, "loss_corr": 0, "dup_corr": 0}],
    ]
    if loss and corr_f > 0:
        # Without TCA_NETEM_LOSS the kernel goes back to independent loss: a change resets it too.
        attrs.append(["TCA_NETEM_LOSS", {"attrs": [["NETEM_LOSS_GE", gilbert(loss_f, corr_f)]]}])
    if kwarg.get("rate_bytes") is not None:
        rate = int(_num(kwarg, "rate_bytes", 0))
        attrs.append(
            ["TCA_NETEM_RATE", {"rate": min(rate, U32_MAX), "packet_overhead": 0, "cell_size": 0, "cell_overhead": 0}]
        )
        if rate > U32_MAX:
            attrs.append(["TCA_NETEM_RATE64", rate])
    return {
        "delay": int(time2tick(int(_num(kwarg, "delay_us", 0)))),
        "limit": int(_num(kwarg, "limit", 1000)),
        "loss": loss,
        "gap": 0,
        "duplicate": 0,
        "jitter": int(time2tick(int(_num(kwarg, "jitter_us", 0)))),
        "attrs": attrs,
    }


def fix_request(request: dict[str, object]) -> None:
    """Drop the arguments get_parameters consumed, so none reaches the message as an attribute."""
    for k in ARG_KEYS:
        request.pop(k, None)


class options(nla):  # type: ignore[misc]
    """struct tc_netem_qopt, then the nested attributes (also decodes dumps)."""

    nla_map = (
        ("TCA_NETEM_UNSPEC", "none"),
        ("TCA_NETEM_CORR", "netem_corr"),
        ("TCA_NETEM_DELAY_DIST", "none"),
        ("TCA_NETEM_REORDER", "netem_reorder"),
        ("TCA_NETEM_CORRUPT", "netem_corrupt"),
        ("TCA_NETEM_LOSS", "netem_loss"),
        ("TCA_NETEM_RATE", "netem_rate"),
        ("TCA_NETEM_ECN", "uint32"),
        ("TCA_NETEM_RATE64", "uint64"),
        ("TCA_NETEM_PAD", "none"),
        ("TCA_NETEM_LATENCY64", "int64"),
        ("TCA_NETEM_JITTER64", "int64"),
    )

    fields = (
        ("delay", "I"),
        ("limit", "I"),
        ("loss", "I"),
        ("gap", "I"),
        ("duplicate", "I"),
        ("jitter", "I"),
    )

    class netem_corr(nla):  # type: ignore[misc]
        fields = (("delay_corr", "I"), ("loss_corr", "I"), ("dup_corr", "I"))

    class netem_reorder(nla):  # type: ignore[misc]
        fields = (("prob_reorder", "I"), ("corr_reorder", "I"))

    class netem_corrupt(nla):  # type: ignore[misc]
        fields = (("prob_corrupt", "I"), ("corr_corrupt", "I"))

    class netem_loss(nla):  # type: ignore[misc]
        nla_map = (
            ("NETEM_LOSS_UNSPEC", "none"),
            ("NETEM_LOSS_GI", "none"),
            ("NETEM_LOSS_GE", "netem_ge"),
        )

        class netem_ge(nla):  # type: ignore[misc]
            fields = (("p", "I"), ("r", "I"), ("h", "I"), ("k1", "I"))

    class netem_rate(nla):  # type: ignore[misc]
        fields = (("rate", "I"), ("packet_overhead", "i"), ("cell_size", "I"), ("cell_overhead", "i"))
