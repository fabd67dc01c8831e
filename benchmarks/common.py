"""What the benchmarks share: statistics, the training configs per size, one hpctrain
training run, the same training as a plain PyTorch loop (optionally under DDP), and
``torch.distributed`` (gloo) started inside mpirun ranks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hpctrain.config import load

# Training benchmarks (ddp, pipeline, overhead): float32 GPT, same preset on both sides.
TRAIN_PRESETS = {
    "tiny": ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "train.steps=3",
             "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=16",
             "optim.bucket_mb=0.05"],
    "small": ["model.n_layers=4", "model.d_model=128", "model.n_heads=4", "train.steps=5",
              "train.global_batch_size=16", "train.micro_batch_size=4", "train.seq_len=128",
              "optim.bucket_mb=1.0"],
}
COMMON = ['model.dtype="float32"', "model.vocab_size=256", "data.corpus_mb=0.5",
          "optim.warmup_steps=2", "checkpoint.save_final=false", "train.log_every=1000",
          "telemetry.peak_flops=1e11"]  # a fixed MFU denominator (MFU is not compared)


def in_fresh_process(code: str, args: list[str], env: dict | None = None,
                     cwd=None) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``python -c code ARGS`` alone (the checkout on its path, no SLURM job or MPI
    launch inherited; ``env`` added) and return it with its peak RSS in MiB: its own VmHWM,
    printed after ``code`` (a child's ``ru_maxrss`` starts at its parent's at exec). ``code``
    leaves its exit status in ``rc``; a process that fails raises."""
    from hpctrain.job.launch import with_checkout, without_job

    peak = ('\ntry:\n    print("VmHWM", [int(x.split()[1]) for x in open("/proc/self/status")'
            ' if x.startswith("VmHWM")][0])\nexcept OSError:  # no /proc: the best there is\n'
            '    import resource\n'
            '    print("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n'
            'sys.exit(rc)\n')
    proc = subprocess.run([sys.executable, "-c", "import sys\nrc = 0\n" + code + peak, *args],
                          capture_output=True, text=True, cwd=cwd,
                          env=with_checkout({**without_job(dict(os.environ)), **(env or {})}))
    if proc.returncode != 0:
        raise RuntimeError(f"{args[:2]} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    peak_kib = [int(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("VmHWM")]
    return proc, peak_kib[-1] / 1024


def median(xs) -> float:
    return float(statistics.median(xs))


def train_config(size: str, *overrides: str):
    """The Config of a training benchmark: the size preset plus layout overrides."""
    return load(None, [*COMMON, *TRAIN_PRESETS[size], *overrides])


def max_over_ranks(world, seconds: float) -> float:
    """The slowest rank's time (a step ends when its last rank does). Collective."""
    return world.allreduce(seconds, "max")


def result(name: str, world, size: str, repeats: int, what: str) -> dict:
    return {"bench": name, "ranks": world.size, "size": size, "repeats": repeats,
            "what": what, "rows": [], "ratios": [], "check": None, "notes": []}


def row(variant: str, samples: list[float], unit: str = "s") -> dict:
    return {"variant": variant, "median": median(samples), "unit": unit,
            "samples": [float(s) for s in samples]}


PAIRS = 5  # at least this many interleaved A/B pairs behind every ratio


def pairs_of(repeats: int, size: str) -> int:
    """How many interleaved A/B pairs a benchmark runs: ``repeats``, at least :data:`PAIRS`
    for a measurement; the ``tiny`` smoke test (seconds, no figures) runs ``repeats``."""
    return repeats if size == "tiny" else max(PAIRS, repeats)


def loadavg() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (recorded before and after a part)."""
    return [round(x, 2) for x in os.getloadavg()]


def ratio(name: str, value: float, target: str, pairs: list[float] | None = None) -> dict:
    """A comparison against its target. With ``pairs`` (one ratio per interleaved A/B pair,
    numerator and denominator measured back to back) the value is their median, ``spread``
    their [min, max], and ``noise`` says that the spread covers 1.0 (the two sides are not
    told apart by this run); without, the ratio of medians, no spread."""
    out = {"name": name, "target": target}
    if pairs:
        value = median(pairs)
        lo, hi = float(min(pairs)), float(max(pairs))
        out.update(spread=[lo, hi], pairs=len(pairs), noise=bool(lo <= 1.0 <= hi))
    op, bound = target.split()
    met = value >= float(bound) if op == ">=" else value <= float(bound)
    out.update(value=float(value), ratio=float(value), met=bool(met))
    return out


def pair_ratios(num: list[float], den: list[float], offset: float = 0.0) -> list[float]:
    """Per-pair ratios ``num[i] / den[i] + offset`` of two interleaved sample lists."""
    return [a / b + offset for a, b in zip(num, den)]


def bound_without(ours: list[float], theirs: list[float], cost: list[float], q: dict,
                  what: str) -> str:
    """The measured reason for comparison ``q`` (throughput hpctrain / a peer = theirs /
    ours, pair by pair): the ratio hpctrain would reach with ``cost`` (seconds of each of its
    samples: exposed communication, waits) gone. Below ``q``'s target it is compute-bound;
    above, ``cost`` is what keeps it from the target. ``what`` opens the sentence with the
    cost's name; the pair's medians follow."""
    bound = median([t / (o - c) for t, o, c in zip(theirs, ours, cost)])
    limit = float(q["target"].split()[1])
    head = (f"{what} {median(cost) * 1e3:.1f} ms of a {median(ours) * 1e3:.0f} ms step; with "
            f"none at all it would be {bound:.3g}x")
    if bound < limit:
        return f"compute-bound: {head}, below {limit:g}"
    return f"{head}: that is what keeps it from {limit:g}"


def interleaved(variants: dict, pairs: int) -> dict[str, list]:
    """Run every variant (name -> callable returning one sample) ``pairs`` times, order
    reversed every other round (ABBA...), so drifts of the machine hit every side alike;
    returns name -> samples. Collective when the callables are."""
    names = list(variants)
    samples: dict[str, list] = {n: [] for n in names}
    for r in range(pairs):
        for n in names if r % 2 == 0 else names[::-1]:
            samples[n].append(variants[n]())
    return samples


def same_losses(values: dict[str, list[float]], tol: float = 1e-4) -> dict:
    """Check that every side's per-step losses agree with the first side's."""
    names = list(values)
    ref = np.asarray(values[names[0]], dtype=np.float64)
    err = 0.0
    for n in names[1:]:
        v = np.asarray(values[n], dtype=np.float64)
        if v.shape != ref.shape:
            err = float("inf")
            break
        err = max(err, float(np.max(np.abs(v - ref)) / max(np.max(np.abs(ref)), 1e-300)))
    return {"what": "per-step losses", "values": {n: [float(x) for x in values[n]]
                                                  for n in names},
            "rel_err": err, "tol": tol, "ok": bool(err <= tol)}


# -- hpctrain's side: the real training loop --------------------------------------------------
@contextlib.contextmanager
def scratch_dir(world):
    """A run directory shared by the ranks of ``world``, removed afterwards. Collective."""
    scratch = world.bcast_obj(tempfile.mkdtemp(prefix="hpctrain-bench-") if world.rank == 0
                              else None)
    try:
        yield scratch
    finally:
        world.barrier()
        if world.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)


def hpctrain_run(cfg, world, extra: dict | None = None) -> tuple[list[float], list[float]]:
    """Train with ``hpctrain.train.train`` (what ``hpctrain train`` runs) in a scratch run
    directory; returns (step seconds, losses) from rank 0's metrics.jsonl, on every rank.
    ``extra``: its keys are metrics.jsonl fields, filled with their per-step values.
    Collective over ``world``."""
    rows, losses = hpctrain_steps(cfg, world)
    if extra is not None:
        extra.update({k: [r.get(k) for r in rows] for k in extra})
    return [r["step_time_s"] for r in rows], losses


def hpctrain_steps(cfg, world) -> tuple[list[dict], list[float]]:
    """:func:`hpctrain_run` with every row of rank 0's metrics.jsonl (the step's time per
    phase, ``time_s``, among them) instead of the step times alone. Collective."""
    from hpctrain.train import train

    rows = None
    with scratch_dir(world) as scratch:
        res = train(cfg, scratch, world)
        if world.rank == 0:
            lines = (Path(scratch) / "metrics.jsonl").read_text().splitlines()
            rows = [json.loads(line) for line in lines]
    return world.bcast_obj(rows), list(res.losses)


def exposed_comm_s(row: dict) -> float:
    """A metrics row's communication the step waited for: every ``comm_*`` phase (MPI calls
    outside overlap, per axis) and ``grad_sync`` (packing buckets)."""
    t = row.get("time_s", {})
    return sum(v for k, v in t.items() if k.startswith("comm_") or k == "grad_sync")


# -- PyTorch's side ---------------------------------------------------------------------------
def torch_optimizer(params, ocfg) -> torch.optim.AdamW:
    """torch.optim.AdamW with hpctrain's convention: weight decay on matrices only."""
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": ocfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps)


