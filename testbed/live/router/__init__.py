"""The router: OpenAI-style API in front, policy from `testbed.core.routing.policy` behind.

For each request it looks up every cluster's usable cached prefix in the global index, asks
the policy for a prefill and a decode instance (and any cross-cluster cache move), opens the
decode stream (the decode node then waits for KV), starts the cache move and the prefill (whose
node streams KV to the decode node), and relays tokens to the client as they come. The final
chunk carries a `testbed` field with the request's record, every timestamp in unix seconds
(`testbed.core.record`), for the replayer's records. With a control loop
(`testbed.live.link_control`) the threshold and the bandwidth state follow the measured WAN.
When the deployment is held for outside clients (`testbed.live.held`), the router writes every
request's record itself.

Besides the OpenAI routes it answers what vLLM's server does for load generators: `/version`,
`max_model_len` in `/v1/models`, and `/metrics` with vLLM v0.12's names, labels (`model_name`,
`engine`) and buckets (wire seconds, which are paper seconds at speedup 1) and each decode node's
KV-cache usage, read from the node's own `/metrics` at scrape time and labelled `engine=<node>`.

The modules, each importing only those above it:
  vllm_metrics   the `/metrics` names, buckets and scrape-time gauges
  state          `RouterState`, a request's `Progress`, `RequestFailed`
  probes         health probes and the decode nodes' KV usage
  drive          routing one attempt and driving it through the nodes
  records        the record's lifecycle check, a retry's record, a held deployment's view
  attempts       `Attempts`: the retry and the deadline around `drive`
  reply          the client's response: SSE frames or one JSON body
  handler        the OpenAI routes, `/v1/models`, `/version`, `/testbed/info`, the error bodies
  loops          sampling, probing and the control loops, wired to the state
  app            `make_app`
"""

from testbed.live.router.app import make_app

__all__ = ["make_app"]
