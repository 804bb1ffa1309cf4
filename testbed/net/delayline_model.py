"""One direction of an emulated WAN link in the userspace delay line: delay, jitter and loss.

Pure: the caller passes `now` (any monotonic clock in seconds) and gets back the packet's release
time on the same clock, or None when the packet is lost. The delay line process (net/delayline.py)
owns the clock, the queues and the TUN device.

- Delay: `delay_s` plus a jitter sample, normal with sd `jitter_s` truncated (resampled) at +-2 sd,
  never below 0. The truncation leaves a sample sd of ~0.88 x `jitter_s` (`JITTER_SD_FACTOR`).
- Order: FIFO is preserved, release = max(now + delay, previous release). TCP over a real path
  rarely sees reordering; netem reorders packets whenever jitter exceeds their spacing, a known
  artefact that makes TCP see spurious dupacks and retransmit, which a real WAN would not cause.
- Loss: a two-state Markov (Gilbert) chain, P(drop | previous dropped) = c + (1 - c) p and
  P(drop | previous kept) = (1 - c) p. Its stationary loss rate is exactly p and its lag-1
  correlation exactly c (netem's correlated loss does not keep the mean at p). loss = 1 drops
  every packet (outages).
"""

from __future__ import annotations

import math
import random

JITTER_TRUNCATION_SD = 2.0
# sd of a standard normal truncated at +-2: sqrt(1 - 2 * 2 * phi(2) / (2 * Phi(2) - 1)).
JITTER_SD_FACTOR = math.sqrt(
    1.0
    - 2
    * JITTER_TRUNCATION_SD
    * math.exp(-(JITTER_TRUNCATION_SD**2) / 2)
    / math.sqrt(2 * math.pi)
    / math.erf(JITTER_TRUNCATION_SD / math.sqrt(2))
)


def _check(delay_s: float, jitter_s: float, loss: float, loss_correlation: float) -> None:
    if not (delay_s >= 0 and math.isfinite(delay_s)):
        raise ValueError(f"delay_s must be a finite number >= 0, got {delay_s!r}")
    if not (jitter_s >= 0 and math.isfinite(jitter_s)):
        raise ValueError(f"jitter_s must be a finite number >= 0, got {jitter_s!r}")
    if not 0.0 <= loss <= 1.0:
        raise ValueError(f"loss must be in [0, 1], got {loss!r}")
    # c = 1 would freeze the chain in its first state: the mean would no longer be p.
    if not 0.0 <= loss_correlation < 1.0:
        raise ValueError(f"loss_correlation must be in [0, 1), got {loss_correlation!r}")


class DelayLineModel:
    """Delay, jitter and Gilbert loss of one link direction, with per-direction counters."""

    __slots__ = (
        "delay_s",
        "jitter_s",
        "loss",
        "loss_correlation",
        "_rng",
        "_p_after_drop",
        "_p_after_keep",
        "_prev_dropped",
        "_last_release",
        "packets_in",
        "bytes_in",
        "packets_dropped",
        "bytes_dropped",
    )

    def __init__(
        self, delay_s: float, jitter_s: float = 0.0, loss: float = 0.0, loss_correlation: float = 0.0, seed: int = 0
    ) -> None:
        _check(delay_s, jitter_s, loss, loss_correlation)
        self.delay_s = float(delay_s)
        self.jitter_s = float(jitter_s)
        self.loss = float(loss)
        self.loss_correlation = float(loss_correlation)
        self._rng = random.Random(seed)
        self._prev_dropped = False
        self._last_release = -math.inf
        self._p_after_drop = 0.0
        self._p_after_keep = 0.0
        self._set_chain()
        self.packets_in = 0  # every packet offered to admit()
        self.bytes_in = 0
        self.packets_dropped = 0  # the lost subset of those
        self.bytes_dropped = 0

    def _set_chain(self) -> None:
        p, c = self.loss, self.loss_correlation
        self._p_after_drop = c + (1.0 - c) * p
        self._p_after_keep = (1.0 - c) * p

    def update(
        self,
        delay_s: float | None = None,
        jitter_s: float | None = None,
        loss: float | None = None,
        loss_correlation: float | None = None,
    ) -> None:
        """Change parameters for packets admitted from now on (queued ones keep their release).
        Validates everything before changing anything."""
        new = (
            self.delay_s if delay_s is None else float(delay_s),
            self.jitter_s if jitter_s is None else float(jitter_s),
            self.loss if loss is None else float(loss),
            self.loss_correlation if loss_correlation is None else float(loss_correlation),
        )
        _check(*new)
        self.delay_s, self.jitter_s, self.loss, self.loss_correlation = new
        self._set_chain()

    def admit(self, now: float, size: int) -> float | None:
        """Release time of a packet of `size` bytes arriving at `now`, or None if it is lost."""
        self.packets_in += 1
        self.bytes_in += size
        if self.loss > 0.0:
            if self.loss >= 1.0:
                dropped = True
            else:
                p = self._p_after_drop if self._prev_dropped else self._p_after_keep
                dropped = self._rng.random() < p
            self._prev_dropped = dropped
            if dropped:
                self.packets_dropped += 1
                self.bytes_dropped += size
                return None
        else:
            self._prev_dropped = False
        delay = self.delay_s
        sd = self.jitter_s
        if sd > 0.0:
            gauss = self._rng.gauss
            x = gauss(0.0, 1.0)
            while x > JITTER_TRUNCATION_SD or x < -JITTER_TRUNCATION_SD:
                x = gauss(0.0, 1.0)
            delay += x * sd
            if delay < 0.0:
                delay = 0.0
        release = now + delay
        if release < self._last_release:
            release = self._last_release
        self._last_release = release
        return release

    @property
    def last_release(self) -> float:
        """Release time of the latest kept packet (-inf before the first)."""
        return self._last_release
