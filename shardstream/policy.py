"""The user's error policy for bad samples and broken shard ranges.

``"raise"`` (default) stops at the first failure with its error (naming the shard URL and the
byte offset or key). ``"skip"`` drops the sample (or the rest of a broken range), counts and
logs it, and still raises TooManyErrors after ``tolerance`` consecutive failures (None: no limit):
a dataset that silently yields nothing is worse than a crash. Counts are reported when a
worker's epoch ends. ``pack`` follows the same policy for bad source items.
"""

from __future__ import annotations

from shardstream.errors import ConfigError, TooManyErrors
from shardstream.redact import get_logger

logger = get_logger(__name__)

ON_ERROR = ("raise", "skip")


class ErrorPolicy:
    """Counts skipped samples; raises when skipping is off or failures run too long."""

    def __init__(self, on_error: str = "raise", tolerance: int | None = 16, counters=None, *, log: bool = True):
        if on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if tolerance is not None and (not isinstance(tolerance, int) or tolerance < 0):
            raise ConfigError(f"error_tolerance must be an integer >= 0, got {tolerance!r}")
        self.on_error = on_error
        self.tolerance = tolerance
        self.skipped = 0
        self._consecutive = 0
        self._counters = counters
        self._log = log

    @property
    def counters(self):
        """The stream counters failures are counted in (None: not counted)."""
        return self._counters

    def ok(self) -> None:
        self._consecutive = 0

    def failed(self, exc: Exception, lost: int = 1, *, consecutive: int | None = None) -> None:
        """Record a failure that cost ``lost`` samples; raise it unless skipping. ``consecutive``:
        the run of failures to hold against the tolerance, for a later stage of the pipeline that
        counts its own (the transform: the decoding of the next samples is no success of it)."""
        if self.on_error == "raise":
            try:
                raise exc
            finally:
                del exc  # (a frame that holds the error it raises is a cycle with it, and with every caller's frame)
        self.skipped += lost
        if self._counters is not None:
            self._counters.add("samples_skipped", lost)
        self._consecutive += 1
        run = self._consecutive if consecutive is None else consecutive
        if self._log:
            logger.warning("on_error=skip: %s (%d samples lost)", exc, lost)
        if self.tolerance is not None and run > self.tolerance:
            raise TooManyErrors(
                f"{run} consecutive samples failed under on_error='skip' (tolerance "
                f"{self.tolerance}; last: {exc}): the dataset or the decoders are likely broken, "
                "fix them or raise the tolerance"
            ) from exc