def local_model(cfg):
    """The whole model as one DecoderStage with LocalOps (plain PyTorch), hpctrain's init."""
    from hpctrain.model import DecoderStage, init_parameters

    stage = DecoderStage(cfg.model, range(cfg.model.n_layers), first=True, last=True)
    init_parameters([stage], cfg.train.seed)
    return stage


def _accumulating(model, sync: bool):
    """The context of a microbatch's backward: gradients reduced only when ``sync`` (DDP's
    ``no_sync`` otherwise; FSDP2's ``set_requires_gradient_sync``)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else model.no_sync()


def torch_loop(cfg, world=None, wrap=None) -> tuple[list[float], list[float]]:
    """The same training as ``hpctrain train`` written as a plain PyTorch loop: torch AdamW,
    ``clip_grad_norm_``, gradient accumulation over microbatches. With ``world`` (size > 1)
    the model is wrapped by ``wrap(stage)``, by default in DistributedDataParallel (gloo,
    started by :func:`torch_dist`; DDP and FSDP2 both average over ranks), and each rank
    takes its dp slice of the same global batch. Returns (step s, losses)."""
    import torch.distributed as dist

    from hpctrain.data.dataset import Sampler, load_tokens
    from hpctrain.optim import lr_at

    t, o = cfg.train, cfg.optim
    dp, rank = (world.size, world.rank) if world is not None else (1, 0)
    model = stage = local_model(cfg)
    if dp > 1:
        model = wrap(stage) if wrap is not None else \
            torch.nn.parallel.DistributedDataParallel(stage, bucket_cap_mb=o.bucket_mb)
    params = list(model.parameters())  # after wrapping: FSDP2 swaps in sharded ones
    opt = torch_optimizer(params, o)
    tokens = load_tokens(cfg.data.path, "train", cfg.data.corpus_mb, cfg.data.val_fraction)
    sampler = Sampler(tokens.tokens, t.seq_len, t.global_batch_size, t.micro_batch_size,
                      dp, rank, t.seed)
    global_tokens = t.global_batch_size * t.seq_len
    scale = dp / global_tokens  # DDP averages over ranks; hpctrain sums 1/global_tokens
    times, losses = [], []
    for step in range(t.steps):
        t0 = time.perf_counter()
        mbs = sampler.local(step)
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for j, (x, y) in enumerate(mbs):
            sync = dp == 1 or j == len(mbs) - 1
            with _accumulating(model, sync):
                loss = model(x, y)
                (loss * scale).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o, t.steps)
        opt.step()
        if dp > 1:
            buf = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(buf)
            total = float(buf[0])
        losses.append(total / global_tokens)
        times.append(time.perf_counter() - t0)
    return times, losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_dist(world):
    """Start ``torch.distributed`` (gloo) on the ranks of this mpirun: rank and size from
    the MPI world, MASTER_ADDR=127.0.0.1 and a free port chosen by rank 0. Idempotent.
    Collective over ``world``."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist
    port = world.bcast_obj(_free_port() if world.rank == 0 else None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="env://", rank=world.rank,
                            world_size=world.size)
    return dist


def steady(times: list[float]) -> list[float]:
    """Step times without the first (warm-up: allocation, lazy init)."""
    return times[1:] if len(times) > 1 else times
