"""The points of ``next()`` and ``broadcast()`` where an interrupt can land, by name.

# NOTE [ Interrupts ]
A signal handler that raises (Ctrl-C, ``SIGALRM``) runs on the main thread, between two
steps of whatever Python code runs there: in a loader's ``next()`` or in
``tensorcast.broadcast``, never in the lane's worker. Each point below is where one can
land, and what holds when it does (the ranks stay in step, loudly or not at all):

    ==================  ================================  =================================
    point               where                             an interrupt there
    ==================  ================================  =================================
    ``next.start``      a pass's first ``next()``, after  the retry starts the pass where
                        ``iter(source)``                  it stopped (each part once)
    ``next.recorded``   a step recorded by the pass,      the retry queues it (the pass
                        not yet queued on the lane        settles its steps first)
    ``next.queued``     a step queued, the pass not yet   nothing to repair: it was
                        told                              recorded before it was queued
    ``lane.busy``       the lane marked busy for a step   the lane is freed; the step did
                        run inline, before it runs        not run and runs on the retry
    ``step.pulled``     the source pulled a batch, its    the batch is kept: the retry's
                        frame not sent                    step sends it
    ``step.took``       a step inline took its frame,     its result is lost: the channel
                        not yet returned                  breaks, loudly, on every rank
    ``next.wait``       waiting for a step                the step stays; the retry waits
                                                          for it again
    ``next.hand_out``   a step's batch in hand, the next  the retry hands out the same
                        step being submitted              batch (submitting is idempotent)
    ``close.wait``      an early close waiting for the    the steps stay; the next close
                        steps owed to the peers, and its  (or next use) waits for them;
                        close job (``loader.steps``)      the close job is recorded once
    ``broadcast.wait``  ``broadcast`` waiting for its     not yet started: withdrawn, as
                        job on the lane's worker          if never called; else the channel
                                                          breaks (no retry can pair it)
    ==================  ================================  =================================

The channel breaking is the lane breaking (its group aborted), so the peers fail at once
with ``PeerError`` rather than at their timeout. A handler can also land in the source's
own ``next(source)``: that is the source failing (an ERROR frame, ``SourceError`` on
receivers), and inside a frame's messages: the lane breaks (NOTE [ A frame is atomic ]).

On CPython 3.11+ a handler runs only at a function's start, a call's return or a loop's
back edge; the steps above leave no such point between a batch leaving the pass and
``next()`` returning it (see ``Pass._hand_out``).

:data:`points` is the seam that tests reach these points through:
``tensorcast.testing.interrupt_at`` sets its ``hook``; unset (the default) each point
costs one attribute read, and no call (a call would be a place for a handler to land).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["POINTS", "Points", "points"]

POINTS = (
    "next.start",
    "next.recorded",
    "next.queued",
    "lane.busy",
    "step.pulled",
    "step.took",
    "next.wait",
    "next.hand_out",
    "close.wait",
    "broadcast.wait",
)


class Points:
    """The points' one seam, an object so that the layers above read it through the
    transport's face: ``hook``, if set, is called with a point's name where one is
    reached, on the thread that reaches it."""

    __slots__ = ("hook",)

    def __init__(self) -> None:
        self.hook: Callable[[str], None] | None = None


points = Points()
