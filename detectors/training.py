"""Lightning training of a binary detector: BCE, AUROC per split, early stopping on validation AUROC, and the same
training repeated with several seeds (:func:`fit`: a :class:`~detectors.ensemble.SeedEnsemble` of the nets).

Seeded and deterministic (only while training: the process's torch flags are restored afterwards);
``accelerator="auto"`` takes the GPU when there is one; ``devices`` > 1 trains data-parallel (``ddp_spawn`` unless
``strategy`` says otherwise): each device takes a share of every epoch's batches, the validation AUROC is computed over
all devices' predictions (torchmetrics syncs it; the validation split is sharded without padding, so every record counts
once), and the best epoch's weights come back to the calling process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable, Iterator

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import BinaryAUROC

from detectors.config.schema import TrainingParams
from detectors.ensemble import SeedEnsemble
from detectors.evaluation.metrics import auroc


class ListDataset(Dataset):
    def __init__(self, items: list[dict]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


class BinaryDetector(pl.LightningModule):
    """Wraps any ``net(batch) -> logits``; ``batch['label']`` is 1 for hallucinated."""

    def __init__(self, net: nn.Module, lr: float, weight_decay: float):
        super().__init__()
        self.net = net
        self.lr, self.weight_decay = lr, weight_decay
        self.loss = nn.BCEWithLogitsLoss()
        self.val_auroc = BinaryAUROC()

    def forward(self, batch: dict) -> torch.Tensor:
        return self.net(batch)

    def training_step(self, batch: dict, _: int) -> torch.Tensor:
        loss = self.loss(self(batch), batch["label"].float())
        self.log("train_loss", loss, on_epoch=True, on_step=False, batch_size=len(batch["label"]))
        return loss

    def validation_step(self, batch: dict, _: int) -> None:
        logits = self(batch)
        self.log(
            "val_loss",
            self.loss(logits, batch["label"].float()),
            on_epoch=True,
            batch_size=len(batch["label"]),
            sync_dist=True,
        )
        self.val_auroc.update(logits, batch["label"].long())
        self.log("val_auroc", self.val_auroc, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        """The best validation AUROC so far and the epochs trained, as metrics: they reach the calling process with
        every strategy (a spawned DDP worker sends its metrics back, not its callbacks' state)."""
        if self.trainer.sanity_checking:
            return
        score = float(self.trainer.callback_metrics["val_auroc"])  # over every device's predictions
        self.best_val_auroc = max(getattr(self, "best_val_auroc", score), score)
        self.log("best_val_auroc", self.best_val_auroc)
        self.log("epochs_trained", float(self.current_epoch + 1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


@contextlib.contextmanager
def deterministic_training() -> Iterator[None]:
    """Deterministic algorithms (and deterministic cuBLAS) for the duration of the block only.

    Lightning's ``Trainer(deterministic=True)`` switches them on for the whole process, turns cuDNN
    benchmarking off and sets ``CUBLAS_WORKSPACE_CONFIG``; all of it is put back as it was when the block
    ends, also when training raises, so a notebook or a test session that trains keeps its own settings.
    """
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    benchmark, cublas = torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


class Loaders(pl.LightningDataModule):
    """The train and val loaders, built in the process that trains (a spawned worker under DDP).

    The train split is shuffled with a seeded generator (under DDP Lightning shards it, seeded too). Under DDP the val
    split is sharded without padding: Lightning's default sampler repeats records to even the shards out, and the
    synced AUROC (the checkpoint and early-stopping criterion) would count those records twice."""

    def __init__(
        self, train: list[dict], val: list[dict], collate: Callable[[list[dict]], dict], batch_size: int, seed: int
    ):
        super().__init__()
        self.train, self.val, self.collate, self.batch_size, self.seed = train, val, collate, batch_size, seed

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(self.seed)
        data = ListDataset(self.train)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate, generator=gen)

    def val_dataloader(self) -> DataLoader:
        data, world, rank = ListDataset(self.val), self.trainer.world_size, self.trainer.global_rank
        sampler = (
            UnrepeatedDistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
        )
        return DataLoader(data, batch_size=max(self.batch_size, 256), sampler=sampler, collate_fn=self.collate)


@contextlib.contextmanager
def host_tensors_by_file(enabled: bool) -> Iterator[None]:
    """Spawned training processes receive the datasets' host tensors through shared-memory files instead of file
    descriptors (torch's default, which fails to rebuild some storages in the children); put back afterwards."""
    before = torch.multiprocessing.get_sharing_strategy()
    if enabled:
        torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def seed_list(params: TrainingParams) -> list[int]:
    """The seeds a detector is trained with: ``params.seeds`` of them from ``params.seed`` on (one param moves them
    all, so a stage is retrained with other seeds by changing ``seed``)."""
    return list(range(params.seed, params.seed + params.seeds))


def _fit_one(
    make_net: Callable[[], nn.Module], data: Loaders, params: TrainingParams, fast_dev_run: bool
) -> tuple[nn.Module, dict]:
    """One seed's training (``params.seed``): build the net after seeding (so its initial weights are seeded too) and
    train it; keeps the weights of the best validation-AUROC epoch. Returns the net and a summary."""
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)  # no banner per trained variant
    pl.seed_everything(params.seed, workers=True, verbose=False)
    net = make_net()
    module = BinaryDetector(net, params.lr, params.weight_decay)
    with deterministic_training(), host_tensors_by_file(params.devices > 1), tempfile.TemporaryDirectory() as tmp:
        best = ModelCheckpoint(dirpath=tmp, monitor="val_auroc", mode="max", save_top_k=1, save_weights_only=True)
        trainer = pl.Trainer(
            accelerator=params.accelerator,
            devices=params.devices,
            strategy="ddp_spawn" if params.strategy == "auto" and params.devices > 1 else params.strategy,
            max_epochs=params.max_epochs,
            callbacks=[EarlyStopping(monitor="val_auroc", mode="max", patience=params.patience), best],
            deterministic=True,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            fast_dev_run=fast_dev_run,
            default_root_dir=tmp,
        )
        trainer.fit(module, datamodule=data)
        if best.best_model_path:
            state = torch.load(best.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
            module.load_state_dict(state)
        metrics = trainer.callback_metrics
        return net, {
            "best_val_auroc": float(metrics["best_val_auroc"]) if "best_val_auroc" in metrics else float("nan"),
            "epochs": int(metrics["epochs_trained"]) if "epochs_trained" in metrics else 0,
            "device": str(trainer.strategy.root_device),
            "devices": int(trainer.world_size),
        }


def fit(
    make_net: Callable[[], nn.Module],
    train: list[dict],
    val: list[dict],
    collate: Callable[[list[dict]], dict],
    params: TrainingParams,
    *,
    fast_dev_run: bool = False,
) -> tuple[nn.Module, dict]:
    """Train ``make_net()`` once per seed of :func:`seed_list` (each its own initial weights, batch order, dropout and
    early stopping on the validation AUROC, the best epoch's weights kept): the net itself for one seed, else the
    :class:`~detectors.ensemble.SeedEnsemble` of the nets (their mean probability). The summary is the first seed's,
    with ``best_val_auroc`` the validation AUROC of what is returned, and per seed (``seeds``, in order) its own
    ``seed_val_auroc`` and ``seed_epochs``."""
    nets, summaries, seeds = [], [], seed_list(params)
    for seed in seeds:
        one = dataclasses.replace(params, seed=seed)
        data = Loaders(train, val, collate, params.batch_size, seed)
        net, summary = _fit_one(make_net, data, one, fast_dev_run)
        nets.append(net)
        summaries.append(summary)
    per_seed = {
        "seeds": seeds,
        "seed_val_auroc": [s["best_val_auroc"] for s in summaries],
        "seed_epochs": [s["epochs"] for s in summaries],
    }
    if len(nets) == 1:
        return nets[0], {**summaries[0], **per_seed}
    ensemble = SeedEnsemble(nets)
    labels = np.array([int(item["label"]) for item in val])
    value = auroc(labels, predict(ensemble, val, collate)) if len(set(labels)) == 2 else float("nan")
    epochs = int(np.median(per_seed["seed_epochs"]))
    return ensemble, {**summaries[0], "best_val_auroc": value, "epochs": epochs, **per_seed}


@torch.no_grad()
def predict(
    net: nn.Module, items: list[dict], collate: Callable[[list[dict]], dict], batch_size: int = 256
) -> np.ndarray:
    """Hallucination probabilities for ``items`` (on CPU, in order)."""
    net = net.to("cpu").eval()
    out = [torch.sigmoid(net(collate(items[i : i + batch_size]))) for i in range(0, len(items), batch_size)]
    return torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32)


def training_info(summary: dict, params: TrainingParams, **counts) -> dict:
    """What a trained detector records about its training: the fit summary, the threshold rule, counts, the seeds."""
    return {
        "seeds": seed_list(params),
        **summary,
        "threshold_strategy": params.threshold,
        **counts,
        "seed": params.seed,
    }


def reported(info: dict) -> dict:
    """A trained detector's ``info`` as its stage's metrics file reports it: without its validation scores (one per
    validation unit, kept in the artifact for the registry)."""
    return {k: v for k, v in info.items() if k != "validation"}
