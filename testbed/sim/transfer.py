"""How a prefill's KV reaches its decode node in virtual time, per the nodes' PD protocol
(`nodes.protocol`), as the mock nodes run each one (`testbed.live.prefill_node`,
`testbed.live.vllm_pd`, `testbed.live.sglang_pd`):

- `testbed`, layer-wise push: the router opens the decode stream and calls the prefill node,
  which streams each layer's KV to the decode node as it is computed (`testbed.sim.prefill`);
  only the last layer is left when its compute ends.
- `vllm`, pull after the prefill: the prefill node computes, holds the KV and answers the
  router; the router sends the request on to the decode node, which asks the prefill node for
  the KV (a pull: one HTTP call back to it), and only then does the prefill node hand all of it
  to its KV transport at once. The transfer starts when the pull reaches the prefill node:
  its end plus the answer's way to the router, the router's call to the decode node and the
  pull's way to the prefill node.
- `sglang`, push arranged before: the router calls both nodes at once; the decode node
  registers with the prefill node's bootstrap service for the request's room, and the prefill
  node takes the request into its queue only once that registration has arrived; from there it
  computes and pushes layer by layer, as `testbed`.

What each message costs: the network's one-way delay between its two ends (the KV path's
delay, which is the same both ways; the router sits in the decode cluster's datacenter), and,
with the live path's costs, host time: one HTTP hop each for the pull's three calls
(`SimRouter.hop`), the dispatch cost for the registration's two (`dispatch_s`). The router's
first call to the prefill node stays as for every protocol (its WAN delay with the live path's
costs only, `testbed.sim.router`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Protocol = Literal["testbed", "vllm", "sglang"]


@dataclass(frozen=True, slots=True)
class KvDiscipline:
    protocol: Protocol = "testbed"

    @classmethod
    def of(cls, protocol: str) -> KvDiscipline:
        if protocol not in ("testbed", "vllm", "sglang"):
            raise ValueError(f"unknown node protocol {protocol!r}")
        return cls(protocol)  # type: ignore[arg-type]

    @property
    def layerwise(self) -> bool:
        """The KV streams to the decode node while the prefill computes."""
        return self.protocol != "vllm"

    @property
    def pulls(self) -> bool:
        """The decode node pulls the KV once the prefill has ended and answered."""
        return self.protocol == "vllm"

    @property
    def bootstrap(self) -> bool:
        """The prefill waits for the decode node's registration before it queues the request."""
        return self.protocol == "sglang"


def pull_arrives(end: float, to_router: float, to_decode: float, to_prefill: float, hop: float) -> float:
    """When a vLLM-style pull reaches the prefill node (the transfer's start): the prefill ended at
    `end`, its answer crossed to the router (`to_router`), the router called the decode node
    (`to_decode`) and the decode node called the prefill node back (`to_prefill`), three HTTP
    hops of `hop` host time each."""
    return end + to_router + to_decode + to_prefill + 3.0 * hop


def registered_at(sent: float, to_decode: float, to_prefill: float) -> float:
    """When an SGLang-style registration reaches the prefill node's bootstrap service: the router
    sent the request to both nodes at `sent` (after its dispatch cost, which stands for two HTTP
    calls: here the router's to the decode node and the decode node's to the prefill node); the
    decode node got it after `to_decode` and registered across `to_prefill`."""
    return sent + to_decode + to_prefill
