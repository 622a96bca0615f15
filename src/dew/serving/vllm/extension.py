"""dew's worker extension for vLLM: describes the served model, loads weights files, and
registers dew's backend for vLLM's weight-transfer API.

This module runs inside the vLLM server's worker processes, not in the trainer: start
the server with ``--worker-extension-cls dew.serving.vllm.extension.WorkerExtension``
(and ``VLLM_SERVER_DEV_MODE=1``, which opens ``/collective_rpc``). vLLM mixes the class
into its worker, so its methods see ``self.model_runner`` and ``self.vllm_config``; the
trainer's :class:`~dew.serving.vllm.VLLMEngine` calls them through ``/collective_rpc``.
It imports only torch, safetensors, :mod:`dew.serving.weights` and its folders (which
need nothing beyond numpy), so a vLLM environment needs dew installed without its
dependencies, or on its ``PYTHONPATH`` as a launched server has it. Imported where vLLM
is installed, it registers :mod:`dew.serving.vllm._transfer` under the name ``"dew"``
with vLLM's weight-transfer engines, which is how broadcast pushes reach the worker.

``dew_load(path, version)`` is all-or-nothing: the file is checked whole (its checksum,
its version, every name and shape against the checkpoint the server started from)
before any parameter is touched, and a refusal is returned as data (``{"refused":
why}``) with the served weights unchanged. Two things the in-place reload alone gets
wrong on vLLM's CPU backend are handled here:

* an output head tied to the input embedding receives no tensor of its own, so the
  packed copy the CPU linear kernel keeps of it would still hold the old weights: it is
  packed again after every load;
* keys and values of the old weights stay in the prefix cache: that is the engine's
  push sequence's job (it resets the cache, or salts requests by version).

Versions: :class:`ServedWeights`, kept on the model so that the extension and the
transfer backend share it, holds the version and checksum served. An older version is
refused; the same version is a no-op when the checksum matches and refused otherwise,
except over the weights the server started with (version 0, no checksum), which a push
of version 0 replaces: a trainer's first push is its version 0.

Runs: a push names its trainer run, which then holds the server, as on ``dew serve``
(:mod:`dew.serving._claim`'s rule): another run's push is refused while the holder has
not released it (``dew_release``) unless it takes the server over, and a run's first
push starts its own version sequence (whatever its version; the engine then drops the
prefix cache, whose keys the old sequence's versions salted).
Files are read only from ``DEW_VLLM_WEIGHTS_DIR`` (a launched server has it set to the
fleet's folder), else from :func:`dew.serving._folders.weights_root`, where engines on
the machine write by default; only regular files no larger than the model could make.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from dew.serving._claim import Claim, ClaimRefused

__all__ = ["WorkerExtension"]

WEIGHTS_DIR_ENV = "DEW_VLLM_WEIGHTS_DIR"
TRANSFER_BACKEND = "dew"  # the name dew's backend has in vLLM's weight-transfer API


class WorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    model_runner: Any  # vLLM's, on the worker this class is mixed into
    vllm_config: Any

    # ---------------------------------------------------------------- called over RPC

    def dew_describe(self) -> dict[str, Any]:
        """What the engine checks and needs: the log-prob mode, the vocabulary, the
        end-of-sequence ids (as :class:`~dew.serving.RolloutServer` reads them), the
        context length, the most sequences the scheduler runs at once, the version
        served, and whether dew's transfer backend is on."""
        config = self.model_runner.model_config
        transfer = getattr(self.vllm_config, "weight_transfer_config", None)
        return {
            "logprobs_mode": str(getattr(config.logprobs_mode, "value", config.logprobs_mode)),
            "vocab_size": int(config.get_vocab_size()),
            "eos_token_ids": _eos_ids(config),
            "max_len": int(config.max_model_len),
            "max_num_seqs": int(self.vllm_config.scheduler_config.max_num_seqs),
            "version": self._dew_served().version,
            "run": self._dew_served().claim.held_by,
            "workers": int(self.vllm_config.parallel_config.world_size),
            "transfer": getattr(transfer, "backend", None),
        }

    def dew_load(
        self, path: str, version: str, run: str = "", restart: str = "", takeover: str = ""
    ) -> dict[str, Any]:
        """Serve the weights file ``path`` (written by
        :func:`dew.serving.weights.write_weights`) as ``version`` for ``run``; see the
        module docstring. Returns ``{"version": v}`` or ``{"refused": why}``."""
        from dew.serving._folders import weights_root
        from dew.serving.weights import WeightsError, open_weights

        served = self._dew_served()
        want = int(version)
        try:
            fresh = served.claim.check(
                run or None, restart=bool(restart), takeover=bool(takeover), now=time.monotonic()
            )
        except ClaimRefused as exc:
            return {"refused": str(exc)}
        if not fresh and want < served.version:
            return {"refused": f"version {want} is older than the served {served.version}"}
        try:
            root = os.environ.get(WEIGHTS_DIR_ENV) or weights_root()
            weights = open_weights(path, root=root, max_bytes=served.max_bytes())
        except WeightsError as exc:
            return {"refused": str(exc)}
        if weights.version != want:
            return {"refused": f"{path} holds version {weights.version}, not {want}"}
        if not fresh and want == served.version and served.checksum is not None:
            if weights.checksum == served.checksum:
                return {"version": want, "unchanged": True}
            return {"refused": f"version {want} is served already, with other weights"}
        tensors, why = served.fit(weights.tensors)
        if why:
            return {"refused": why}
        served.serve(self.model_runner.reload_weights, tensors, want, weights.checksum)
        served.claim.took(run or None, time.monotonic())
        return {"version": want}

    def dew_release(self, run: str) -> dict[str, Any]:
        """``run`` lets the server go (its weights keep serving)."""
        return {"released": self._dew_served().claim.release(run)}

    def dew_check_broadcast(
        self, version: str, specs: str, run: str = "", restart: str = "", takeover: str = ""
    ) -> dict[str, Any]:
        """Whether a broadcast of ``specs`` (JSON names, dtypes, shapes) as ``version``
        by ``run`` would be served by dew's transfer backend: asked before anything is
        sent, as a receiver that refused halfway would strand the sender. ``{}`` or
        ``{"refused": why}``; what passed is what the backend then expects."""
        served = self._dew_served()
        try:
            fresh = served.claim.check(
                run or None, restart=bool(restart), takeover=bool(takeover), now=time.monotonic()
            )
        except ClaimRefused as exc:
            return {"refused": str(exc)}
        names, _, shapes = json.loads(specs)
        given = {n: tuple(int(d) for d in shape) for n, shape in zip(names, shapes, strict=True)}
        why = served.broadcast_misfit(int(version), given, fresh=fresh)
        served.expected = None if why else (int(version), run or None, fresh)
        return {"refused": why} if why else {}

    def dew_transfer_outcome(self, version: str) -> dict[str, Any]:
        """How the last push through dew's transfer backend ended: ``{"version": v}``
        once ``version`` is served, else ``{"refused": why}``."""
        served = self._dew_served()
        if served.version == int(version) and not served.refused:
            return {"version": served.version}
        return {"refused": served.refused or f"version {version} was not loaded"}

    def _dew_served(self) -> ServedWeights:
        return served_weights(self.model_runner.get_model(), self.model_runner.model_config)


