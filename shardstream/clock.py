"""The epoch clock: which loader epoch each pass follows, and which pass continues a loaded state,
shared by the main process and its DataLoader workers (persistent ones too)."""

from __future__ import annotations

import multiprocessing
from typing import Any

from shardstream.private import spawning
from shardstream.shared import ProcessLock
from shardstream.stats import MAX_SLOTS

_NONE, _PENDING = -1, 0  # no loaded state waits for a pass; one does (> 0: the pass number that took it)
_EPOCH, _PASSES, _WORKERS, _RESUME, _RESUME_EPOCH, _SLOTS = range(6)


class EpochClock:
    """``set(e)``: the next pass is epoch e. Without it, every new pass advances the epoch by one
    by itself (the same on every rank, which all make the same passes). A pass is recognised where
    it starts, in each worker: a worker that already took part in the current pass, or a different
    number of workers than the current pass has, starts the next one. So persistent and fresh
    workers, a plain DataLoader, ``make_loader`` and direct iteration all count alike.

    ``load(e)``: a state was loaded for loader epoch e; the first pass over epoch e that starts
    continues it (``start_pass`` says so), every later pass starts afresh.
    """

    def __init__(self) -> None:
        # [set epoch, passes started since, workers in the current pass, resume marker, the loaded
        # state's epoch, then per worker slot the pass it last took part in]
        self._state: Any = multiprocessing.RawArray("q", _SLOTS + MAX_SLOTS)
        self._state[_RESUME] = _NONE
        self._lock: Any = ProcessLock()

    def set(self, epoch: int) -> None:
        with self._lock:
            self._reset(epoch)

    def _reset(self, epoch: int) -> None:
        pending = self._state[_RESUME] == _PENDING  # a state taken by a pass is used up; one still waiting, not
        resume_epoch = self._state[_RESUME_EPOCH]
        self._state[:] = [epoch] + [0] * (len(self._state) - 1)
        self._state[_RESUME], self._state[_RESUME_EPOCH] = (_PENDING, resume_epoch) if pending else (_NONE, 0)

    def load(self, epoch: int) -> None:
        with self._lock:
            self._reset(epoch)
            self._state[_RESUME], self._state[_RESUME_EPOCH] = _PENDING, epoch

    def follow(self, epoch: int) -> None:
        """A DataLoader worker loaded its own state, and its share of that pass (epoch - 1) is
        over: the next pass is ``epoch``, unless another worker's state (``load(epoch - 1)``)
        waits for that pass. Its workers load their states before any of them starts the pass."""
        with self._lock:
            if not (self._state[_RESUME] == _PENDING and self._state[_RESUME_EPOCH] == epoch - 1):
                self._reset(epoch)

    @property
    def current(self) -> int:
        """The epoch of the pass in progress or last started; before any pass, the epoch set."""
        return self._state[_EPOCH] + max(self._state[_PASSES] - 1, 0)

    @property
    def upcoming(self) -> int:
        """The epoch the next pass will follow."""
        return self._state[_EPOCH] + self._state[_PASSES]

    @property
    def started(self) -> bool:
        """A pass has started since the epoch was last set (or a state loaded)."""
        return self._state[_PASSES] > 0

    @property
    def workers(self) -> int:
        """Workers of the pass in progress or last started (0 before any)."""
        return self._state[_WORKERS]

    @property
    def current_resumed(self) -> bool:
        """The pass in progress (or last started) continues the loaded state."""
        return self._state[_RESUME] > 0 and self._state[_RESUME] == self._state[_PASSES]

    @property
    def upcoming_resumed(self) -> bool:
        """The next pass will continue the loaded state."""
        return self._state[_RESUME] == _PENDING and self._state[_RESUME_EPOCH] == self.upcoming

    def start_pass(self, worker: int, num_workers: int) -> tuple[int, bool]:
        """Called once per pass by each worker (or the main process as worker 0 of 1): (its epoch,
        whether it continues the loaded state)."""
        state = self._state
        slot = _SLOTS + worker % MAX_SLOTS
        with self._lock:
            if state[_PASSES] == 0 or state[slot] == state[_PASSES] or state[_WORKERS] != num_workers:
                state[_PASSES] += 1
                state[_WORKERS] = num_workers
                epoch = state[_EPOCH] + state[_PASSES] - 1
                if state[_RESUME] > 0:
                    state[_RESUME] = _NONE  # the resumed pass is over
                if state[_RESUME] == _PENDING and state[_RESUME_EPOCH] == epoch:
                    state[_RESUME] = state[_PASSES]
            state[slot] = state[_PASSES]
            return state[_EPOCH] + state[_PASSES] - 1, state[_RESUME] == state[_PASSES]

    def __getstate__(self):
        if not spawning():
            return {"values": list(self._state)}  # a plain copy (pickle, deepcopy): its own clock
        return {"state": self._state, "lock": self._lock}

    def __setstate__(self, d) -> None:
        if "values" in d:
            self._state = multiprocessing.RawArray("q", d["values"])
            self._lock = ProcessLock()
        else:
            self._state, self._lock = d["state"], d["lock"]
