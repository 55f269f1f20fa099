"""A seed ensemble: the nets of one detector trained with several seeds, served as one net whose probability is the
mean of theirs.

Every trained detector is trained with ``training.seeds`` seeds (:func:`detectors.training.fit`); one seed's net
moves with the seed (its initial weights, the order of its batches, its dropout), the mean of several moves much less,
so the ensemble is what is registered. :class:`SeedEnsemble` returns the logit of the members' mean probability, so
every caller that takes ``sigmoid(net(batch))`` (training's ``predict``, the real-time monitor, the MLflow pyfunc)
serves the ensemble with no change. The artifact stores the member's network shape with ``members`` (its count), and
:func:`build_net` rebuilds either kind from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn import functional

MEMBERS = "members"  # the key of an ensemble's member count in its network config


class SeedEnsemble(nn.Module):
    """Nets of one shape (each with a ``config``), trained with different seeds: its output is the logit of their
    mean probability, ``log(mean p) - log(mean (1 - p))``, computed from the members' log-sigmoids (exact where a
    member's probability rounds to 0 or 1). Its ``config`` is the members' with :data:`MEMBERS` added."""

    def __init__(self, members: list[nn.Module]):
        super().__init__()
        if not members:
            raise ValueError("a seed ensemble needs at least one net")
        self.members = nn.ModuleList(members)
        self.config = {**members[0].config, MEMBERS: len(members)}

    def forward(self, batch: Any) -> torch.Tensor:
        logits = torch.stack([member(batch) for member in self.members])
        return torch.logsumexp(functional.logsigmoid(logits), 0) - torch.logsumexp(functional.logsigmoid(-logits), 0)


def members(net: nn.Module) -> list[nn.Module]:
    """The nets of each seed: an ensemble's members, or the net itself (a detector trained with one seed)."""
    return list(net.members) if isinstance(net, SeedEnsemble) else [net]


def build_net(net_class: type[nn.Module], config: dict[str, Any]) -> nn.Module:
    """The untrained network an artifact's ``config`` describes: ``net_class(**config)``, or a :class:`SeedEnsemble`
    of ``config[MEMBERS]`` of them (an artifact written before ensembles has no :data:`MEMBERS`)."""
    config = dict(config)
    count = config.pop(MEMBERS, None)
    if count is None:
        return net_class(**config)
    return SeedEnsemble([net_class(**config) for _ in range(int(count))])


def per_seed(detector: Any) -> list[Any]:
    """A detector (a dataclass with a ``net``) once per seed of its seed ensemble, each serving its own member: what
    the spread across seeds is measured on. None for a detector trained with one seed."""
    nets = members(detector.net)
    return [dataclasses.replace(detector, net=net) for net in nets] if len(nets) > 1 else []
