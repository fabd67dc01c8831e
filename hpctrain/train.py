"""The training loop. One step, top to bottom:

    1. partition   the Topology (grid + communicators) and this rank's model pieces
    2. compute     forward/backward of this rank's microbatches (the schedule runner)
    3. communicate gradients summed over data-parallel groups, in buckets
    4. update      global grad norm (each parameter counted once), clip, AdamW
    5. checkpoint  one parallel-HDF5 file, whole or absent

then held-out evaluation and the stop rules. ``train(cfg, run_dir)`` is importable;
``hpctrain train`` calls it on every rank. :func:`setup` builds everything one rank holds,
:func:`train_step` is stages 2-4, :func:`end_of_step` evaluates, checkpoints and records.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import comm
from .checkpoint import Checkpoints, lineage
from .checks.validate import settled, validate
from .comm import gpu
from .config import Config, dumps_toml
from .data.blend import open_stream
from .data.sampler import ReadAhead, Sampler
from .evaluate import Evaluator
from .interchange import init_from
from .job import slurm
from .job.launch import LAUNCHED_AT
from .optim import NumericGuard, build_optimizer, lr_at
from .parallel import build_model, grad_sync, named_parameters
from .parallel.moe_exchange import MoeStep
from .pipeline.runner import pipeline_metrics, run_step
from .planner.cluster import mfu_peak
from .planner.flops import train_flops_per_token
from .stopping import StopRules
from .telemetry import Faults, Meter, RunLog, Telemetry
from .telemetry.startup import Startup, report
from .telemetry.summary import RunSummary
from .topology import Topology


@dataclass
class Result:
    losses: list[float]
    final_step: int
    checkpoint: str | None


@dataclass
class Trainer:
    """Everything one rank holds for a run, built whole by :func:`setup`."""

    cfg: Config
    topo: Topology
    log: RunLog
    job: slurm.Job
    chunks: list  # this rank's model pieces, one per (virtual) pipeline stage
    params: list  # [(global name, parameter)]
    saved: list  # what a checkpoint holds: params, then the MoE hook's state (no grad)
    moe: MoeStep  # the MoE side of a step (nothing on dense models)
    grads: grad_sync.GradSync  # the strategy chosen for this config
    optimizer: object  # AdamW or ZeroAdamW
    sampler: Sampler
    batches: ReadAhead  # the sampler's batches, the next step's read in a thread
    global_tokens: int
    meter: Meter  # measured bytes: metrics mem_*
    ckpts: Checkpoints  # the HDF5 file and the node-local tier
    start: int  # steps already done (resumed), else 0
    ckpt_attrs: dict  # what every checkpoint of this run records
    tel: Telemetry  # timers, MFU, stragglers, trace, watchdog
    guard: NumericGuard  # bad steps skipped, then rolled back or stopped
    evaluator: Evaluator | None  # None: train.eval_every = 0
    stops: StopRules
    faults: Faults  # tests only
    startup: Startup  # the start-up phases, reported after the first step
    losses: list = field(default_factory=list)
    pipeline_timing: dict = field(default_factory=dict)  # this rank's last step (runner)


def setup_run_dir(run_dir: Path, topo) -> Path:
    """Rank 0 creates the run directory (the resolved config is written once the run is
    accepted: :func:`restore`)."""
    if topo.world.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    topo.world.barrier()
    return run_dir


def setup(cfg: Config, run_dir: Path, world, startup: Startup | None = None) -> Trainer:
    """1. Partition: the grid, this rank's model chunks, gradient buckets, optimizer (ZeRO
    0/1/2/3) and its slice of every batch; then restore, telemetry, the numeric guard,
    evaluation and stop rules; ``startup`` marks the end of each phase. Collective over the
    world."""
    startup = startup or Startup()
    topo = Topology(cfg.topology, world, placement=cfg.experimental.placement)
    run_dir = setup_run_dir(Path(run_dir), topo)
    log = RunLog(run_dir, topo, cfg.train.steps, cfg.train.log_every)
    log.info(f"MPI: {comm.library()}")  # the first line: which MPI this run found
    job = slurm.attach(topo.world, log.info)  # log the SLURM job; SIGUSR1/SIGTERM set a flag
    startup.mark("topology")
    chunks = build_model(cfg, topo)
    params = named_parameters(chunks)
    moe = MoeStep(chunks, topo)
    saved = params + moe.state
    if cfg.checkpoint.init_from:  # parameters from another model; a resume overrides them
        source = init_from.load(cfg, topo, params, moe.state)
        log.info(f"parameters from {source} (checkpoint.init_from)")
    grads = grad_sync.build(cfg, topo, chunks, params)  # ZeRO-3 shards the parameters here
    if grads.overlap:
        log.info(f"gradient reduction overlapped with backward (progress: {grads.progress})")
    optimizer = build_optimizer(params, cfg.optim, topo, grads, cfg.model.dtype)
    startup.mark("model")
    d, t = cfg.data, cfg.train
    device = params[0][1].device
    sampler, data_lineage = open_data(cfg, topo, log, params)
    startup.mark("data")
    if topo.hsdp:  # topology.shard_within
        shard, replica = topo.hsdp["dp"]
        log.info(f"HSDP: ZeRO-{cfg.optim.zero} state sharded over {shard.size} ranks "
                 f"(shard_within={cfg.topology.shard_within!r}), {replica.size} replicas")
    if cfg.model.device == "cuda":
        log.info(f"device {device}; {gpu.describe()}")
    meter = Meter(params, grads, optimizer, cfg.telemetry.activations_every)
    ckpts = Checkpoints(cfg.checkpoint, topo, Path(cfg.checkpoint.dir or run_dir / "checkpoints"),
                        t.steps, info=log.info, warn=log.warn, model=cfg.model)
    start, ckpt_attrs = restore(cfg, topo, log, ckpts, saved, optimizer, data_lineage,
                                run_dir)
    startup.mark("restore")
    tc = cfg.telemetry  # MFU's denominator: a nominal peak (checked by hpctrain train)
    tel = Telemetry(cfg, topo, run_dir, log, mfu_peak(tc.peak_flops, tc.cluster, cfg.model.dtype),
                    json.loads(ckpt_attrs["lineage"]),
                    flops_per_token=train_flops_per_token(cfg.model, cfg.train.seq_len))
    if tel.watchdog:  # a background write that hangs is reported, although steps go on
        ckpts.watch(tel.watchdog)
    guard = NumericGuard(cfg.telemetry, functools.partial(ckpts.roll_back, saved, optimizer))
    evaluator = (Evaluator(cfg, topo, chunks, device, log.info) if t.eval_every else None)
    stops = StopRules.from_config(t, topo.world, job.end_time)
    faults = Faults(cfg.experimental.faults, topo.world.rank)
    startup.mark("telemetry")  # the matmul probe, mostly
    return Trainer(cfg, topo, log, job, chunks, params, saved, moe, grads, optimizer, sampler,
                   ReadAhead(sampler, d.prefetch), t.global_batch_size * t.seq_len, meter,
                   ckpts, start, ckpt_attrs, tel, guard, evaluator, stops, faults, startup)


def open_data(cfg: Config, topo, log, params) -> tuple[Sampler, dict]:
    """This rank's training stream and its lineage; logs the run's shape."""
    d, t = cfg.data, cfg.train
    sampler, data_lineage = open_stream(d, "train", t.seq_len, t.global_batch_size,
                                        t.micro_batch_size, topo.dp_size, topo.dp_rank, t.seed,
                                        params[0][1].device, topo.cp_size, topo.cp_rank,
                                        cfg.model.mtp_depth)
    log.info(f"{topo.world_size} ranks, grid (pp, dp_outer, ep, cp, tp) = {topo.dims}, "
             f"{sampler.microbatches} microbatches of {t.micro_batch_size} per rank, "
             f"{sum(p.numel() for _, p in params):,} parameters on rank 0, "
             f"data: {data_lineage.get('source')} "
             f"({' + '.join(f'{n:,}' for n in sampler.epoch_sizes())} samples per epoch)")
    return sampler, data_lineage


def restore(cfg: Config, topo, log, ckpts, params, optimizer, data_lineage: dict,
            run_dir: Path) -> tuple[int, dict]:
    """5 (restore). Continue from a checkpoint if asked (a damaged one falls back to the one
    before; with the local tier, from the freshest complete tier); the data stream follows
    the step. Records the run's lineage, then sets aside
    the checkpoints and metrics records of an abandoned trajectory. A checkpoint this
    run cannot continue (another model's shapes, a missing tensor; another data content hash,
    data seed, global batch size or seq_len unless ``data.allow_changed``) raises a LineageError
    alike on every rank, before any step. Returns (steps already done, the attributes every
    checkpoint of this run records). Collective."""
    resumed = ckpts.restore(cfg.checkpoint.resume, params, optimizer)
    start = int(resumed["step"]) if resumed is not None else 0
    run_lineage = lineage.start(run_dir, cfg, topo, data_lineage, resumed, log.info)
    if resumed is not None:  # accepted (lineage.start refuses another sample stream)
        log.info(f"resumed from {resumed['path']} at step {start}")
        if start >= cfg.train.steps:  # a finished run submitted again
            log.info(f"nothing to train: step {start} of train.steps={cfg.train.steps} is "
                     "done; raise train.steps to go on, or use another --run-dir")
    folder, set_aside = ckpts.take_over(resumed, start)  # nothing earlier is overwritten
    if set_aside:
        log.info(set_aside)
    log.continue_at(start, folder)  # metrics.jsonl: one trajectory
    if topo.world.rank == 0:  # accepted: a refused resume leaves the earlier config
        (run_dir / "config.toml").write_text(dumps_toml(cfg))
    attrs = {"config": dumps_toml(cfg), "topology": str(topo.dims),
             "lineage": json.dumps(run_lineage),
             "data_hash": data_lineage.get("content_hash", ""),
             "data_seed": cfg.train.seed,
             "global_batch_size": cfg.train.global_batch_size,
             "seq_len": cfg.train.seq_len,
             "decay_steps": run_lineage["decay_steps"]}  # the lr schedule's horizon
    return start, attrs


def train_step(tr: Trainer, step: int) -> dict:
    """Stages 2-4 of step ``step`` (counted from 0); returns the step's record."""
    cfg, topo, timers, optimizer, guard = tr.cfg, tr.topo, tr.tel.timers, tr.optimizer, tr.guard
    t_data = time.perf_counter()
    with timers("data"):  # waits for the read-ahead (none: reads here), then to the device
        microbatches = tr.batches.get(step)
    data_s = time.perf_counter() - t_data

    # 2. Compute: forward and backward of every microbatch (the schedule). The token loss
    #    and the MoE auxiliary losses get the same factor, float16's loss scale included:
    #    every gradient is divided by that scale before the norm (optimizer.grad_norm).
    tr.grads.zero()
    scale = optimizer.loss_scale / tr.global_tokens
    with timers("compute"), tr.meter.step(step + 1):
        loss_sum, tr.pipeline_timing = run_step(tr.chunks, microbatches, topo, cfg, scale,
                                                timers, tr.grads.sharded)
    tr.faults.inject(step + 1, tr.params, timers)  # tests only: kill, stall, poison, slow

    # 3. Communicate: sum gradients over the data-parallel groups, bucketed.
    with timers("grad_sync"):
        tr.grads.reduce()

    # 4. Update: one global norm, clip, AdamW at this step's learning rate; a non-finite or
    #    spiking step skips the update (NumericGuard), repeated ones roll back.
    owner = any(c.last for c in tr.chunks) and topo.tp_rank == 0  # zbv: pp rank 0
    loss = topo.world.allreduce(loss_sum if owner else 0.0) / tr.global_tokens
    tr.losses.append(loss)
    with timers("optimizer"):
        grad_norm = optimizer.grad_norm()  # float16: unscaled first
        lr = lr_at(step, cfg.optim, tr.ckpt_attrs["decay_steps"])  # a resume keeps it
        applied = optimizer.scaler_admits(grad_norm) and guard.admit(loss, grad_norm, step + 1)
        if applied:
            optimizer.clip_and_step(lr, grad_norm)
        tr.moe.after_update(applied)  # aux-loss-free balancing follows the load
    return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "data_s": data_s, **guard.metrics()}


