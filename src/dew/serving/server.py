"""RolloutServer: an in-process continuous-batching engine around a Hugging Face causal LM.

Any number of threads call :meth:`RolloutServer.generate` (blocking) or
:meth:`RolloutServer.submit` (a future); one engine thread, owned by the server, serves
them all. Each engine iteration:

1. applies queued weight loads (so a load lands between two decode steps, never inside
   one), drops requests whose ``stop`` event is set, and admits pending requests into
   free slots (at most ``max_batch`` active). An idle engine woken by a request first
   lets a burst of concurrent calls land (until 0.5 ms pass without a new one, 5 ms at
   most), so they are prefilled as one batch. A busy engine batches its admissions the
   same way, counted in iterations: while at least ``_BUSY`` requests are active, fewer
   than ``_ENOUGH`` pending requests wait up to ``admit_wait`` iterations for others
   (see :func:`_admit_now`);
2. after a load, recomputes the running requests' keys/values under the new weights, so
   every token sampled after a push comes from the new weights alone (``on_load=
   "recompute"``, the default; ``"keep"`` lets them go on over the keys/values they
   have, see below); then prefills the admitted requests (left-padded, grouped by
   length) and samples their first token.
   Prefill is shared (:mod:`dew.serving._prefix`): identical prompts admitted together
   (a GRPO group's samples) are computed once, their keys/values copied into each
   sample's slot and each first token drawn independently from the shared logits; a
   prompt that equals or extends an active request's prompt copies those columns and
   computes only the rest (nothing, for an equal prompt whose logits are still kept),
   and one that extends a finished request of its affinity (the next turn of a
   multi-turn session) copies that request's kept columns;
3. runs one decode step for every active request together and samples one token each;
4. finishes requests that hit a stop token or ``max_tokens``; their slots are freed at
   once, so requests join and leave at every iteration (a finished request's keys and
   values are first copied to a kept slot, for its session's next call).

Keys and values live in per-slot buffers (:mod:`dew.serving._kv`), so a step costs one
forward over the active batch, with no cache concatenation. Steps 2-4 are the work of
:class:`~dew.serving._batch.ActiveBatch` (the active table, the slots, the kept
prefixes, the sampler); this module keeps the queues, the weights and the thread.

Invariants:

* The engine thread is the only one that touches the model copy, the KV buffers and the
  active table. Other threads talk to it through the pending and load queues, guarded by
  one condition variable; ``close()`` joins the thread.
* Every request accepted by ``submit`` (``generate`` is ``submit(...).result()``)
  resolves its future exactly once: with a :class:`Call`, with :class:`Aborted` (its
  ``stop`` event was seen set at an iteration boundary), or with ``RuntimeError`` (the
  server was closed, or a model step failed). The future is marked running before it
  is returned, so ``Future.cancel()`` cannot take it from under the engine; ``stop`` is
  the way to abort.
* A resolved request holds no slot and appears in no table (``stats()`` shows zeros once
  everything has resolved): futures resolve only after the tables are updated, so a
  done-callback, which runs on the engine thread, already sees them clean.
* ``version`` changes only after the new weights are in place; every active request's
  recorded version is the minimum over the versions that served any of its tokens (and,
  under ``on_load="keep"``, any keys/values it attends to).
* Invalid input is refused with ``ValueError`` in the caller's thread, before it reaches
  the engine, so it cannot disturb anyone else's request.
* Every column ``0 .. cached-1`` of an active request's slot holds the keys/values of
  that request's own tokens under the weights being served: a load (even one that
  failed part way) is followed by a recompute of every active slot before anything is
  admitted, and a shared prefix is copied only from a slot active in the same
  iteration, from a leader computed in the same iteration, or from a kept slot of a
  request that finished under the weights being served: every kept slot is dropped at
  a load (even a failed one), as are the prompt logits kept for reuse. So nothing
  computed under old weights serves a request after a load, and a copied prefix
  equals a recomputed one. Under ``on_load="keep"`` (PipelineRL's in-flight weight
  updates) none of this is recomputed or dropped but the prompt logits: a running
  request goes on over the keys/values it has, a kept prefix of older weights still
  serves its session's next turn (never a new start of a prompt, which is computed
  afresh: see :mod:`dew.serving._prefix`), and each request's version is the oldest
  weights behind any keys/values it attends to, so its behavior log-probs stay exact
  (they are of the distribution actually sampled) and its staleness is counted from
  the oldest weights behind any of its tokens.
* A copy is private: once admitted, a request owns its slot's columns; an abort or
  finish of one sample of a group leaves its siblings' keys/values untouched.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future

import torch

from dew.core import Aborted, Call, Engine, EngineTimings, IterationLog, SamplingParams, as_int
from dew.serving._batch import ActiveBatch
from dew.serving._kv import ModelCall, SlotCache
from dew.serving._prefix import KeptPrefixes
from dew.serving._requests import (
    CallFuture,
    Load,
    Request,
    check_weights,
    make_request,
)

__all__ = ["ON_LOAD", "RolloutServer"]

# An idle engine woken by a request waits until no new request has arrived for _QUIET
# seconds (at most _GATHER in all), so a burst of concurrent calls is prefilled together.
_QUIET = 0.0005
# What a weight load does to the running requests' keys/values (see the module docstring).
ON_LOAD = ("recompute", "keep")
_GATHER = 0.005
# A busy engine admits arrivals together (``admit_wait``). A prefill call costs about as
# much as decoding a few dozen rows whatever it admits, and arrivals of a multi-turn
# workload (each session's next turn, after its tool call) come one or two at a time.
# Below _BUSY active requests the batch is small enough that a wait would idle the
# engine and delay the request for little; _ENOUGH pending requests are a batch already.
_BUSY = 16
_ENOUGH = 8


def _admit_now(active: int, pending: int, deferred: int, admit_wait: int) -> bool:
    """Whether an iteration admits its ``pending`` requests, the engine having put
    admission off for the last ``deferred`` iterations with ``active`` requests running.

    Admission waits only while the engine is busy (``active >= _BUSY``) and the pending
    requests are few (``pending < _ENOUGH``), and never for more than ``admit_wait``
    iterations in a row; a busy engine iterates, so every wait ends.
    """
    if pending == 0 or active < _BUSY or pending >= _ENOUGH:
        return True
    return deferred >= admit_wait


class RolloutServer(Engine):
    """Serves one model copy to many threads with continuous batching.

    ``model`` is copied (the caller keeps training its own); ``version`` is the version
    served until the first :meth:`load`. ``max_batch`` bounds the active requests,
    ``max_len`` the prompt plus completion length (default: the model's
    ``max_position_embeddings``). ``seed`` seeds the engine's sampler.
    ``share_prefixes=False`` turns prefix sharing off (every prompt is computed in
    full; for comparisons). ``prefix_cache`` is how many finished requests' keys and
    values are kept for a continuation (default ``max_batch``; 0 keeps none): each takes
    a cache slot of its own, so the key/value memory grows by that many slots.
    ``on_load``: what a weight load does to running requests and kept prefixes
    (``"recompute"``: recomputed and dropped, every later token from the new weights
    alone; ``"keep"``: left as they are, the load costs nothing but the copy; see the
    module docstring). ``device``: where the engine's copy goes (default: where
    ``model`` is), so an engine can run on another GPU than the trainer.
    ``admit_wait``: how many iterations a busy engine may put off admitting a few
    pending requests so that later arrivals join their prefill (0: admit at every
    iteration; see the module docstring). It trades a few decode steps of a new
    request's latency for fewer, fuller prefills.

    Greedy requests (``temperature=0``) report log-prob 0.0 per token (the point mass on
    the argmax), ``temperature=1.0`` in their :class:`Call`, and a one-id support per
    token, so a trainer renormalizing over the support sees the same distribution.

    Supported models: decoder-only Hugging Face causal LMs with full causal attention
    through ``sdpa`` or ``eager`` whose attention layers store keys/values through
    ``cache.update`` (Llama, Qwen2, Mistral without a sliding window, and the like).
    Anything else is refused at construction with ``ValueError``.

    ``submit``, ``generate``, ``load``, ``close`` and the properties may be called from
    any thread, except that ``generate`` and ``load`` block and so must not be called
    from a done-callback of a ``submit`` future (those run on the engine thread).
    KV buffers grow (by doubling) to the widest batch in use and are kept for reuse.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        version: int = 0,
        max_batch: int = 64,
        max_len: int | None = None,
        seed: int = 0,
        share_prefixes: bool = True,
        prefix_cache: int | None = None,
        on_load: str = "recompute",
        device: str | torch.device | None = None,
        admit_wait: int = 4,
    ) -> None:
        version = as_int(version, "version")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        max_batch = as_int(max_batch, "max_batch")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        config = model.config
        if max_len is None:
            max_len = getattr(config, "max_position_embeddings", None)
            if max_len is None:
                raise ValueError(
                    "max_len is required: the model config has no max_position_embeddings"
                )
        max_len = as_int(max_len, "max_len")
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        kept = max_batch if prefix_cache is None else as_int(prefix_cache, "prefix_cache")
        if kept < 0:
            raise ValueError(f"prefix_cache must be >= 0 or None, got {prefix_cache}")
        kept = kept if share_prefixes else 0
        if on_load not in ON_LOAD:
            raise ValueError(f"on_load={on_load!r} is not one of {list(ON_LOAD)}")
        self._admit_wait = as_int(admit_wait, "admit_wait")
        if self._admit_wait < 0:
            raise ValueError(f"admit_wait must be >= 0, got {admit_wait}")
        self._model = copy.deepcopy(model).eval().requires_grad_(False)
        if device is not None:  # the engine's copy on its own device, the trainer's stays
            self._model.to(device)
        call = ModelCall(self._model)  # refuses unsupported attention kinds
        self._targets = self._model.state_dict()  # shares storage with the copy
        self._vocab = int(config.vocab_size)
        gen = getattr(self._model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        eos = getattr(config, "eos_token_id", None) if eos is None else eos
        self._eos = tuple(
            int(t) for t in ([] if eos is None else [eos] if isinstance(eos, int) else eos)
        )
        self._max_batch = max_batch
        self._max_len = max_len
        device = next(self._model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(as_int(seed, "seed"))
        cache = SlotCache(int(config.num_hidden_layers), max_batch + kept, max_len, device)
        # The engine thread's alone; slots max_batch and up hold kept prefixes.
        self._batch = ActiveBatch(
            call,
            cache,
            KeptPrefixes(max_batch, kept) if kept else None,
            generator,
            self._vocab,
            device,
            recompute=on_load == "recompute",
            share=bool(share_prefixes),
        )

        self._cond = threading.Condition()
        self._pending: deque[Request] = deque()  # guarded by _cond
        self._loads: deque[Load] = deque()  # guarded by _cond
        self._closed = False  # guarded by _cond
        self._broken: BaseException | None = None  # guarded by _cond
        self._version = version  # written by the engine under _cond
        self._iteration = 0  # written by the engine under _cond
        self._deferred = 0  # the engine thread's: iterations admission was put off in a row
        self._admissions = 0  # written by the engine under _cond: iterations that admitted
        self._timings = IterationLog()  # written by the engine thread; locks itself
        self._thread = threading.Thread(target=self._run, name="RolloutServer-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    @property
    def device(self) -> torch.device:
        """Where the engine's copy of the model is."""
        return next(self._model.parameters()).device

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def admit_wait(self) -> int:
        """Iterations a busy engine may put off admitting a few arrivals."""
        return self._admit_wait

    @property
    def max_len(self) -> int:
        """The longest prompt + completion a request may ask for."""
        return self._max_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The served model's end-of-sequence ids (from its generation config or config)."""
        return self._eos

    @property
    def alive(self) -> bool:
        """Whether the engine still serves: not closed, its thread running and unbroken."""
        with self._cond:
            up = not self._closed and self._broken is None
        return up and self._thread.is_alive()

    def timings(self) -> list[EngineTimings]:
        """This engine's iterations by active-sequence count (:class:`dew.core.Timed`),
        cumulative since it started: one entry, named ``"local"``."""
        return [EngineTimings("local", self._max_batch, self._timings.snapshot())]

    def stats(self) -> dict[str, int]:
        """Sizes of the internal tables, and counters (for tests and monitoring).

        ``prompt_tokens``: prompt tokens of every request admitted so far (served);
        ``prompt_tokens_computed``: those the model actually ran at admission. The rest
        were copied from a shared prefix, so for single-turn groups of G identical
        prompts admitted together, computed is served / G. ``admissions``: iterations
        that admitted at least one request.
        """
        batch = self._batch
        with self._cond:
            return {
                "pending": len(self._pending),
                "active": len(batch.active),
                "loads": len(self._loads),
                "iterations": self._iteration,
                "admissions": self._admissions,
                "prompt_tokens": batch.served,
                "prompt_tokens_computed": batch.computed,
                "kept": 0 if batch.kept is None else len(batch.kept),
            }

    def load(
        self,
        variables: torch.nn.Module | Mapping[str, torch.Tensor],
        version: int,
        *,
        restart: bool = False,
    ) -> None:
        """Copy ``variables`` (a module or a state dict with the model's names and shapes)
        into the engine's model between two iterations, then serve them as ``version``.

        ``restart``: ``version`` begins a new version sequence (a new trainer run took
        the engine over, and may count from 0 again): kept prefixes are forgotten,
        since their versions are no longer comparable with the new ones.
        """
        # A load waits for the engine thread: from a done-callback it would wait forever.
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                "RolloutServer.load() was called on the engine thread (from a submit "
                "future's done-callback); it would wait forever."
            )
        version = as_int(version, "version")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        state = check_weights(self._targets, variables)
        job = Load(state, version, restart=restart)
        with self._cond:
            self._check_open()
            self._loads.append(job)
            self._cond.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        stop: threading.Event | None = None,
        affinity: Hashable | None = None,
    ) -> Future[Call]:
        """Queue a completion of ``prompt`` (token ids); returns at once with its future.

        The request ends at the first token in the stop ids (kept as the last completion
        token, ``finish_reason="stop"``; ``params.stop_ids=None`` means the model's
        end-of-sequence ids) or after ``params.max_tokens`` tokens (``"length"``);
        ``temperature=0`` is greedy. The future resolves to the :class:`Call`, to
        :class:`Aborted` when ``stop`` is set or :meth:`abort` is called before the
        request finishes, or to ``RuntimeError`` when the server gets closed or a model
        step fails first. Invalid arguments raise ``ValueError`` here, in the caller's
        thread, and so does ``RuntimeError`` for a server already closed.

        Done-callbacks run on the engine thread, between two iterations: keep them
        short, and hand slow work (a verifier, an environment step) to a thread of your
        own. This is how a source serves many rollouts without a thread blocked in each.
        ``affinity`` (a fleet's routing hint; sources pass the rollout's group) is where
        this engine keeps the request's keys and values once it finishes, for a later
        call that extends it (``prefix_cache``).
        """
        request = make_request(
            prompt, params, stop, vocab=self._vocab, max_len=self._max_len, eos=self._eos
        )
        request.affinity = affinity
        future = request.future
        future.engine_thread = self._thread
        future.set_running_or_notify_cancel()  # only the engine resolves it from now on
        if request.stopped:
            future.set_exception(Aborted("generation stopped before it started"))
            return future
        with self._cond:
            self._check_open()
            self._pending.append(request)
            self._cond.notify_all()
        return future

    def abort(self, future: Future[Call]) -> None:
        """Drop the request behind ``future`` at the next iteration boundary.

        Its future then resolves to :class:`Aborted`. Returns at once; a future that
        already resolved, or that another engine made, is left alone.
        """
        if isinstance(future, CallFuture):
            future.aborted = True

    def close(self) -> None:
        """Stop the engine thread, failing every request and load that has not finished."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> RolloutServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ validation

    def _check_open(self) -> None:  # caller holds _cond
        if self._broken is not None:
            raise RuntimeError(f"RolloutServer engine failed: {self._broken!r}")
        if self._closed:
            raise RuntimeError("RolloutServer is closed")

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._iterate():
                    pass
            self._fail_all(RuntimeError("RolloutServer was closed before this request finished"))
        except BaseException as exc:  # delivered to every waiter, then re-raised
            with self._cond:
                self._broken = exc
            self._fail_all(RuntimeError(f"RolloutServer engine failed: {exc!r}"))
            raise

    def _fail_all(self, error: RuntimeError) -> None:
        with self._cond:
            self._closed = True
            waiting = [*self._pending, *self._loads]
            self._pending.clear()
            self._loads.clear()
        jobs = [*self._batch.clear(), *waiting]
        for job in jobs:
            self._resolve(job, error)

    @staticmethod
    def _resolve(job: Request | Load, error: BaseException | None = None) -> None:
        """Settle a load, or fail a request (a request's success is set by the batch)."""
        if isinstance(job, Load):
            job.error = error
            job.done.set()
        else:
            assert error is not None
            job.future.set_exception(error)

    def _iterate(self) -> bool:
        with self._cond:
            idle = False
            while not (self._closed or self._pending or self._loads or self._batch.active):
                idle = True
                self._cond.wait()
            if idle and self._pending and not self._loads:
                self._gather()
            if self._closed:
                return False
            loads = list(self._loads)
            self._loads.clear()
            dropped = [r for r in self._pending if r.stopped]
            if dropped:
                self._pending = deque(r for r in self._pending if not r.stopped)
            active = len(self._batch.active)
            room = self._max_batch - active
            if _admit_now(active, len(self._pending), self._deferred, self._admit_wait):
                self._deferred = 0
            else:
                self._deferred += 1
                room = 0
            joiners = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            self._admissions += bool(joiners)
            self._iteration += 1
            iteration = self._iteration
        batch = self._batch
        for job in loads:
            batch.before_load(restart=job.restart)
            self._apply(job)
        dropped += [r for r in batch.active if r.stopped]
        batch.remove(set(dropped))  # tables first: a caller that wakes up sees them clean
        for r in dropped:
            self._resolve(
                r, Aborted("generation stopped", tokens=len(r.completion), iteration=iteration)
            )
        try:
            # even a failed load may have changed some weights
            if loads and batch.recompute_after_load():
                batch.refill()
            start = time.perf_counter()
            if joiners:
                batch.prefill(joiners, self._version)
            if batch.active:
                active = len(batch.active)
                batch.decode(self._version)
                # the iteration's cost as the planner models it: admission and one token
                # for each active sequence (a weight load is the trainer's time, not this)
                self._timings.add(active, time.perf_counter() - start)
        except Exception as exc:  # a failed step fails its requests, and the engine goes on
            failed = RuntimeError(f"RolloutServer model step failed: {exc!r}")
            failed.__cause__ = exc
            hit = {*batch.clear(), *joiners}
            for r in hit:
                if not r.future.done():
                    self._resolve(r, failed)
        return True

    def _gather(self) -> None:  # caller holds _cond
        deadline = time.monotonic() + _GATHER
        seen = len(self._pending)
        while seen < self._max_batch and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(min(_QUIET, left))
            if len(self._pending) == seen:
                return
            seen = len(self._pending)

    def _apply(self, job: Load) -> bool:
        """Copy one load's weights in; False (and the load fails) if the copy raised."""
        try:
            with torch.no_grad():
                for name, source in job.state.items():
                    self._targets[name].copy_(source)
        except Exception as exc:
            self._resolve(job, exc)
            return False
        with self._cond:
            self._version = job.version
        self._batch.after_load(job.version)
        self._resolve(job)
        return True
