"""``hpctrain plan --search``: every layout of a model on a cluster, ranked (no MPI).

For a model, sequence length and global batch (the config) on ``nodes x ranks_per_node``
ranks, every combination of tp (a power of two dividing the heads), cp (context
parallelism: a power of two with ``seq_len % (2 cp) == 0``, at most ``max_cp``; ring,
Ulysses, or the hybrid with the largest Ulysses degree below cp that the heads allow
inside a node), pp, dp
(the rest; ``cp x tp x pp x ep`` must divide the world, ep is the config's), microbatch
size, schedule (1f1b, gpipe, zb-h1, zbv, dualpipev for MoE models, interleaved with 2 or 4
virtual stages), ZeRO
stage (0, 1, 2, 3) and recompute (none; full; selective, its attention core replayed and
priced in FLOPs, tried where the layout without recompute does not fit: elsewhere it is
only slower) is either

- **rejected**, with the reason: the config's own rules (``validate``: the batch does not
  split, the layers do not, a schedule does not fit the microbatch count, ZeRO-3 with
  zb-h1, zbv or recompute, cp with a capacity factor), or the memory estimate over the
  cluster's memory per rank (``plan --memory-per-rank`` replaces that); or
- **predicted** (``cost.predict``) and ranked by step time.

ZeRO at dp x cp = 1 is ZeRO 0 (one candidate, not four). Every ZeRO layout whose dp x cp
replicas span nodes is also tried as HSDP, sharded within a node (:func:`hsdp_variant`).
"""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from dataclasses import dataclass

from ..config import RECOMPUTE, Config, ConfigError, ulysses_degrees
from ..job.slurm import run_name
from ..pipeline.schedules import REGISTRY
from .cluster import Cluster
from .cost import Prediction, predict
from .hsdp import on_cluster
from .memory import estimate, fmt_bytes

SCHEDULES = tuple((k.name, v) for k in REGISTRY.values() for v in k.searched)  # (kind, v)
ZEROS = (0, 1, 2, 3)


def _chunks_free(kind: str) -> bool:
    """Whether the kind takes its chunks per rank from ``schedule.virtual_stages``."""
    return not REGISTRY[kind].chunks


@dataclass
class Candidate:
    cfg: Config
    prediction: Prediction | None = None
    reason: str = ""  # why it was rejected ("" when it fits)

    @property
    def sets(self) -> list[str]:
        """The ``--set`` arguments that choose this layout."""
        t, s, tr = self.cfg.topology, self.cfg.schedule, self.cfg.train
        out = [f"topology.dp={t.dp}", f"topology.tp={t.tp}", f"topology.pp={t.pp}"]
        out += [f"topology.ep={t.ep}"] if t.ep > 1 else []
        out += [f"topology.cp={t.cp}"] if t.cp > 1 else []
        out += [f'topology.cp_kind="{t.cp_kind}"'] if t.cp > 1 and t.cp_kind != "ring" else []
        out += [f"topology.cp_ulysses={t.cp_ulysses}"] if t.cp_ulysses else []
        out += [f'topology.shard_within="{t.shard_within}"'] if t.shard_within else []
        out += [f"train.micro_batch_size={tr.micro_batch_size}",
                f"schedule.kind={s.kind}" if t.pp > 1 else "schedule.kind=1f1b"]
        out += [f"schedule.virtual_stages={s.virtual_stages}"] if _chunks_free(s.kind) else []
        out += [f"optim.zero={self.cfg.optim.zero}",
                f"model.recompute={self.cfg.model.recompute}"]
        return out

    @property
    def full_sets(self) -> list[str]:
        """Every key the search chooses, as ``--set`` arguments, defaults included: they
        replace a layout given earlier on the same command line (``--emit-overrides``)."""
        t, s = self.cfg.topology, self.cfg.schedule
        return [f"topology.dp={t.dp}", f"topology.tp={t.tp}", f"topology.pp={t.pp}",
                f"topology.ep={t.ep}", f"topology.cp={t.cp}", f'topology.cp_kind="{t.cp_kind}"',
                f"topology.sequence_parallel={str(t.sequence_parallel).lower()}",
                f'topology.shard_within="{t.shard_within}"',
                f"train.micro_batch_size={self.cfg.train.micro_batch_size}",
                f'schedule.kind="{s.kind}"', f"schedule.virtual_stages={s.virtual_stages}",
                'schedule.boundaries=""', f"optim.zero={self.cfg.optim.zero}",
                f'model.recompute="{self.cfg.model.recompute}"']

    def label(self) -> str:
        t, s = self.cfg.topology, self.cfg.schedule
        sched = "-" if t.pp == 1 else s.kind + (f" v={s.virtual_stages}"
                                                if _chunks_free(s.kind) else "")
        shard = f" shard={t.shard_within}" if t.shard_within else ""
        cp = f"cp={t.cp}" + (f" {t.cp_kind}" if t.cp > 1 and t.cp_kind != "ring" else "")
        cp += f" {t.cp_ulysses}x{t.cp // t.cp_ulysses}" if t.cp_ulysses else ""
        return (f"dp={t.dp} tp={t.tp} pp={t.pp} ep={t.ep} {cp} {sched} "
                f"mbs={self.cfg.train.micro_batch_size} zero={self.cfg.optim.zero}{shard} "
                f"recompute={SHOWN.get(self.cfg.model.recompute, 'selective')}")

