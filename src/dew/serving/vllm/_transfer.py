"""dew's backend for vLLM's weight-transfer API: weights broadcast through dew's group.

This module runs inside the vLLM server's worker processes and imports vLLM; the worker
extension registers it under the name ``"dew"``, which a server selects with
``--weight-transfer-config '{"backend": "dew"}'``. The trainer needs no vLLM: its end is
:class:`dew.serving.weights.BroadcastGroup`, and :class:`~dew.serving.vllm.VLLMEngine`
drives vLLM's own sequence over HTTP:

* ``/init_weight_transfer_engine``: every worker joins the trainer's group (rank 0) at
  ``rank_offset`` plus its rank across the data-parallel replicas;
* per push, ``/start_weight_update``, then ``/update_weights`` with the names, dtypes,
  shapes and version while the trainer broadcasts, then ``/finish_weight_update``.

The group's backend is ``gloo`` for CPU tensors or ``nccl`` between GPUs. Receiving
never stops halfway: a receiver that refused before the broadcast ended would strand
the sender inside the collective, so the tensors are received whole and then checked
(the trainer asks the extension's ``dew_check_broadcast`` first, so a refusal here is
a race, not the rule). An update never raises for a push it refuses, since an error
out of ``/update_weights`` takes vLLM's engine down: the refusal is kept, and the
trainer reads the outcome through the extension's ``dew_transfer_outcome``. Checks,
loading and the served version are those of the extension's
:class:`~dew.serving.vllm.extension.ServedWeights`, shared through the model.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from dew.serving._claim import ClaimRefused
from dew.serving.vllm.extension import served_weights
from dew.serving.weights import JoinedGroup, checksum, join_group, receive_tensors

__all__ = ["DewTransferEngine", "DewTransferInitInfo", "DewTransferUpdateInfo"]


@dataclass
class DewTransferInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is and this server's place in it."""

    address: str
    port: int
    rank_offset: int  # the rank of this server's first worker
    world_size: int  # the trainer and every worker of every server in the group
    backend: str = "gloo"
    group_name: str = "dew"
    timeout: float = 300.0


@dataclass
class DewTransferUpdateInfo(WeightTransferUpdateInfo):
    """One push: the tensors in the order the trainer broadcasts them, and its version."""

    version: int
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


class DewTransferEngine(WeightTransferEngine[DewTransferInitInfo, DewTransferUpdateInfo]):
    """The worker's end of dew's broadcast group, as a vLLM weight-transfer engine."""

    init_info_cls = DewTransferInitInfo
    update_info_cls = DewTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._group: JoinedGroup | None = None

    def init_transfer_engine(self, init_info: DewTransferInitInfo) -> None:
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        self._group = join_group(
            init_info.address,
            init_info.port,
            rank,
            init_info.world_size,
            backend=init_info.backend,
            group_name=init_info.group_name,
            timeout=init_info.timeout,
        )

    def start_weight_update(self) -> None:
        """Nothing to prepare: a push is received and loaded whole in one update."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: the update served the weights (the label is vLLM's)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronizes an accelerator, which a CPU worker has not.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DewTransferUpdateInfo) -> None:
        # Never raises for a push it refuses: an error out of an update takes vLLM's
        # engine down. The refusal is kept for the trainer to read (dew_transfer_outcome).
        info = update_info
        served = served_weights(self.model, self.model_config)
        served.refused = ""
        if self._group is None:
            served.refused = "dew's weight transfer has no group: init it first"
            return
        try:
            tensors = receive_tensors(self._group, info.names, info.dtype_names, info.shapes)
        except Exception as exc:
            self._group = None  # a broken group cannot be trusted again
            served.refused = f"the broadcast failed: {exc}"
            return
        expected, served.expected = served.expected, None  # what dew_check_broadcast passed
        if expected is not None and expected[0] == info.version:
            _, run, fresh = expected
        else:  # not checked first: a push that names no run, which a held server refuses
            run, fresh = None, False
            try:
                served.claim.check(None, restart=False, takeover=False, now=time.monotonic())
            except ClaimRefused as exc:
                served.refused = str(exc)
                return
        why = served.broadcast_misfit(
            info.version, {n: tuple(t.shape) for n, t in tensors.items()}, fresh=fresh
        )
        fitted, why = ({}, why) if why else served.fit(tensors)
        if why:
            served.refused = why
            return
        reload = functools.partial(
            reload_weights, self.vllm_config, self.model, weights_path=None,
            is_checkpoint_format=True,
        )  # fmt: skip
        served.serve(reload, fitted, info.version, checksum(tensors))
        served.claim.took(run, time.monotonic())

    def shutdown(self) -> None:
        self._group = None
