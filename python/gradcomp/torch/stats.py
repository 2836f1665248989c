"""StepStats: what the hook's steps leave to read: the last step per bucket, totals since the
start (or the checkpoint), and how much of the bucket work overlapped the backward pass.

A step's statistics are staged bucket by bucket and counted only once every bucket of the step
has succeeded (commit); a failed or skipped step leaves nothing (discard), as the engine's
feedback state does.
"""

import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from .checkpoint import TOTALS


class StepStats:
    """Written from the state's thread (mark_last_ready from the hook's, DDP's autograd thread:
    one float, no lock needed), read by summary() from any thread (under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: Dict[int, Dict[str, Any]] = {}
        self._totals = {k: 0 for k in TOTALS}
        self._staged: List[Dict[str, Any]] = []  # the buckets of the step in flight
        self._timeline: List[Tuple[float, float]] = []  # (start, end) of each bucket's work
        self._last_ready = 0.0  # when DDP handed over the last bucket of the backward pass
        self._last_overlap: Optional[float] = None

    def mark_last_ready(self) -> None:
        """DDP handed over the step's last bucket: by then every gradient is computed."""
        self._last_ready = time.perf_counter()

    def stage(self, results: List[Dict[str, Any]], start: float, end: float) -> None:
        """One bucket's engine results and the span of its work, kept until commit()."""
        with self._lock:
            self._staged.extend(results)
            self._timeline.append((start, end))

    def commit(self) -> None:
        """Every bucket of the step succeeded: count them."""
        with self._lock:
            # The last step's buckets only: after a resume or a rebuild, the engine's bucket
            # indices (each entry's "bucket") can change from one step to the next.
            self._last = {stats["bucket"]: stats for stats in self._staged}
            for stats in self._staged:
                self._totals["bytes_sent"] += stats["bytes_sent"]
                self._totals["bytes_received"] += stats["bytes_received"]
                self._totals["selected"] += stats["selected"]
                self._totals["elements"] += stats["n"]
            self._staged = []
            # Overlap: the part of the bucket work that ran before the last bucket came.
            total = sum(e - s for s, e in self._timeline)
            hidden = sum(max(0.0, min(e, self._last_ready) - s) for s, e in self._timeline)
            self._last_overlap = hidden / total if total > 0 else None
            self._timeline = []
            self._totals["steps"] += 1

    def discard(self) -> None:
        """The step failed or was skipped: nothing of it is counted."""
        with self._lock:
            self._staged = []
            self._timeline = []

    def totals(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._totals)

    def restore(self, totals: Dict[str, int]) -> None:
        """A checkpoint's totals; the last step's per-bucket figures are forgotten."""
        with self._lock:
            self._totals = dict(totals)
            self._last = {}

    def summary(self, iteration: int) -> Dict[str, Any]:
        """The last step per bucket, and totals since the start (or the checkpoint)."""
        with self._lock:
            buckets = [dict(self._last[i]) for i in sorted(self._last)]
            totals = dict(self._totals)
            overlap = self._last_overlap
        selected = sum(b["selected"] for b in buckets)
        n = sum(b["n"] for b in buckets)
        return {
            "iteration": iteration,
            "buckets": buckets,
            "selected": selected,
            "n": n,
            "density": selected / n if n else 0.0,
            "bytes_sent": sum(b["bytes_sent"] for b in buckets),
            "bytes_received": sum(b["bytes_received"] for b in buckets),
            "overlap": overlap,
            "totals": totals,
        }
