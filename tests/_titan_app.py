"""A tiny torchtitan-managed run for tests/test_integrations.py, in a process of its own (gloo, world 1, so that
torchtitan's async mode has its process group).

    python _titan_app.py ENDPOINT JOB DIR MODE OUT      MODE: full | kill-after-N | resume
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

from ckptd.integrations.torchtitan import CkptdCheckpointManager

STEPS = 12


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def main(endpoint: str, job: str, work: str, mode: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work}/pg-{mode}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    optimizers = OptimizersContainer.Config(implementation="for-loop", param_groups=groups).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=STEPS)
    train = TrainState()
    config = CkptdCheckpointManager.Config(enable=True, folder="ckpt", interval=4, async_mode="async", job=job, endpoint=endpoint)
    manager = config.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states={"train_state": train},
        sd_adapter=None, base_folder=work,
    )  # fmt: skip
    loaded = manager.load() if mode == "resume" else False
    start = train.step
    kill_after = int(mode.removeprefix("kill-after-")) if mode.startswith("kill-after-") else None
    while train.step < STEPS:
        train.step += 1
        g = torch.Generator().manual_seed(train.step)
        model(torch.randn(16, 8, generator=g)).square().mean().backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        manager.save(curr_step=train.step, last_step=False)
        if train.step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    manager.maybe_wait_for_saving()
    manager.close()
    state = {f"model/{k}": v for k, v in model.state_dict().items()}
    for k, v in optimizers.state_dict().items():
        if isinstance(v, torch.Tensor):
            state[f"optim/{k}"] = v.reshape(-1) if v.dim() == 0 else v
    state["lr"] = torch.tensor([optimizers.optimizers[0].param_groups[0]["lr"]])
    save_file({k: v.contiguous() for k, v in state.items()}, out)
    with open(out + ".json", "w") as f:
        json.dump({"loaded": loaded, "resumed_at": start}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
