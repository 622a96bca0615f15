"""dew's worker extension for vLLM: describes the served model and loads weights files.

This module runs inside the vLLM server's worker processes, not in the trainer: start
the server with ``--worker-extension-cls dew.serving.vllm.extension.WorkerExtension``
(and ``VLLM_SERVER_DEV_MODE=1``, which opens ``/collective_rpc``). vLLM mixes the class
into its worker, so its methods see ``self.model_runner`` and ``self.vllm_config``; the
trainer's :class:`~dew.serving.vllm.VLLMEngine` calls them through ``/collective_rpc``.
It imports only torch, safetensors and :mod:`dew.serving.weights` (which needs nothing
beyond numpy), so a vLLM environment needs dew installed without its dependencies, or
on its ``PYTHONPATH`` as a launched server has it.

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

Versions: the extension keeps the version and checksum it serves. An older version is
refused; the same version is a no-op when the checksum matches and refused otherwise,
except over the weights the server started with (version 0, no checksum), which a push
of version 0 replaces: a trainer's first push is its version 0.
``DEW_VLLM_WEIGHTS_DIR``, when set in the server's environment, is the only folder
whose files it reads (a launched server has it set to the fleet's folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["WorkerExtension"]

WEIGHTS_DIR_ENV = "DEW_VLLM_WEIGHTS_DIR"


class WorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    model_runner: Any  # vLLM's, on the worker this class is mixed into
    vllm_config: Any

    _dew_version = 0
    _dew_checksum: str | None = None
    _dew_spec: dict[str, tuple[int, ...]] | None = None
    _dew_group: Any = None  # this worker's membership in the trainer's broadcast group

    # ---------------------------------------------------------------- called over RPC

    def dew_describe(self) -> dict[str, Any]:
        """What the engine checks and needs: the log-prob mode, the vocabulary, the
        end-of-sequence ids (as :class:`~dew.serving.RolloutServer` reads them), the
        context length, and the version this extension serves."""
        config = self.model_runner.model_config
        return {
            "logprobs_mode": str(getattr(config.logprobs_mode, "value", config.logprobs_mode)),
            "vocab_size": int(config.get_vocab_size()),
            "eos_token_ids": _eos_ids(config),
            "max_len": int(config.max_model_len),
            "version": self._dew_version,
            "workers": int(self.vllm_config.parallel_config.world_size),
        }

    def dew_load(self, path: str, version: str) -> dict[str, Any]:
        """Serve the weights file ``path`` (written by
        :func:`dew.serving.weights.write_weights`) as ``version``; see the module
        docstring. Returns ``{"version": v}`` or ``{"refused": why}``."""
        from dew.serving.weights import WeightsError, open_weights

        want = int(version)
        allowed = os.environ.get(WEIGHTS_DIR_ENV)
        if allowed and not Path(path).resolve().is_relative_to(Path(allowed).resolve()):
            return {"refused": f"weights are read only from {allowed}"}
        if want < self._dew_version:
            return {"refused": f"version {want} is older than the served {self._dew_version}"}
        try:
            weights = open_weights(path)
        except WeightsError as exc:
            return {"refused": str(exc)}
        if weights.version != want:
            return {"refused": f"{path} holds version {weights.version}, not {want}"}
        if want == self._dew_version and self._dew_checksum is not None:
            if weights.checksum == self._dew_checksum:
                return {"version": want, "unchanged": True}
            return {"refused": f"version {want} is served already, with other weights"}
        tensors, why = self._fit(weights.tensors)
        if why:
            return {"refused": why}
        return self._serve(tensors, want, weights.checksum)

    def dew_join(
        self, address: str, port: str, rank_offset: str, world_size: str, backend: str,
        group_name: str, timeout: str,
    ) -> dict[str, Any]:  # fmt: skip
        """Join the trainer's broadcast group (:class:`dew.serving.weights.BroadcastGroup`,
        rank 0) at ``rank_offset`` plus this worker's rank; blocks until all joined."""
        from dew.serving.weights import join_group

        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        self._dew_group = join_group(
            address, int(port), rank, int(world_size), backend=backend,
            group_name=group_name, timeout=float(timeout),
        )  # fmt: skip
        return {"rank": rank}

    def dew_check_broadcast(self, version: str, specs: str) -> dict[str, Any]:
        """Whether a broadcast of ``specs`` (JSON names, dtypes, shapes) as ``version``
        would be served: asked before anything is sent, as a receiver that refused
        halfway would strand the sender. ``{}`` or ``{"refused": why}``."""
        want = int(version)
        if self._dew_group is None:
            return {"refused": "no broadcast group joined"}
        if want <= self._dew_version:  # a broadcast's checksum is known only once it came
            return {"refused": f"version {want} is not newer than the served {self._dew_version}"}
        names, _, shapes = json.loads(specs)
        given = {n: tuple(int(d) for d in shape) for n, shape in zip(names, shapes, strict=True)}
        why = self._misfit(given)
        return {"refused": why} if why else {}

    def dew_receive(self, version: str, specs: str) -> dict[str, Any]:
        """Receive the broadcast :meth:`dew_check_broadcast` accepted and serve it as
        ``version``."""
        from dew.serving.weights import checksum, receive_tensors

        if self._dew_group is None:
            return {"refused": "no broadcast group joined"}
        names, dtypes, shapes = json.loads(specs)
        try:
            tensors = receive_tensors(self._dew_group, names, dtypes, shapes)
        except Exception as exc:  # a broken group cannot be trusted again
            self._dew_group = None
            return {"refused": f"the broadcast failed: {exc}"}
        fitted, why = self._fit(tensors)
        if why:
            return {"refused": why}
        return self._serve(fitted, int(version), checksum(tensors))

    def _serve(self, tensors: dict[str, Any], version: int, digest: str) -> dict[str, Any]:
        """Load checked tensors in place, pack the tied head again, and serve them as
        ``version`` with checksum ``digest``."""
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        _repack_tied_heads(self.model_runner.get_model())
        self._dew_version, self._dew_checksum = version, digest
        return {"version": version}

    # ---------------------------------------------------------------- checks

    def _misfit(self, shapes: dict[str, tuple[int, ...]]) -> str:
        """Why tensors of these names and shapes do not fit the served checkpoint ("" if
        they do): exactly its names (a tied head may be left out or sent), its shapes. A
        fused projection loaded from only some of its parts would be silently wrong, so
        nothing may be missing."""
        spec = self._spec()
        tied = bool(getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False))
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

    def _fit(self, tensors: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The tensors to load, cast to the served dtype (a tied head sent along is
        left out), or why they do not fit (:meth:`_misfit`, or values not finite)."""
        why = self._misfit({name: tuple(t.shape) for name, t in tensors.items()})
        if why:
            return {}, why
        spec = self._spec()
        dtype = self.model_runner.model_config.dtype
        fitted = {}
        for name, t in tensors.items():
            if name not in spec:
                continue  # the tied head
            if not (t.is_floating_point() and t.isfinite().all()):
                return {}, f"{name} is not a finite floating-point tensor"
            fitted[name] = t.to(dtype)
        return fitted, ""

    def _spec(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of the checkpoint the server started from."""
        if self._dew_spec is None:
            from safetensors import safe_open

            folder = Path(self.model_runner.model_config.model)
            spec: dict[str, tuple[int, ...]] = {}
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        spec[name] = tuple(f.get_slice(name).get_shape())
            if not spec:
                raise RuntimeError(f"no safetensors checkpoint in {folder}")
            self._dew_spec = spec
        return self._dew_spec


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
