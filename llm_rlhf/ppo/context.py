"""What `PPOTrainer` shares with its collaborators, the rollout collector (`rollouts`) and the update (`update`):
one small value instead of a handful of arguments and callbacks each.

    PPOContext(cfg, accelerator, accelerated, sizes, tokenizer)
        .device                 the accelerator's device
        .global_sum(x)          sum over every process (detached, float32)
        .global_mean(x)         mean over every process, as a Python float

The trainer builds it once; the collaborators read it through `UsesContext`'s properties, so a test that fakes
the process group swaps `context.accelerator` in one place and every part sees the same processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PPOContext:
    """cfg: PPO's `Config`; accelerator: accelerate's `Accelerator` (the processes); accelerated: the precision
    and sharding plumbing of its accelerate config (`models.accelerated.Accelerated`); sizes: the batch sizes
    (`config.batch_sizes`); tokenizer: the policy's (left padding)."""

    cfg: Any
    accelerator: Any
    accelerated: Any
    sizes: Any
    tokenizer: Any

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over every process of a tensor of any shape."""
        return self.accelerator.reduce(x.detach().to(self.device).float(), reduction="sum")

    def global_mean(self, x) -> float:
        """Mean over every process (each holds the same number of episodes)."""
        x = torch.as_tensor(x, dtype=torch.float32, device=self.device).mean()
        return float(self.accelerator.reduce(x, reduction="mean"))


class UsesContext:
    """The context's fields as read-only attributes of a collaborator (`self.cfg`, `self.accelerator`, ...)."""

    context: PPOContext

    cfg = property(lambda self: self.context.cfg)
    accelerator = property(lambda self: self.context.accelerator)
    accelerated = property(lambda self: self.context.accelerated)
    sizes = property(lambda self: self.context.sizes)
    tokenizer = property(lambda self: self.context.tokenizer)
    device = property(lambda self: self.context.device)

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.context.global_sum(x)

    def global_mean(self, x) -> float:
        return self.context.global_mean(x)
