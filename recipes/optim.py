"""LAMB for sharded parameters: ``pytorch_optimizer.Lamb``'s update, with whole-parameter norms under FSDP2.

``pytorch_optimizer.Lamb`` fails on FSDP2's DTensor parameters (``torch.linalg.norm(p).clamp_`` on a partial norm),
and a trust ratio taken per shard would be another algorithm. :class:`ShardedLamb` computes the update
``pytorch_optimizer.Lamb`` computes with its defaults (moments with ``grad_averaging``, decoupled weight decay
applied first, no bias correction of the second moment and a step of ``lr / (1 - beta1^t)``, trust ratio
``min(|p|, clamp) / (|update| + eps)``, 1 where a norm is 0) on every rank's local shards; the squared norms of
all local shards of a parameter group are summed over the data-parallel group in one ``all_reduce`` per group
and step. On plain tensors no collective runs and it equals ``pytorch_optimizer.Lamb`` (to float32 rounding).
The recipes' BERT module picks it under ``trainer=fsdp`` in place of ``pytorch_optimizer.Lamb``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShardedLamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019) as ``pytorch_optimizer.Lamb(lr, betas, weight_decay, eps)`` computes it, on DTensors too.

    Args:
        params: parameters or parameter groups (plain tensors or FSDP2 DTensors sharded over one mesh dimension).
        lr, betas, weight_decay, eps: as in ``pytorch_optimizer.Lamb`` (decoupled weight decay).
        clamp: the upper bound of the weight norm in the trust ratio (``pytorch_optimizer.Lamb.clamp``, 10).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-6,
        clamp: float = 10.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "eps": eps})
        self.clamp = clamp

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            group["step"] = group.get("step", 0) + 1
            step_size = lr / (1.0 - beta1 ** group["step"])  # pytorch_optimizer.Lamb: adam_debias=False
            updates = []
            for p in params:
                state = self.state[p]
                if not state:  # sharded like the parameter (DTensors): sharded checkpoints save them as they are
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                grad, weight = _local(p.grad), _local(p)
                exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                if decay:
                    weight.mul_(1.0 - decay * lr)
                updates.append(exp_avg / exp_avg_sq.sqrt().add_(eps))
            squares = torch.stack(
                [
                    torch.stack([_local(p).float().square().sum(), u.float().square().sum()])
                    for p, u in zip(params, updates)
                ]
            )
            mesh_group = next((p.device_mesh.get_group() for p in params if isinstance(p, DTensor)), None)
            if mesh_group is not None:  # one all-reduce: the whole parameters' squared norms
                dist.all_reduce(squares, group=mesh_group)
            norms = squares.sqrt().tolist()
            for p, update, (weight_norm, update_norm) in zip(params, updates, norms):
                weight_norm = min(weight_norm, self.clamp)
                trust = 1.0 if weight_norm == 0 or update_norm == 0 else weight_norm / (update_norm + eps)
                _local(p).add_(update, alpha=-step_size * trust)
        return loss
