"""The training loop. One step, top to bottom:

    1. partition   the Topology (grid + communicators) and this rank's model pieces
    2. compute     forward/backward of this rank's microbatches (the schedule runner)
    3. communicate gradients summed over data-parallel groups, in buckets
    4. update      global grad norm (each parameter counted once), clip, AdamW
    5. checkpoint  one parallel-HDF5 file, whole or absent

``train(cfg, run_dir)`` is importable; ``hpctrain train`` calls it on every rank.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint as ckpt_mod
from . import comm, gpu, lineage, memory, slurm
from .config import Config, dumps_toml, validate
from .config import microbatches as microbatches_per_rank
from .data import Sampler, load_tokens
from .evaluate import Evaluator, StopRules
from .faults import Faults
from .guard import NumericGuard
from .optim import lr_at
from .parallel import build_model, named_parameters
from .parallel.data import GradBuffers
from .parallel.expert import set_loss_scale, step_metrics
from .placement import hierarchical_hook
from .schedule.runner import pipeline_metrics, run_step
from .telemetry import RunLog, Telemetry
from .topology import Topology
from .zero import build_optimizer


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


def train(cfg: Config, run_dir: str | Path, world=None) -> Result:
    world = world if world is not None else comm.world()
    validate(cfg, world.size)  # before any collective: every rank fails alike
    torch.manual_seed(cfg.train.seed)

    # 1. Partition: the grid, this rank's model chunks, its slice of every batch.
    topo = Topology(cfg.topology, world)
    run_dir = setup_run_dir(cfg, Path(run_dir), topo)
    log = RunLog(run_dir, topo, cfg.train.steps, cfg.train.log_every)
    job = slurm.attach(world, log.info)  # log the SLURM job; SIGUSR1/SIGTERM set a flag
    chunks = build_model(cfg, topo)
    params = named_parameters(chunks)
    grads = GradBuffers(params, topo, cfg.optim.bucket_mb, zero=cfg.optim.zero,
                        overlap=cfg.optim.overlap, hierarchical=hierarchical_hook(topo),
                        microbatches=microbatches_per_rank(cfg))
    optimizer = build_optimizer(params, cfg.optim, topo, grads, cfg.model.dtype)  # ZeRO 0/1/2
    meter = memory.Meter(params, grads, optimizer)  # measured bytes per rank: metrics mem_*
    tokens = load_tokens(cfg.data.path, "train", cfg.data.corpus_mb, cfg.data.val_fraction)
    t = cfg.train
    sampler = Sampler(tokens.tokens, t.seq_len, t.global_batch_size, t.micro_batch_size,
                      topo.dp_size, topo.dp_rank, t.seed, device=params[0][1].device)
    global_tokens = t.global_batch_size * t.seq_len
    set_loss_scale(chunks, 1.0 / global_tokens)  # MoE auxiliary losses, same scale
    log.info(f"{topo.world_size} ranks, grid (pp, dp_outer, ep, tp) = {topo.dims}, "
             f"{sampler.microbatches} microbatches of {t.micro_batch_size} per rank, "
             f"{sum(p.numel() for _, p in params):,} parameters on rank 0, "
             f"data: {tokens.lineage.get('source')} ({len(tokens.tokens):,} tokens)")
    if cfg.model.device == "cuda":
        log.info(f"device {params[0][1].device}; {gpu.describe()}")

    # 5 (restore). Continue from a checkpoint if asked; the data stream follows the step.
    ckpt_dir = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    saver = ckpt_mod.Checkpointer(cfg.checkpoint, topo, ckpt_dir, warn=log.warn)
    start, last_saved = 0, None
    resumed = saver.restore(cfg.checkpoint.resume, params, optimizer)  # falls back if damaged
    if resumed is not None:
        start = int(resumed["step"])
        log.info(f"resumed from {resumed['path']} at step {start}")
    run_lineage = lineage.start(run_dir, cfg, topo, tokens.lineage, resumed, log.info)
    ckpt_attrs = {"config": dumps_toml(cfg), "topology": str(topo.dims),
                  "lineage": json.dumps(run_lineage),
                  "data_hash": tokens.lineage.get("content_hash", ""),
                  "data_seed": t.seed, "global_batch_size": t.global_batch_size}

    tel = Telemetry(cfg, topo, run_dir, log)  # timers, MFU, stragglers, trace, watchdog
    timers, faults = tel.timers, Faults(cfg.telemetry.faults, world.rank)
    guard = NumericGuard(cfg.telemetry, lambda: (saver.restore("auto", params, optimizer)
                                                 or {}).get("path"))
    evaluator = (Evaluator(cfg, topo, chunks, params[0][1].device, log.info)
                 if t.eval_every else None)
    stops = StopRules.from_config(t, world, job.end_time)
    losses = []
    for step in range(start, t.steps):
        t0 = time.perf_counter()
        tel.begin_step(step + 1)
        with timers("data"):
            microbatches = sampler.local(step)

        # 2. Compute: forward and backward of every microbatch (the schedule).
        grads.zero()
        with timers("compute"), meter.activations():
            loss_sum = run_step(chunks, microbatches, topo, cfg,
                                optimizer.loss_scale / global_tokens, timers)
        faults.inject(step + 1, params, timers)  # tests only: kill, stall, poison, slow

        # 3. Communicate: sum gradients over the data-parallel groups, bucketed.
        with timers("grad_sync"):
            grads.reduce()

        # 4. Update: one global norm, clip, AdamW at this step's learning rate; a non-finite
        #    or spiking step skips the update (NumericGuard), repeated ones roll back.
        owner = topo.is_last_stage and topo.tp_rank == 0
        loss = world.allreduce(loss_sum if owner else 0.0) / global_tokens
        losses.append(loss)
        with timers("optimizer"):
            grad_norm = optimizer.grad_norm()  # float16: unscaled first
            lr = lr_at(step, cfg.optim, t.steps)
            if optimizer.scaler_admits(grad_norm) and guard.admit(loss, grad_norm, step + 1):
                optimizer.clip_and_step(lr, grad_norm)

        # Held-out loss every ``train.eval_every`` steps; a stop rule ends the run early.
        done = step + 1
        val_loss = evaluator.run() if evaluator and (done % t.eval_every == 0
                                                     or done == t.steps) else None
        stop = stops.check(world, val_loss, time.perf_counter() - t0) \
            or job.stop_reason(world, done, t.steps)  # SIGUSR1/SIGTERM on any rank

        # 5. Checkpoint every ``checkpoint.every`` steps, at the end and when stopping.
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or stop or (
                done == t.steps and cfg.checkpoint.save_final):
            with timers("checkpoint"):
                last_saved = saver.save(done, params, optimizer, ckpt_attrs)

        step_time = time.perf_counter() - t0
        tel.end_step({"step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      "step_time_s": step_time, **guard.metrics(),
                      **({"val_loss": val_loss} if val_loss is not None else {}),
                      **step_metrics(chunks, topo), **pipeline_metrics(topo, cfg),
                      **saver.take_metrics(), **meter.take(), **optimizer.metrics()})
        if stop:
            log.info(f"stopping at step {done}: {stop}; checkpoint {last_saved}")
            break
    tel.close()
    log.close()
    job.exit_if_stopped()  # preempted: exit 75, the job script requeues (slurm.py)
    return Result(losses, t.steps, str(last_saved) if last_saved else None)