def end_of_step(tr: Trainer, record: dict, t0: float) -> str | None:
    """Held-out loss every ``train.eval_every`` steps, the stop rules, the checkpoint (every
    ``checkpoint.every`` steps, at the end and when stopping) and the metrics record.
    Returns the reason to stop, or None. Collective over the world."""
    cfg, t, done, timers = tr.cfg, tr.cfg.train, record["step"], tr.tel.timers
    if tr.evaluator and (done % t.eval_every == 0 or done == t.steps):
        with timers("eval"):
            record.update(tr.evaluator.run())  # val_loss, and val_loss/NAME per source
    stop = tr.stops.check(tr.topo.world, record.get("val_loss"), time.perf_counter() - t0) \
        or tr.job.stop_reason(tr.topo.world, done, t.steps)  # SIGUSR1/SIGTERM on any rank

    # 5. Checkpoint. With checkpoint.async the step only copies its pieces and the file is
    #    written in the background; a failure there is raised here, on every rank, one step
    #    later. A stop and the last step wait until the file is committed.
    tr.ckpts.after_step(done, tr.saved, tr.optimizer,
                        lambda: {**tr.ckpt_attrs, **tr.sampler.position(done)},
                        stop=bool(stop), timers=timers)

    logged = tr.tel.logs(done)  # the metrics ranks exchange: on logging steps only
    tr.tel.end_step({**record, "step_time_s": time.perf_counter() - t0,
                     **tr.moe.metrics(logged),
                     **pipeline_metrics(tr.topo, cfg, tr.pipeline_timing, logged),
                     **tr.ckpts.take_metrics(), **tr.meter.take(), **tr.optimizer.metrics()})
    if stop:
        tr.log.info(f"stopping at step {done}: {stop}; checkpoint {tr.ckpts.last_saved}")
    return stop


