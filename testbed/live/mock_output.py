"""What the mock generates for one request, decided when it is parsed (`plan`): the tokens' text,
how many the decode node is to generate, and why generation ends.

Plain text is `TOKEN_TEXT` per token, `max_tokens` of them. Structured output (a JSON value for
`response_format`, a tool call's arguments) is the JSON text cut into tokens of at most
`BYTES_PER_TOKEN` UTF-8 bytes, the router's own estimate of a token; it ends where the value
does, as a model's EOS would, unless `max_tokens` cuts it first (`finish: length`, invalid JSON,
as with a real model), and `min_tokens` (or `ignore_eos`) pads it with whitespace, which JSON
allows. A `stop` sequence is looked for in that text as a serving engine does: the tokens up to
the one that completes it are generated (and counted in usage, as vLLM counts them), the client
sees the text before it. Since the text is known up front, the request asks the decode node for
exactly the tokens it will generate: a request cut short frees its decode slot when its last
token is out, and its record says what was generated.

Log probabilities are plausible, not a model's: the generated token is the most likely one
(logprob in [-0.6, 0)), its alternatives share part of the rest in decreasing order, and the
values are a function of the token's text and position, so a repeated request gets the same.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# One generated token as text: the commonest English word with its leading space is a single
# token in byte-level BPE (GPT-2, tiktoken, Qwen, Llama 3), SentencePiece and WordPiece
# vocabularies, and word-splitting pre-tokenizers never merge it with its neighbours, so a
# client that tokenizes the output counts `completion_tokens` (" tok" is 2-4 tokens in small
# vocabularies).
TOKEN_TEXT = " the"
BYTES_PER_TOKEN = 4
MAX_TOP_LOGPROBS = 20
# What the top lists offer besides the generated token (one more than MAX_TOP_LOGPROBS, so that
# 20 remain when the generated token is among them).
ALTERNATIVES = (
    " a",
    " this",
    " that",
    " of",
    " and",
    " to",
    " in",
    " is",
    ",",
    ".",
    " it",
    " for",
    " on",
    " with",
    " as",
    " was",
    " be",
    " at",
    " by",
    "\n",
    " an",
)


@dataclass(frozen=True)
class Output:
    """The generated tokens: `n` of them, each `TOKEN_TEXT` unless `pieces` lists their texts;
    the client sees the first `visible` characters of their joined text."""

    n: int
    finish: str  # length | stop | tool_calls
    visible: int
    pieces: tuple[str, ...] = ()
    offsets: tuple[int, ...] = ()  # where each piece starts in the joined text, and the end
    tool: str | None = None  # the text is the arguments of a call of this function

    def offset(self, i: int) -> int:
        return self.offsets[i] if self.pieces else i * len(TOKEN_TEXT)

    def text(self, a: int = 0, b: int | None = None) -> str:
        """The visible text of tokens [a, b)."""
        b = self.n if b is None else b
        lo, hi = self.offset(a), min(self.offset(b), self.visible)
        if lo >= hi:
            return ""
        if not self.pieces:
            return (TOKEN_TEXT * (b - a))[: hi - lo]
        return "".join(self.pieces[a:b])[: hi - lo]

    def tokens(self, a: int = 0, b: int | None = None) -> list[tuple[int, str]]:
        """(position, visible text) of each of tokens [a, b) the client sees any of."""
        b = self.n if b is None else b
        out = []
        for i in range(a, b):
            lo, hi = self.offset(i), min(self.offset(i + 1), self.visible)
            if lo >= hi:
                break
            full = self.pieces[i] if self.pieces else TOKEN_TEXT
            out.append((i, full[: hi - lo]))
        return out


def split_tokens(text: str) -> tuple[str, ...]:
    """`text` in pieces of at most BYTES_PER_TOKEN UTF-8 bytes, never splitting a character."""
    out: list[str] = []
    cur, size = "", 0
    for ch in text:
        k = len(ch.encode())
        if size + k > BYTES_PER_TOKEN and cur:
            out.append(cur)
            cur, size = "", 0
        cur += ch
        size += k
    if cur:
        out.append(cur)
    return tuple(out)


def _offsets(pieces: tuple[str, ...]) -> tuple[int, ...]:
    out = [0]
    for p in pieces:
        out.append(out[-1] + len(p))
    return tuple(out)


def find_stop(text: str, stops: tuple[str, ...], after: int = 0) -> tuple[int, int] | None:
    """The earliest stop sequence in `text` that ends past character `after`: (start, end)."""
    best: tuple[int, int] | None = None
    for s in stops:
        at = text.find(s, max(after - len(s) + 1, 0))
        if at >= 0 and (best is None or at + len(s) < best[1]):
            best = (at, at + len(s))
    return best


def plan(
    max_tokens: int,
    *,
    structured: str | None = None,
    tool: str | None = None,
    stops: tuple[str, ...] = (),
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> Output:
    """The output of a request allowed `max_tokens` tokens: plain text, or `structured` JSON text
    (a call of `tool` if given); cut at the first of `stops` to complete at or after token
    `min_tokens` (before it, vLLM does not look for stop sequences)."""
    pieces: tuple[str, ...] = ()
    offsets: tuple[int, ...] = ()
    if structured is None:
        n, finish = max_tokens, "length"
    else:
        pieces = split_tokens(structured) or (" ",)
        pad = max_tokens if ignore_eos else min_tokens
        if len(pieces) < pad:
            pieces += (" ",) * (pad - len(pieces))
        if len(pieces) > max_tokens:
            pieces, finish = pieces[:max_tokens], "length"
        else:
            finish = "tool_calls" if tool is not None else "stop"
        n, offsets = len(pieces), _offsets(pieces)
    end = offsets[-1] if pieces else n * len(TOKEN_TEXT)
    found = _first_stop(
        pieces,
        stops,
        offsets[min_tokens - 1] if pieces and min_tokens else (min_tokens - 1) * len(TOKEN_TEXT) if min_tokens else 0,
    )
    if found is not None and found[1] <= end:
        cut = next(i for i in range(1, n + 1) if (offsets[i] if pieces else i * len(TOKEN_TEXT)) >= found[1])
        return Output(cut, "stop", found[0], pieces[:cut], offsets[: cut + 1], tool)
    return Output(n, finish, end, pieces, offsets, tool)


def _first_stop(pieces: tuple[str, ...], stops: tuple[str, ...], after: int) -> tuple[int, int] | None:
    if not stops:
        return None
    if pieces:
        return find_stop("".join(pieces), stops, after)
    # Plain text repeats one token, so a stop sequence that occurs in it at all occurs within a
    # few tokens of any point: search a stretch around `after` instead of the whole text.
    longest = max(len(s) for s in stops)
    t0 = max(after - longest, 0) // len(TOKEN_TEXT)
    span = TOKEN_TEXT * ((after - t0 * len(TOKEN_TEXT) + longest) // len(TOKEN_TEXT) + 2)
    hit = find_stop(span, stops, after - t0 * len(TOKEN_TEXT))
    return None if hit is None else (hit[0] + t0 * len(TOKEN_TEXT), hit[1] + t0 * len(TOKEN_TEXT))


def token_logprobs(token: str, position: int, k: int) -> tuple[float, list[tuple[str, float]]]:
    """The generated token's logprob and the `k` most likely tokens at its position (itself
    first, then others in decreasing probability; k <= MAX_TOP_LOGPROBS)."""
    rng = random.Random(f"{position}:{token}")
    chosen = -rng.uniform(0.005, 0.6)
    if k <= 0:
        return chosen, []
    rest = 1.0 - math.exp(chosen)
    decay = rng.uniform(0.3, 0.7)
    weights = [decay**j for j in range(1, MAX_TOP_LOGPROBS)]
    total = sum(weights)
    others = [t for t in ALTERNATIVES if t != token][: k - 1]
    top = [(token, chosen)]
    top += [(t, math.log(0.9 * rest * w / total)) for t, w in zip(others, weights)]
    return chosen, top
