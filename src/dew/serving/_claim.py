"""Which trainer run holds a server's weights: the rule that lets a new run take a
running server over, and keeps two live trainers from pushing to one server.

A push may name its run (``dew_run``) and say it begins the run's version sequence
(``dew_restart``: an engine's first push; a new run, or the same run resumed, counts
its versions from its own start). The first push of a run holds the server for it.
Another run's push is refused while the holder has not released the server (its
engine's ``close()`` does) unless it asks to take over (``dew_takeover``): a trainer
killed without closing leaves its claim, and only an explicit takeover (or the same
run, resumed) passes it. After a takeover the old holder's pushes are refused, so a
trainer that lost its server stops at its next push instead of training on another
run's samples.

A plain state machine: no threads, no clock of its own (``now`` is passed in).

Invariants:

* :meth:`Claim.check` never changes the state; only :meth:`Claim.took` (after the
  push succeeded) and :meth:`Claim.release` do, so a refused or failed push leaves the
  holder as it was;
* a push of a run other than the holder passes only when nobody holds the server, the
  holder released it, or the push asks to take over;
* a push without a run (a client that does not name one) passes only when nobody holds
  the server, and never begins a new sequence;
* a new sequence begins exactly when a passing push names a run other than the last
  one that pushed, or asks for it (``restart``).
"""

from __future__ import annotations

__all__ = ["Claim", "ClaimRefused"]


class ClaimRefused(Exception):
    """The server is held by another run (the message says which and what to do)."""


class Claim:
    """The run that holds a server's weights (see the module docstring)."""

    def __init__(self) -> None:
        self.holder: str | None = None  # the run of the last push that passed
        self.released = False
        self._last = 0.0  # monotonic time of the holder's last push

    @property
    def held_by(self) -> str | None:
        """The run holding the server now; None when nobody does."""
        return None if self.released else self.holder

    def check(self, run: str | None, *, restart: bool, takeover: bool, now: float) -> bool:
        """Whether a push by ``run`` begins a new version sequence; ClaimRefused when it
        may not go on at all."""
        held = self.held_by
        if run is None:
            if held is not None:
                raise ClaimRefused(
                    f"this server is held by run {held!r} ({self._age(now)}); a push must "
                    "name its run (dew_run), and take the server over (dew_takeover) to "
                    "replace that run"
                )
            return False
        if held is not None and held != run and not takeover:
            raise ClaimRefused(
                f"this server is held by run {held!r} ({self._age(now)}): stop that "
                "trainer (its close releases the server), or take the server over "
                "(dew train: engine.takeover = true; HTTPEngine(takeover=True))"
            )
        return restart or run != self.holder

    def took(self, run: str | None, now: float) -> None:
        """A push by ``run`` (that :meth:`check` passed) succeeded."""
        if run is None:
            return
        self.holder, self.released, self._last = run, False, now

    def release(self, run: str) -> bool:
        """``run`` lets the server go (its weights keep serving); False if it did not
        hold it."""
        if self.held_by != run:
            return False
        self.released = True
        return True

    def _age(self, now: float) -> str:
        return f"its last push {max(0.0, now - self._last):.0f} s ago"