def train(cfg: Config, run_dir: str | Path, world=None) -> Result:
    world = world if world is not None else comm.world()
    validate(cfg, world.size)  # before any collective: every rank fails alike
    cfg = settled(cfg)  # recorded with its model family named
    t_run = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    launched = os.environ.get(LAUNCHED_AT)
    startup = Startup(float(launched) if launched else None)
    startup.mark("entry")
    tr = setup(cfg, Path(run_dir), world, startup)
    summary = RunSummary(tr.start, tr.global_tokens, tr.ckpts.recovery)
    stop = (f"finished: train.steps={cfg.train.steps} reached" if tr.start < cfg.train.steps
            else f"nothing to train: step {tr.start} of train.steps={cfg.train.steps} is done")
    for step in range(tr.start, cfg.train.steps):
        t0 = time.perf_counter()
        tr.tel.begin_step(step + 1)
        record = train_step(tr, step)
        if step == tr.start:  # start-up ends with the first step
            startup.mark("first_step")
        if startup.marks and tr.tel.logs(step + 1):  # exchanged on a logging step only
            record["startup_s"], line = report(tr.topo.world.allgather_obj(startup.phases()))
            tr.log.info(line)
            startup.marks = []
        reason = end_of_step(tr, record, t0)
        summary.add(record)
        if reason:
            stop = reason
            break
    tr.ckpts.wait()  # no save left in flight
    tr.batches.close()  # the read-ahead thread
    tr.grads.close()  # the overlap's progress thread
    tr.tel.close()
    last = str(tr.ckpts.last_saved) if tr.ckpts.last_saved else None
    summary.finish(tr.log, Path(run_dir), stop, last, time.perf_counter() - t_run)
    tr.log.close()
    tr.job.exit_if_stopped()  # preempted: exit 75, the job script requeues (slurm.py)
    return Result(tr.losses, cfg.train.steps, last)
