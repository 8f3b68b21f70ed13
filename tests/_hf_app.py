"""A tiny transformers.Trainer run for tests/test_integrations.py, in a process of its own.

python _hf_app.py ENDPOINT JOB OUTPUT_DIR MODE OUT      MODE: full | kill-after-N | resume

Under torchrun (several CPU ranks, gloo) rank 0 writes OUT.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import transformers
from safetensors.torch import save_file

from ckptd.integrations.hf import CkptdCallback

STEPS = 12


class KillAfter(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def model() -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, attention_dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": (ids := torch.randint(0, 128, (16,), generator=g)), "labels": ids.clone()} for _ in range(40)]


def main(endpoint: str, job: str, output_dir: str, mode: str, out: str) -> None:
    ckpt = CkptdCallback(job, save_steps=4, endpoint=endpoint)
    # never improves by 10: its patience counter grows at every evaluation (4, 8, 12), carried through a resume
    patience = transformers.EarlyStoppingCallback(early_stopping_patience=100, early_stopping_threshold=10.0)
    callbacks: list[transformers.TrainerCallback] = [ckpt, patience]
    if mode.startswith("kill-after-"):
        callbacks.append(KillAfter(int(mode.removeprefix("kill-after-"))))
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3, lr_scheduler_type="linear",
        warmup_steps=2, save_strategy="no", logging_strategy="no", report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, eval_strategy="steps", eval_steps=4, metric_for_best_model="eval_loss",
        restore_callback_states_from_checkpoint=True,
    )  # fmt: skip
    # evaluated at every save step: the snapshot must hold that evaluation (the best metric, the log, the eval loader's RNG draw)
    trainer = transformers.Trainer(model=model(), args=args, train_dataset=dataset(), eval_dataset=dataset()[:8], callbacks=callbacks)
    ckpt.bind(trainer)
    trainer.train(resume_from_checkpoint=ckpt.resume_checkpoint(output_dir) if mode == "resume" else None)
    if not trainer.is_world_process_zero():
        return
    state = {f"model/{k}": v for k, v in trainer.model.state_dict().items()}
    optim = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    for i, p in enumerate(trainer.model.parameters()):
        for k, v in optim.state[p].items():
            state[f"optim/{i}/{k}"] = v.reshape(-1) if v.dim() == 0 else v
    state["lr"] = torch.tensor([optim.param_groups[0]["lr"]])
    state["rng"] = torch.get_rng_state()
    state["best_metric"] = torch.tensor([trainer.state.best_metric])
    state["evaluated_at"] = torch.tensor([h["step"] for h in trainer.state.log_history if "eval_loss" in h])
    stopping = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, transformers.EarlyStoppingCallback))
    state["patience_counter"] = torch.tensor([stopping.early_stopping_patience_counter])  # a resume rebuilds the callback
    save_file({k: v.contiguous() for k, v in state.items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
