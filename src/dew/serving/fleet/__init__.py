"""EngineFleet: many engine servers as one :class:`~dew.core.Engine` and one Publisher.

An :class:`EngineFleet` fronts engine servers of one kind: ``dew serve`` processes,
each driven by an :class:`~dew.serving.http_engine.HTTPEngine`, or vLLM servers, each
driven by a :class:`~dew.serving.vllm.VLLMEngine` (``engine="vllm"``); given by URL or
as engines, started here as local processes (:meth:`EngineFleet.launch`), or placed on a
cluster's nodes by Ray (:meth:`EngineFleet.on_ray`, :mod:`dew.serving.fleet._ray`). Sources
see one engine; the trainer publishes to one :class:`~dew.core.Publisher`. Every rule
below holds for both kinds; routing through sglang-router is for ``dew serve`` only.

Routing: a call goes to the member in rotation with the fewest calls in flight (ties:
the one that got fewer calls so far). Calls with equal ``affinity`` (a group's samples,
a session's turns) go to the member that served that affinity last while it is in
rotation (a bounded LRU table), so a shared prompt prefix is computed once there. A
call submitted while no member is in rotation waits (never blocking ``submit``) until
one joins, or resolves to :class:`~dew.core.EngineError` after ``timeout`` seconds.

Behind sglang-router (``router=URL``, or ``launch(..., router=POLICY)`` to start one):
calls go to the router, whose policy picks the worker; the members are its workers,
and everything else still goes to them directly: weight pushes, health checks, and
aborts (the router does not relay ``/abort_request``, so an abort goes to every
worker; a worker without the rid ignores it). Taking a worker out also takes it off
the router's list, and bringing it back puts it on again, each confirmed by the
router's list before the fleet goes on; a launched worker restarts on its own port.
Since the fleet does not know which worker runs a call, a take-out fails no call in
this mode: calls on a worker that died fail there (the router may retry them
elsewhere), calls on a worker that hangs end at ``timeout``. The README says when to
prefer which mode.

Timings: :meth:`EngineFleet.timings` reads every member's iteration log at once
(:class:`~dew.core.Timed`), one entry per member named by its URL; a member that does
not answer within its connect timeout is left out of that read, and only a read that
no member answers raises :class:`~dew.core.EngineError`.

Threads: the fleet owns a health thread (every ``health_interval`` seconds it pings
each member with a short timeout, concurrently, takes out members that failed
``max_failures`` checks in a row, and brings back members that answer again), for a
launched fleet a supervisor thread (restarts a local process that died), and a small
thread pool for concurrent pushes and pings. ``close()`` stops and joins all of them,
then closes the member engines and stops the local processes (SIGTERM, SIGKILL after a
grace period; only the pids started here). One lock guards the routing tables and the
member states; futures are resolved outside it. A second lock orders publishing:
:meth:`EngineFleet.load` and every bring-up of a member hold it, so a member never
joins at a version other than the fleet's. A third orders edits of the router's list: a
take-out holds it from the member's state change until the router dropped the member,
so ``load`` never returns while a member it saw leave is still on the list.

Invariants:

* Every future ``submit`` returns resolves exactly once: to the member's
  :class:`~dew.core.Call`, :class:`~dew.core.Aborted` or ``ValueError``, to
  :class:`~dew.core.EngineError` (its member was taken out, or no member joined within
  ``timeout``), or to ``RuntimeError`` once the fleet is closed. Each member future is
  wrapped in a fleet future; whoever first takes the call out of the member's table
  (the member's answer, a take-out, ``close``) resolves it, and late answers are
  ignored, so the fleet can fail a call itself when its member never answers.
* Taking a member out (its health failed ``max_failures`` times, one of its requests
  raised ``EngineError`` and an immediate ``/health`` check failed too, its process
  died, or it did not take the weights): it leaves rotation at once, every call in
  flight on it resolves to ``EngineError`` (sources record ``INFRA_ERROR`` and the
  scheduler resubmits; the fleet never resends a request itself, so nothing runs
  twice) and is aborted at the member best-effort (not at a local process known dead).
  A request's own ``EngineError`` fails that call only, unless the health check
  confirms the member is gone. The supervisor restarts a local process that died (same
  command line; under Ray, through its actor); every member that answers again is
  brought to the fleet's version (the newest weights file pushed) before it rejoins.
* Publish: ``load(variables, version)`` writes one weights file (only the newest two
  stay in the fleet's folder), pushes it to every member in rotation concurrently and
  returns once each of them serves ``version``; a member that refuses the file or does
  not answer is taken out, never left serving old weights. Calls submitted during the
  push wait for its end and then go out at the new version. So a call submitted after
  ``load`` returns is served at ``version`` or newer. When no member takes the
  weights, ``load`` raises ``EngineError`` and the fleet keeps its previous version.
* ``version`` is the version last published (at the start: the newest version any
  member serves; members behind it wait out of rotation for the first publish).
"""

from dew.serving.fleet._fleet import EngineFleet
from dew.serving.fleet._parts import MemberInfo

__all__ = ["EngineFleet", "MemberInfo"]
