"""Training on several devices: DDP with two spawned CPU workers (gloo) on a small hand-made dataset, and the
``devices``/``strategy`` params. Net and collate are module-level: spawned workers unpickle them by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT

from detectors.config.core import ParamsError, from_dict
from detectors.config.schema import TrainingParams
from detectors.evaluation.metrics import auroc
from detectors.training import fit, predict

PARAMS = TrainingParams(
    hidden=8,
    dropout=0.0,
    lr=0.05,
    weight_decay=0.0,
    batch_size=16,
    max_epochs=6,
    patience=6,
    threshold="youden",
    seed=0,
    accelerator="cpu",
)


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.layer(batch["x"]).squeeze(-1)


def collate(items: list[dict]) -> dict:
    return {"x": torch.stack([i["x"] for i in items]), "label": torch.stack([i["label"] for i in items])}


def points(n: int, seed: int) -> list[dict]:
    """Label 1 around (1, 1), label 0 around (-1, -1): overlapping clouds (so the AUROC is below 1 and varies by
    epoch)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    xs = rng.normal(0, 1.2, (n, 2)) + (2 * labels[:, None] - 1)
    return [{"x": torch.tensor(x, dtype=torch.float32), "label": torch.tensor(y)} for x, y in zip(xs, labels)]


def test_the_reported_val_auroc_counts_every_val_record_once_and_is_the_returned_nets():
    """Two CPU workers (``ddp_spawn``, gloo) on a val split of odd size, so the two shards are uneven (21 + 20): the
    best validation AUROC the caller gets is the returned net's AUROC on the val split, each record once (Lightning's
    default sampler pads the shorter shard with a repeated record, which the synced AUROC then counts twice)."""
    train, val, test = points(96, 0), points(41, 1), points(200, 2)
    net, summary = fit(Linear, train, val, collate, dataclasses.replace(PARAMS, devices=2))
    assert summary["devices"] == 2 and summary["device"] == "cpu" and 1 <= summary["epochs"] <= PARAMS.max_epochs
    labels = lambda items: np.array([int(i["label"]) for i in items])  # noqa: E731
    assert auroc(labels(test), predict(net, test, collate)) > 0.85  # trained, and returned to this process
    assert summary["best_val_auroc"] == pytest.approx(auroc(labels(val), predict(net, val, collate)), abs=1e-6)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("devices", 0, r"train_early\.training\.devices = 0: must be positive"),
        ("devices", "2", r"train_early\.training\.devices = '2': expected an integer"),
        ("strategy", "dp", r"train_early\.training\.strategy = 'dp': use one of auto, ddp_spawn"),
        ("strategy", 2, r"train_early\.training\.strategy = 2: expected a string"),
    ],
)
def test_bad_devices_or_strategy_is_refused_naming_the_key(key, value, message):
    shipped = yaml.safe_load((ROOT / "params.yaml").read_text())["train_early"]["training"]
    assert from_dict(TrainingParams, shipped, "train_early.training", strict=True).devices == 1
    with pytest.raises(ParamsError, match=message):
        from_dict(TrainingParams, {**shipped, key: value}, "train_early.training", strict=True)
