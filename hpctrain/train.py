"""The training loop. One step, top to bottom:

    1. partition   the Topology (grid + communicators) and this rank's model pieces
    2. compute     forward/backward of this rank's microbatches (the schedule runner)
    3. communicate gradients summed over data-parallel groups, in buckets
    4. update      global grad norm (each parameter counted once), clip, AdamW
    5. checkpoint  one parallel-HDF5 file, whole or absent

``train(cfg, run_dir)`` is importable; ``hpctrain train`` calls it on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint as ckpt_mod
from . import comm
from .config import Config, dumps_toml, validate
from .data import Sampler, load_tokens
from .optim import AdamW, clip_, global_grad_norm, lr_at
from .parallel import build_model, named_parameters
from .parallel.data import GradBuffers
from .schedule.runner import run_step
from .telemetry import RunLog, Timers
from .topology import Topology


@dataclass
class Result:
    losses: list[float]
    final_step: int
    checkpoint: str | None


def setup_run_dir(cfg: Config, run_dir: Path, topo) -> Path:
    """Rank 0 creates the run directory and writes the resolved config."""
    if topo.world.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(dumps_toml(cfg))
    topo.world.barrier()
    return run_dir


def resume_from(cfg: Config, ckpt_dir: Path) -> Path | None:
    """The checkpoint to start from: none, the latest (``auto``) or an explicit path."""
    how = cfg.checkpoint.resume
    if not how:
        return None
    if how == "auto":
        return ckpt_mod.latest(ckpt_dir)
    path = Path(how)
    if path.is_dir():
        path = ckpt_mod.latest(path)
    if path is None or not path.is_file():
        raise FileNotFoundError(f"checkpoint.resume={how!r}: no checkpoint there")
    return path


def train(cfg: Config, run_dir: str | Path, world=None) -> Result:
    world = world if world is not None else comm.world()
    validate(cfg, world.size)  # before any collective: every rank fails alike
    torch.manual_seed(cfg.train.seed)

    # 1. Partition: the grid, this rank's model chunks, its slice of every batch.
    topo = Topology(cfg.topology, world)
    run_dir = setup_run_dir(cfg, Path(run_dir), topo)
    log = RunLog(run_dir, topo, cfg.train.steps, cfg.train.log_every)
    chunks = build_model(cfg, topo)
    params = named_parameters(chunks)
    grads = GradBuffers(params, topo, cfg.optim.bucket_mb)
    optimizer = AdamW(params, cfg.optim)
    tokens = load_tokens(cfg.data.path, "train", cfg.data.corpus_mb, cfg.data.val_fraction)
    t = cfg.train
    sampler = Sampler(tokens.tokens, t.seq_len, t.global_batch_size, t.micro_batch_size,
                      topo.dp_size, topo.dp_rank, t.seed)
    global_tokens = t.global_batch_size * t.seq_len
    log.info(f"{topo.world_size} ranks, grid (pp, dp_outer, ep, tp) = {topo.dims}, "
             f"{sampler.microbatches} microbatches of {t.micro_batch_size} per rank, "
             f"{sum(p.numel() for _, p in params):,} parameters on rank 0, "
             f"data: {tokens.lineage.get('source')} ({len(tokens.tokens):,} tokens)")

    # 5 (restore). Continue from a checkpoint if asked; the data stream follows the step.
    ckpt_dir = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    saver = ckpt_mod.Checkpointer(cfg.checkpoint, topo, ckpt_dir)
    start, last_saved = 0, None
    source = resume_from(cfg, ckpt_dir)
    if source is not None:
        start = int(saver.load(source, params, optimizer)["step"])
        log.info(f"resumed from {source} at step {start}")
    ckpt_attrs = {"config": dumps_toml(cfg), "topology": str(topo.dims),
                  "data_hash": tokens.lineage.get("content_hash", "")}

    timers = Timers()
    losses = []
    for step in range(start, t.steps):
        t0 = time.perf_counter()
        with timers("data"):
            microbatches = sampler.local(step)

        # 2. Compute: forward and backward of every microbatch (the schedule).
        grads.zero()
        with timers("compute"):
            loss_sum = run_step(chunks, microbatches, topo, cfg, 1.0 / global_tokens, timers)

        # 3. Communicate: sum gradients over the data-parallel groups, bucketed.
        with timers("grad_sync"):
            grads.reduce()

        # 4. Update: one global norm, clip, AdamW at this step's learning rate.
        with timers("optimizer"):
            grad_norm = global_grad_norm(params, topo)
            clip_(params, cfg.optim.grad_clip, grad_norm)
            lr = lr_at(step, cfg.optim, t.steps)
            optimizer.step(lr)
        owner = topo.is_last_stage and topo.tp_rank == 0
        loss = world.allreduce(loss_sum if owner else 0.0) / global_tokens
        losses.append(loss)

        # 5. Checkpoint every ``checkpoint.every`` steps and at the end.
        done = step + 1
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or (
                done == t.steps and cfg.checkpoint.save_final):
            with timers("checkpoint"):
                last_saved = saver.save(done, params, optimizer, ckpt_attrs)

        step_time = time.perf_counter() - t0
        comm_s, comm_bytes = comm.RECORDER.take()
        log.step({"step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": global_tokens / step_time, "step_time_s": step_time,
                  "time_s": timers.take(), "comm_s": comm_s, "comm_bytes": comm_bytes})
    log.close()
    return Result(losses, t.steps, str(last_saved) if last_saved else None)
