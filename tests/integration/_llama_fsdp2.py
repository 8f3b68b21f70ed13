"""A real training run for the integration tests: a tiny ``transformers`` Llama under two-rank FSDP2 (gloo, a
"cpu" device mesh), a ``StatefulDataLoader`` over a shuffled ``DistributedSampler``, AdamW with weight decay,
gradient clipping and a warmup/linear-decay LR schedule. Module-level so spawned ranks can import it.

One body, :func:`train`, runs every variant: without ckptd (the reference), with ckptd snapshots, killed
after a later step, or resumed from the daemon. Rank 0 writes the final gathered state with ``torch.save``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import ckptd

SEED = 0
DATA_SEED = 1234
SAMPLER_SEED = 7
SAMPLES, SEQ_LEN, BATCH = 40, 32, 4  # 20 samples per rank: 5 batches an epoch, so 8 steps cross an epoch boundary
STEPS = 8  # optimizer steps in a whole run
EVERY = 3  # snapshot after steps 3 and 6
KILL_AFTER = 7  # the killed run trains step 7 (not checkpointed) after the snapshot of step 6, then dies
WARMUP = 3
LR, WEIGHT_DECAY, CLIP = 3e-3, 0.1, 1.0


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


class Tokens(torch.utils.data.Dataset):
    """A fixed synthetic corpus: ``SAMPLES`` sequences of random token ids, the same in every process."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(DATA_SEED)
        self.ids = torch.randint(0, llama_config().vocab_size, (SAMPLES, SEQ_LEN), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def build(rank: int, world: int) -> tuple[Any, ...]:
    """Model, optimizer, scheduler, sampler and loader, built the same way in every launch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import LlamaForCausalLM, get_linear_schedule_with_warmup

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config())
    model.train()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sched = get_linear_schedule_with_warmup(optim, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    data = Tokens()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SAMPLER_SEED)
    loader = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=0)
    return model, optim, sched, sampler, loader


def gather_final(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Every parameter and optimizer-state tensor, gathered to full tensors (on rank 0; ``None`` elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    return {
        "model": {k: v.detach().clone() for k, v in msd.items()},
        "optim": {fqn: {k: _clone(v) for k, v in st.items()} for fqn, st in osd["state"].items()},
        "param_groups": osd["param_groups"],
    }


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _die_together(marks: str, rank: int, world: int) -> None:
    """SIGKILL this rank once every rank got here (a file barrier: no rank dies while another still talks to it)."""
    open(os.path.join(marks, f"dying-{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(marks, f"dying-{r}")) for r in range(world)):
        assert time.monotonic() < deadline, "the other rank never reached the kill point"
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def train(rank: int, world: int, mode: str, out: str, endpoint: str | None = None, job: str | None = None) -> dict[str, Any]:
    """One launch of the training job.

    ``mode``: ``"plain"`` (no ckptd), ``"ckptd"`` (prepare, snapshot every ``EVERY`` steps, wait at the end),
    ``"killed"`` (as ``"ckptd"``, SIGKILLed right after step ``KILL_AFTER``; it records its losses first) or
    ``"resume"`` (a fresh launch: restore from the daemon, then as ``"ckptd"``). Rank 0 saves the final state
    to ``out`` (``torch.save``) and ``out + ".killed-<rank>.json"`` holds a killed rank's losses.
    """
    torch.use_deterministic_algorithms(True)
    model, optim, sched, sampler, loader = build(rank, world)
    client = None if mode == "plain" else ckptd.Client(endpoint=endpoint, job=job)
    result: dict[str, Any] = {"losses": {}}
    step, epoch = 0, 0
    if mode == "resume":
        result["latest"] = client.latest()
        extra = client.restore(model, optim)  # a fresh optimizer without state: the restore gives it its state
        result["last_restore"] = client.last_restore
        result["extra_step"] = extra["step"]
        step, epoch = extra["step"], extra["epoch"]
        sched.load_state_dict(extra["sched"])
        loader.load_state_dict(extra["loader"])
    if client is not None:
        client.prepare(model, optim)  # before the first optimizer step of this launch
    while step < STEPS:
        sampler.set_epoch(epoch)
        for ids in loader:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optim.step()
            sched.step()
            optim.zero_grad()
            step += 1
            result["losses"][str(step)] = loss.item()
            if client is not None and step % EVERY == 0:
                extra = {"step": step, "epoch": epoch, "sched": sched.state_dict(), "loader": loader.state_dict()}
                client.snapshot(model, optim, step=step, extra=extra)  # the default, overlapped mode
            if mode == "killed" and step == KILL_AFTER:
                with open(f"{out}.killed-{rank}.json", "w") as f:
                    json.dump(result, f)
                _die_together(os.path.dirname(out), rank, world)
            if step == STEPS:
                break
        else:
            epoch += 1
    if client is not None:
        result["durable"] = client.wait(120)
        client.close()
    result["sched"] = sched.state_dict()
    final = gather_final(model, optim)
    if final is not None:
        final["sched"] = result["sched"]
        torch.save(final, out)
    return result
