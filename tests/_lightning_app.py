"""A tiny Lightning run for tests/test_integrations.py, in a process of its own.

python _lightning_app.py ENDPOINT JOB CKPT_DIR EPOCHS MODE OUT [DEVICES]
    MODE: full | kill-at-N | resume | best | best-first | best-first-resume

best: one ``ModelCheckpoint`` keeps the newest epoch and ``last.ckpt``, another the top-1 epoch by ``train_loss``
(``mode="max"``: an early epoch wins, as the best validation score often is). best-first: the same callbacks, the
top-1 one first and by ``mode="min"`` (so it saves first at every epoch's step); best-first-resume: resumed from ``last.ckpt``.

DEVICES > 1: Lightning's own DDP launcher on CPU (it starts the other ranks by running this script again).
"""

from __future__ import annotations

import os
import signal
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from ckptd.integrations.lightning import CkptdCheckpointIO


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> tuple[list, list]:
        optim = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optim], [torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.7)]


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)


class KillAt(pl.Callback):
    """SIGKILL the run as epoch ``epoch`` starts: after the previous epoch's checkpoint was saved."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


def main(endpoint: str, job: str, ckpt_dir: str, epochs: str, mode: str, out: str, devices: str = "1") -> None:
    best = mode.startswith("best")
    callbacks: list[pl.Callback] = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_epochs=1, save_top_k=1 if best else -1)]
    if best:
        how = "max" if mode == "best" else "min"  # best-first: a new best (and its save first) at every epoch
        top = ModelCheckpoint(dirpath=ckpt_dir, monitor="train_loss", mode=how, save_top_k=1, filename="best-{epoch}-{step}")
        callbacks.insert(len(callbacks) if mode == "best" else 0, top)
    if mode.startswith("kill-at-"):
        callbacks.append(KillAt(int(mode.removeprefix("kill-at-"))))
    trainer = pl.Trainer(
        max_epochs=int(epochs), accelerator="cpu", devices=int(devices), strategy="ddp" if int(devices) > 1 else "auto",
        logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True, plugins=[CkptdCheckpointIO(job, endpoint=endpoint)], callbacks=callbacks,
    )  # fmt: skip
    model = Tiny()
    trainer.fit(model, data(), ckpt_path="last" if mode.endswith("resume") else None)
    if trainer.global_rank != 0:
        return
    optim = trainer.optimizers[0]
    state = {f"model/{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for k, v in optim.state[p].items():
            state[f"optim/{i}/{k}"] = v.reshape(-1) if v.dim() == 0 else v
    state["lr"] = torch.tensor([optim.param_groups[0]["lr"]])
    state["global_step"] = torch.tensor([trainer.global_step])
    save_file({k: v.contiguous() for k, v in state.items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