class ServedWeights:
    """What a worker's model serves, shared by the extension's RPCs and dew's transfer
    backend (:mod:`dew.serving.vllm._transfer`): the version and checksum of its
    weights, the names and shapes of the checkpoint it started from, and the checks a
    push must pass before any parameter is touched."""

    def __init__(self, model: Any, model_config: Any) -> None:
        self.model = model
        self.model_config = model_config
        self.version = 0
        self.checksum: str | None = None
        self.refused = ""  # why the transfer backend's last push was not served
        self.claim = Claim()  # which trainer run holds the weights
        # The broadcast dew_check_broadcast passed: (version, run, new sequence).
        self.expected: tuple[int, str | None, bool] | None = None
        self._spec: dict[str, tuple[int, ...]] | None = None

    def broadcast_misfit(
        self, version: int, shapes: dict[str, tuple[int, ...]], *, fresh: bool = False
    ) -> str:
        """Why a broadcast of these shapes as ``version`` would be refused ("" if not):
        it must be newer (a broadcast's checksum is known only once it came; a new
        sequence, ``fresh``, may start anywhere) and fit."""
        if not fresh and version <= self.version:
            return f"version {version} is not newer than the served {self.version}"
        return self.misfit(shapes)

    def misfit(self, shapes: dict[str, tuple[int, ...]]) -> str:
        """Why tensors of these names and shapes do not fit the served checkpoint ("" if
        they do): exactly its names (a tied head may be left out or sent), its shapes. A
        fused projection loaded from only some of its parts would be silently wrong, so
        nothing may be missing."""
        spec = self.spec()
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        given = dict(shapes)
        if tied and "lm_head.weight" not in spec:
            given.pop("lm_head.weight", None)
        missing = sorted(set(spec) - set(given))
        unknown = sorted(set(given) - set(spec))
        if missing or unknown:
            return (
                f"names differ from the served model's: missing {missing[:5]}, "
                f"unknown {unknown[:5]}"
            )
        for name, shape in given.items():
            if shape != spec[name]:
                return f"{name} has shape {list(shape)}, the served model {list(spec[name])}"
        return ""

    def fit(self, tensors: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The tensors to load, cast to the served dtype (a tied head sent along is
        left out), or why they do not fit (:meth:`misfit`, or values not finite)."""
        why = self.misfit({name: tuple(t.shape) for name, t in tensors.items()})
        if why:
            return {}, why
        spec = self.spec()
        dtype = self.model_config.dtype
        fitted = {}
        for name, t in tensors.items():
            if name not in spec:
                continue  # the tied head
            if not (t.is_floating_point() and t.isfinite().all()):
                return {}, f"{name} is not a finite floating-point tensor"
            fitted[name] = t.to(dtype)
        return fitted, ""

    def serve(self, reload: Any, tensors: dict[str, Any], version: int, digest: str) -> None:
        """Load checked tensors in place through ``reload`` (vLLM's in-place reload,
        called with ``weights_iterator=``), pack the tied head again, and serve them as
        ``version`` with checksum ``digest``."""
        reload(weights_iterator=iter(tensors.items()))
        _repack_tied_heads(self.model)
        self.version, self.checksum = version, digest

    def max_bytes(self) -> int:
        """The largest weights file a push may name: the checkpoint's tensors at 8 bytes
        an element (no dtype is wider) and the largest header safetensors allows."""
        elements = sum(math.prod(shape) for shape in self.spec().values())
        return 8 * elements + (100 << 20) + 8

    def spec(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of the checkpoint the server started from."""
        if self._spec is None:
            from safetensors import safe_open

            folder = Path(self.model_config.model)
            spec: dict[str, tuple[int, ...]] = {}
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        spec[name] = tuple(f.get_slice(name).get_shape())
            if not spec:
                raise RuntimeError(f"no safetensors checkpoint in {folder}")
            self._spec = spec
        return self._spec


def served_weights(model: Any, model_config: Any) -> ServedWeights:
    """The :class:`ServedWeights` of ``model``, made on first use and kept on it, so
    the extension and the transfer backend (which vLLM hands the model alone) share it."""
    served = getattr(model, "_dew_served", None)
    if served is None:
        served = ServedWeights(model, model_config)
        model._dew_served = served
    return served


def _eos_ids(config: Any) -> list[int]:
    """The generation config's end-of-sequence ids, else the model config's."""
    eos = None
    path = Path(config.model) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(config.hf_config, "eos_token_id", None)
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


def _repack_tied_heads(model: Any) -> None:
    """Run every output head's after-loading step again: a head tied to the embedding
    got no tensor during the reload, so its packed copy (CPU) would keep the old
    weights. The step packs from the current weight and keeps it, so running it on a
    head that was loaded too changes nothing."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)


def _register_transfer_backend() -> None:
    """Make dew's backend known to vLLM's weight-transfer API as ``"dew"`` (a server
    picks it with ``--weight-transfer-config '{"backend": "dew"}'``). vLLM imports this
    module in each worker before it builds the transfer engine; imported anywhere vLLM
    is not installed (the trainer), there is nothing to register."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    try:
        WeightTransferEngineFactory.register_engine(
            TRANSFER_BACKEND, "dew.serving.vllm._transfer", "DewTransferEngine"
        )
    except ValueError:  # registered already: this module was imported before
        pass


_register_transfer_backend()