SHOWN = {"none": "off", "full": "on"}  # model.recompute in a candidate's label


CP_KINDS = ("ring", "ulysses", "hybrid")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: Config, world: int, max_tp: int = 0, max_cp: int = 0,
            cp_kinds: tuple = CP_KINDS, node_ranks: int = 0):
    """Every (tp, cp, cp kind, pp, dp, mbs, schedule, virtual, zero, recompute) for
    ``world`` ranks (cp > 1: each of ``cp_kinds``; ``node_ranks``: ranks per node, for the
    hybrid's Ulysses degree)."""
    m, T, ep = cfg.model, cfg.train.seq_len, cfg.topology.ep
    # dualpipev's F&B pairs hide expert all-to-alls; a dense model gets zbv's bubble from it
    schedules = [s for s in SCHEDULES if m.num_experts or not REGISTRY[s[0]].experts_only]
    tps = [d for d in _divisors(world) if m.n_heads % d == 0 and d & (d - 1) == 0
           and (not max_tp or d <= max_tp)]
    cps = [d for d in _divisors(world) if d & (d - 1) == 0 and T % (2 * d) == 0
           and (not max_cp or d <= max_cp)] if max_cp != 1 else [1]
    for tp, cp in itertools.product(tps, cps):
        if world % (tp * cp * ep):
            continue
        for pp, ck in itertools.product(_divisors(world // (tp * cp * ep)),
                                        _cp_choices(cfg, cp, tp, cp_kinds, node_ranks)):
            dp = world // (tp * cp * pp)
            for mbs in (1, 2, 4, 8):
                for (kind, v), zero, rc in itertools.product(
                        schedules if pp > 1 else schedules[:1], ZEROS, RECOMPUTE):
                    yield _with(cfg, (dp, tp, pp, cp, ck), mbs, kind, v, zero, rc)


def _cp_choices(cfg: Config, cp: int, tp: int, cp_kinds: tuple,
                node_ranks: int) -> list[tuple[str, int]]:
    """(cp_kind, cp_ulysses) for a cp size: each of ``cp_kinds``; the hybrid with the
    largest Ulysses degree u < cp the heads allow inside a node (``config.ulysses_degrees``;
    none when that is 1: u = 1 and u = cp are the ring and Ulysses)."""
    if cp == 1:
        return [(cfg.topology.cp_kind, 0)]
    m = cfg.model
    out = [(k, 0) for k in cp_kinds if k != "hybrid"]
    u = [d for d in ulysses_degrees(cp, tp, m.n_heads, m.kv_heads, node_ranks) if d < cp][0]
    return out + ([("hybrid", u)] if "hybrid" in cp_kinds and u > 1 else [])


def _with(cfg: Config, layout, mbs, kind, v, zero, rc) -> Config:
    r = dataclasses.replace
    dp, tp, pp, cp, (cp_kind, u) = layout
    return r(cfg, topology=r(cfg.topology, dp=dp, tp=tp, pp=pp, cp=cp, cp_kind=cp_kind,
                             cp_ulysses=u,
                             sequence_parallel=cfg.topology.sequence_parallel and tp > 1),
             train=r(cfg.train, micro_batch_size=mbs),
             schedule=r(cfg.schedule, kind=kind, virtual_stages=v, boundaries=""),
             optim=r(cfg.optim, zero=zero if dp * cp > 1 else 0),
             model=r(cfg.model, recompute=rc))


def judge(cfg: Config, cluster: Cluster, world: int) -> Candidate:
    """A candidate: rejected with its reason, or with its prediction."""
    from ..checks.validate import validate

    t = cfg.topology
    if t.dp % t.ep or (cfg.model.num_experts and cfg.model.num_experts % t.ep):
        return Candidate(cfg, reason=f"ep={t.ep} must divide dp={t.dp} and the experts")
    if cfg.train.global_batch_size % (t.dp * cfg.train.micro_batch_size):
        return Candidate(cfg, reason=(
            f"global batch {cfg.train.global_batch_size} does not split into dp={t.dp} x "
            f"micro_batch_size={cfg.train.micro_batch_size}"))
    try:
        validate(cfg, world)
    except ConfigError as e:
        lines = str(e).splitlines()
        why = [x.strip().removeprefix("- ") for x in lines[1:]] or lines
        return Candidate(cfg, reason="; ".join(why))
    need = estimate(cfg).total
    if need > cluster.memory:
        return Candidate(cfg, reason=f"needs {fmt_bytes(need)} per rank, "
                                     f"{cluster.name} has {fmt_bytes(cluster.memory)}")
    return Candidate(cfg, predict(cfg, cluster, simulated=False))


def hsdp_variant(cfg: Config, cluster: Cluster) -> list[Config]:
    """HSDP of a ZeRO layout: shards within a node of ``cluster`` (``shard_within`` its
    size), when a node holds more than one but not all of the dp x cp replicas; else []."""
    t = cfg.topology
    if not cfg.optim.zero or t.shard_within:
        return []
    try:
        c = on_cluster(dataclasses.replace(cfg, topology=dataclasses.replace(
            t, shard_within="node")), cluster)
    except ValueError:  # a node's share does not divide dp x cp
        return []
    return [c] if 1 < int(c.topology.shard_within) < t.dp * t.cp else []


def search(cfg: Config, cluster: Cluster, nodes: int, max_tp: int = 0,
           refine: int = 30, max_cp: int = 0, cp_kinds: tuple = CP_KINDS) -> list[Candidate]:
    """All candidates on ``nodes`` full nodes: fitting ones first, fastest first, then the
    rejected ones in enumeration order. Duplicates (ZeRO at dp x cp = 1) are dropped.
    Candidates are ranked by the pipeline's closed form; the best ``refine`` again with the
    simulator. ``max_cp``: the largest cp tried (0: any, 1: none); ``cp_kinds``: the
    kinds of context parallelism tried for cp > 1."""
    world = nodes * cluster.ranks_per_node
    seen, out, too_big = set(), [], set()
    for layout in layouts(cfg, world, max_tp, max_cp, cp_kinds, cluster.ranks_per_node):
        for c in (layout, *hsdp_variant(layout, cluster)):
            key = (c.topology, c.train.micro_batch_size, c.schedule.kind,
                   c.schedule.virtual_stages, c.optim.zero)
            if (*key, c.model.recompute) in seen or (
                    c.model.recompute == "selective" and key not in too_big):
                continue  # selective: only where no recompute does not fit (else slower)
            seen.add((*key, c.model.recompute))
            out.append(judge(c, cluster, world))
            if c.model.recompute == "none" and out[-1].reason.startswith("needs"):
                too_big.add(key)
    fits = sorted((c for c in out if c.prediction), key=lambda c: c.prediction.step_s)
    for c in fits[:refine]:
        c.prediction = predict(c.cfg, cluster)
    fits[:refine] = sorted(fits[:refine], key=lambda c: c.prediction.step_s)
    return fits + [c for c in out if not c.prediction]


def best_for(cfg: Config, cluster: Cluster, nodes: int) -> Candidate:
    """The fastest layout of ``cfg``'s model, sequence and global batch on ``nodes`` nodes of
    ``cluster``; ValueError naming the most common reasons when none fits."""
    cands = search(cfg, cluster, nodes)
    if cands and cands[0].prediction:
        return cands[0]
    world = nodes * cluster.ranks_per_node
    groups: dict[str, int] = {}
    for c in cands:
        groups[_rule(c.reason)] = groups.get(_rule(c.reason), 0) + 1
    why = "; ".join(f"{n} x {rule}" for rule, n in sorted(groups.items(), key=lambda kv: -kv[1]))
    raise ValueError(f"no layout of {world} rank(s) fits this model with global batch "
                     f"{cfg.train.global_batch_size}: {why or 'no candidate'}; give it more "
                     "ranks, or change train.global_batch_size or the model")


def slurm_line(c: Candidate, nodes: int, cluster: Cluster, config: str,
               overrides: list[str] = ()) -> str:
    """The ``sbatch`` line that trains this layout: the nodes, one task per rank (and per GPU
    on a ``device = "cuda"`` cluster, with ``jobs/gpu.sbatch``), then the config, the user's
    ``overrides`` (``--set`` values, in order), the layout's and the device as arguments
    (they reach the job where ``SBATCH_EXPORT=NONE``), and the run's name (the config's stem:
    the run directory, which a resubmission continues). ``hpctrain submit`` in place of
    ``sbatch`` checks the job first."""
    rpn, gpu = cluster.ranks_per_node, cluster.device == "cuda"
    opts = [f"--nodes={nodes}", f"--ntasks-per-node={rpn}"]
    opts += [f"--gpus-per-node={rpn}"] if gpu else []
    sets = [*overrides, *c.sets, f"model.device={cluster.device}"]
    words = ["sbatch", *opts, "jobs/gpu.sbatch" if gpu else "jobs/multi-node.sbatch", config,
             "--run-name", run_name(config)]
    words += [w for kv in sets for w in ("--set", kv)]
    return " ".join(shlex.quote(w) for w in words)


def set_line(sets: list[str]) -> str:
    """``--set`` arguments as a shell reads them back: each value quoted where needed."""
    return " ".join(f"--set {shlex.quote(x)}" for x in sets)


def report(cands: list[Candidate], top: int = 10, rejected: int = 20,
           sets: bool = False) -> list[str]:
    """The ranked table (``sets``: each with its ``--set`` line), then the rejected layouts
    with their reasons."""
    fits = [c for c in cands if c.prediction]
    bad = [c for c in cands if not c.prediction]
    lines = [f"{len(cands)} layouts: {len(fits)} fit, {len(bad)} rejected"]
    for i, c in enumerate(fits[:top], 1):
        p = c.prediction
        lines.append(f"{i:3d}. {c.label():<62} step {p.step_s:.4g} s, "
                     f"{p.tokens_per_s_per_rank:,.0f} tok/s/rank, MFU {100 * p.mfu:.1f}%, "
                     f"bubble {100 * p.bubble:.1f}%, memory {fmt_bytes(p.memory.total)}")
        if sets:
            lines.append("       " + set_line(c.sets))
    groups: dict[str, list[Candidate]] = {}
    for c in bad:  # by the reason's rule, its numbers left out
        groups.setdefault(_rule(c.reason), []).append(c)
    for rule, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"rejected {len(members)}: {rule}, e.g.")
        lines += [f"    {c.label()}: {c.reason}" for c in members[:max(1, rejected)]]
    return lines


def _rule(reason: str) -> str:
    if reason.startswith("needs "):
        return "does not fit in memory"
    if reason.startswith("global batch"):
        return "the global batch does not split into dp x micro_batch_size"
    return reason.split(":")[0].split("=")[0].strip() or reason


