"""The ids the router gives requests: unique among those in flight and the recently finished.

An outside client names its requests (the X-Request-Id header, or `testbed.request_id`) and may
reuse a name: `vllm bench serve` numbers its requests from `--request-id-prefix`, so two runs
with one prefix send the same ids, and a user may send one id by hand. Nodes keep their work by
id and a held router writes one row per request, so an id already taken gets the first free
suffix `~dupN` (`id~dup1`, `id~dup2`, ...): the client's own id stays the part before it, as a
retried attempt keeps its request's id in `id~retryN`.

Finished ids are remembered up to `REMEMBER_FINISHED` (about 100 bytes each), oldest forgotten
first; an id reused after that many others finished is taken as it is.
"""

from __future__ import annotations

DUP_SEP = "~dup"
REMEMBER_FINISHED = 200_000
# A client's own id is cut to this many characters, wherever it comes from (header or body): the
# router keeps ids in memory and writes them into records, so their size must be bounded.
MAX_CLIENT_ID = 128


def client_id(raw: str) -> str:
    """A client-chosen id as the testbed keeps it: at most MAX_CLIENT_ID characters."""
    return raw[:MAX_CLIENT_ID]


class RequestIds:
    def __init__(self, remember: int = REMEMBER_FINISHED) -> None:
        if remember < 0:
            raise ValueError(f"remember must be >= 0, got {remember}")
        self.remember = remember
        self.renamed = 0  # requests whose own id was taken
        self._live: set[str] = set()
        self._done: dict[str, None] = {}  # insertion order: the oldest is forgotten first
        self._last_dup: dict[str, int] = {}  # id -> the last suffix a duplicate of it got

    def taken(self, rid: str) -> bool:
        return rid in self._live or rid in self._done

    def claim(self, rid: str) -> str:
        """The id the request goes by: `rid` if free, else `rid~dupN` with the first free N."""
        out = rid
        if self.taken(rid):
            n = self._last_dup.get(rid, 0)
            while True:
                n += 1
                out = f"{rid}{DUP_SEP}{n}"
                if not self.taken(out):
                    break
            self._last_dup[rid] = n
            self.renamed += 1
        self._live.add(out)
        return out

    def release(self, rid: str) -> None:
        """The request is over: its id stays taken until `remember` later ones have finished."""
        if rid not in self._live:
            raise KeyError(f"request id {rid!r} is not in flight")
        self._live.remove(rid)
        self._done[rid] = None
        while len(self._done) > self.remember:
            old = next(iter(self._done))
            del self._done[old]
            self._last_dup.pop(old, None)

    @property
    def in_flight(self) -> int:
        return len(self._live)
