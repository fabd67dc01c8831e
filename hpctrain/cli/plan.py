"""``hpctrain plan CONFIG --world-size N [--set section.key=value ...]``: what it prints and
its modes are :data:`DESCRIPTION` (``hpctrain plan --help``)."""

from __future__ import annotations

import dataclasses
import sys

DESCRIPTION = """\
Predict a layout's memory per rank and step time, and search layouts, before an allocation:
one process, no MPI, no model built. Prints the layout (its world size from the config's
topology.pp x dp x cp x tp unless --world-size is given), the pipeline partition, every pp
rank's schedule with its simulated bubble, the memory per rank (--memory-per-rank: whether
it fits) and, with --nodes, which axes cross the inter-node link.

  --cluster NAME|PATH   step time, its parts, tokens/s and MFU on that cluster
  --search              the fastest layouts on --nodes nodes of --cluster, and
                        why the others were rejected
  --emit-overrides      only the best layout for --world-size ranks (same
                        model, sequence and global batch), one `--set K=V` a
                        line, for a script that relaunches on the ranks left;
                        exit 2 when none fits
  --calibrate OUT.toml  measure this machine (under mpirun) and write a cluster
                        description
  --published           published runs against the model

The config keys: docs/config.md; the modes and how to read them:
docs/planning.md."""

EPILOG = """\
examples:
  hpctrain plan share/configs/demo.toml --set topology.dp=2 --set topology.pp=2
  hpctrain plan share/configs/demo.toml --cluster dgx-a100 --nodes 2 \\
      --set topology.dp=8
  hpctrain plan share/configs/demo.toml --search --cluster dgx-a100 --nodes 8
The clusters --cluster names: share/clusters/*.toml."""


def add_arguments(p) -> None:
    p.description, p.epilog = DESCRIPTION, EPILOG
    p.add_argument("config", nargs="?", default=None,
                   help="TOML preset, e.g. share/configs/demo.toml (default: none; needed "
                        "except with --published)")
    p.add_argument("--world-size", type=int, default=None,
                   help="number of ranks to plan for (default: the product of the config's "
                        "topology.pp, dp, cp and tp; --search: nodes x ranks per node)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one config key, repeatable")
    p.add_argument("--costs", default="F=1,B=1,W=1", metavar="F=1,B=1,W=1",
                   help="relative cost of a stage's forward, input-gradient and weight-"
                        "gradient pass for the simulation (an unsplit backward costs B+W)")
    p.add_argument("--memory-per-rank", default="", metavar="BYTES",
                   help="memory available per rank, e.g. 80GiB: warn when the estimate "
                        "does not fit (--search: list the layouts that fit it, with their "
                        "--set lines; default: no limit)")
    p.add_argument("--nodes", type=int, default=0,
                   help="nodes the ranks are packed on: show which axes cross the link (default: "
                        "not shown)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="ranks per node (default: world size / --nodes)")
    p.add_argument("--cluster", default="", metavar="NAME|PATH",
                   help="cluster description (share/clusters/NAME.toml or a file): predict "
                        "the step time, tokens/s and MFU (default: none, no prediction)")
    p.add_argument("--search", action="store_true",
                   help="rank every layout on --nodes nodes of --cluster by predicted step "
                        "time (with the reason each rejected one was rejected)")
    p.add_argument("--emit-overrides", action="store_true",
                   help="print only the best layout for --world-size ranks (on --nodes nodes, "
                        f"default 1, of --cluster, default {EMIT_CLUSTER}) as --set lines")
    p.add_argument("--top", type=int, default=10, help="--search: layouts shown")
    p.add_argument("--calibrate", default="", metavar="OUT.toml",
                   help="measure this machine (run under mpirun) and write a description "
                        "(default: not measured)")
    p.add_argument("--published", action="store_true",
                   help="published runs (Megatron-LM, torchtitan) against the model")
    p.add_argument("--schedules", action="store_true",
                   help="print each pp rank's action list too (default: its stages and "
                        "bubble only)")
    p.add_argument("--width", type=int, default=100,
                   help="--schedules: wrap each rank's action list at this many columns; 0: "
                        "no wrap")


EMIT_CLUSTER = "cpu-epyc-7763"  # --emit-overrides without --cluster


def emit_overrides(args) -> int:
    """``--emit-overrides``: the best layout for ``--world-size`` ranks, one ``--set`` a line."""
    from ..config import load
    from ..planner import search
    from ..planner.memory import parse_bytes

    nodes = args.nodes or 1
    world = args.world_size or nodes * args.ranks_per_node
    rpn = args.ranks_per_node or world // nodes
    if world < 1 or nodes * rpn != world:
        raise ValueError(f"--emit-overrides: --world-size {args.world_size} is not --nodes "
                         f"{nodes} x --ranks-per-node {rpn}; give --world-size N (and "
                         "--nodes K when N ranks are on K nodes)")
    cluster = dataclasses.replace(_cluster(args.cluster or EMIT_CLUSTER), ranks_per_node=rpn)
    if args.memory_per_rank:
        cluster = dataclasses.replace(cluster, memory=parse_bytes(args.memory_per_rank))
    best = search.best_for(load(args.config, args.overrides), cluster, nodes)
    print("\n".join(f"--set {x}" for x in best.full_sets))
    return 0


def _costs(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in ("F", "B", "W") or not value:
            raise ValueError(f"--costs {text!r}: expected e.g. F=1,B=1,W=1")
        out[key.strip()] = float(value)
    return out


def _wrap(text: str, width: int, indent: str) -> list[str]:
    if width <= 0:
        return [indent + text]
    lines, line = [], ""
    for word in text.split():
        if line and len(indent) + len(line) + 1 + len(word) > width:
            lines.append(indent + line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [indent + line]


SIMULATED_MAX = 256  # microbatches x virtual stages per rank; the simulation grows as its square


def schedule_section(cfg, width: int = 100, costs=None) -> list[str]:
    """The pipeline part of the plan: partition, per-rank actions (``width`` < 0: none),
    simulated bubble (above ``SIMULATED_MAX`` chunk-microbatches per rank: the partition and
    the 1F1B reference)."""
    from ..config import microbatches
    from ..pipeline.schedules import from_config, layer_ranges, style_of, virtual_stages
    from ..pipeline.simulate import simulate

    top, s = cfg.topology, cfg.schedule
    m, p = microbatches(cfg), top.pp
    v, style = virtual_stages(cfg), style_of(s.kind)
    ranges = layer_ranges(cfg)
    lines = [f"schedule {s.kind}: pp={p}, {v} virtual stage(s) per rank, "
             f"{m} microbatches per step (global_batch_size {cfg.train.global_batch_size} / "
             f"(dp {top.dp} x micro_batch_size {cfg.train.micro_batch_size}))"]
    reference = f"1F1B reference (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.4f}"
    if m * v > SIMULATED_MAX:
        lines += [_stages_line(r, p, v, ranges, style) for r in range(p)]
        return lines + [f"not simulated: {m * v} chunk-microbatches per rank > "
                        f"{SIMULATED_MAX} (the simulation grows as their square); {reference}"]
    sched = from_config(cfg, m)
    result = simulate(sched, costs)
    for r in range(p):
        lines.append(f"{_stages_line(r, p, v, ranges, style)}; "
                     f"bubble {result.bubble_per_rank[r]:.3f}, "
                     f"peak in-flight microbatches {result.peak_inflight[r]}")
        lines += _wrap(sched.text(r), width, "    ") if width >= 0 else []
    shown = " ".join(f"{k}={x:g}" for k, x in (costs or {"F": 1, "B": 1, "W": 1}).items())
    lines.append(f"simulated (costs {shown}): makespan {result.makespan:g}, "
                 f"bubble fraction {result.bubble:.4f} of the total time ({reference}); "
                 f"bubble {result.bubble_time:g} = {result.bubble_rate:.4f} of the ideal time; "
                 f"idle inside a rank's own span {result.span_bubble:g}")
    return lines


def _stages_line(r: int, pp: int, virtual: int, ranges: list[range], style: str) -> str:
    from ..pipeline.placement import chunks_of_rank

    stages = chunks_of_rank(r, pp, virtual, style)
    layers = ", ".join(f"{ranges[x].start}-{ranges[x].stop - 1}" for x in stages)
    last = pp * virtual - 1 in stages
    extra = (" + embedding" if r == 0 else "") + (" + head, loss" if last else "")
    return f"pp rank {r}: stage(s) {stages}, layers {layers}{extra}"


def memory_section(cfg, memory_per_rank: str = "") -> list[str]:
    """Per-rank bytes (parameters, gradients, optimizer state, in-flight activations),
    communication per axis and a fit warning: :func:`hpctrain.planner.memory.report`."""
    from ..planner.memory import parse_bytes, report

    return report(cfg, parse_bytes(memory_per_rank) if memory_per_rank else 0).splitlines()


def plan_section(cfg, nodes: int, ranks_per_node: int) -> list[str]:
    """``hpctrain plan --nodes N --ranks-per-node K``: which axes cross the inter-node link."""
    from ..topology import crossing

    t = cfg.topology
    placement = cfg.experimental.placement
    cross = crossing(t, nodes, ranks_per_node, placement)
    sizes = {"tp": t.tp, "cp": t.cp, "ep": t.ep, "dp": t.dp, "pp": t.pp}
    lines = [f"placement {placement} on {nodes} node(s) x {ranks_per_node} rank(s), "
             f"dp reduction {t.dp_reduction}:"]
    for axis, (n_cross, n_groups) in cross.items():
        if sizes[axis] == 1:
            continue
        where = "inside a node" if n_cross == 0 else \
            f"CROSSES the inter-node link ({n_cross} of {n_groups} groups)"
        lines.append(f"  {axis}={sizes[axis]}: {where}")
    if cross["tp"][0] and t.tp > 1:
        lines.append("  warning: tp all-reduces every layer; keep it inside a node")
    if cross["cp"][0] and t.cp > 1:
        lines.append("  warning: the cp ring passes keys and values every layer; keep it "
                     "inside a node if it fits (tp x cp ranks per node)")
    if cross["dp"][0] and t.dp_reduction == "flat" and t.dp > nodes:
        lines.append("  hint: dp spans nodes with several dp ranks per node: "
                     "topology.dp_reduction=hierarchical sends less over the link")
    return lines


def performance_section(cfg, cluster) -> list[str]:
    """``--cluster``: the cost model's step time and parts, tokens/s, MFU, memory fit."""
    from ..planner.cost import predict
    from ..planner.memory import fmt_bytes

    p = predict(cfg, cluster)
    dtype = cfg.model.dtype
    parts = ", ".join(f"{k} {v:.4g}" + (f" ({p.links[k]})" if k in p.links and v else "")
                      for k, v in p.parts.items() if abs(v) >= 1e-9)  # not rounding residue
    fit = "fits" if p.memory.total <= cluster.memory else "DOES NOT FIT"
    return [f"performance on {cluster.name} ({cluster.ranks_per_node} ranks per node, "
            f"{cluster.efficiency:.3g} x {cluster.peak(dtype):.4g} FLOP/s {dtype} per rank):",
            f"  step {p.step_s:.4g} s: {parts} (seconds the step spends on each; "
            "communication: the part compute does not hide; pp = bubble and transfers)",
            f"  {p.tokens_per_s:,.0f} tokens/s ({p.tokens_per_s_per_rank:,.0f} per rank), "
            f"MFU {100 * p.mfu:.1f}%, memory {fmt_bytes(p.memory.total)} of "
            f"{fmt_bytes(cluster.memory)}: {fit}"]


def data_section(cfg) -> list[str]:
    """How many epochs of the training split the planned steps cover (when the data is here:
    a plan may be made on another machine)."""
    from pathlib import Path

    from ..data.dataset import DataError, summarize
    from ..data.sampler import epochs_covered, samples_per_epoch

    d, t = cfg.data, cfg.train
    if d.sources:
        return blend_section(cfg)
    if any(p and not Path(p).exists() for p in (d.path, d.tokenizer)):
        return [f"data: {d.path} is not here (epochs not counted)"]
    try:
        s = summarize(d.path, d.corpus_mb, d.val_fraction, d.tokenizer)
    except DataError:
        return []
    n = samples_per_epoch(s.tokens["train"], t.seq_len)
    epochs = epochs_covered(s.tokens["train"], t.seq_len, t.global_batch_size, t.steps)
    name = d.path or s.where
    return [f"data: this run covers {epochs:.3g} epochs of {name} ({t.steps} steps x "
            f"{t.global_batch_size} samples; {n:,} samples of {t.seq_len + 1} tokens per "
            "epoch)"]


def blend_section(cfg) -> list[str]:
    """How many epochs of each source's training split a blend's planned steps cover."""
    from pathlib import Path

    from ..data.blend import BlendOrder, names
    from ..data.dataset import DataError, summarize
    from ..data.sampler import samples_per_epoch

    d, t = cfg.data, cfg.train
    missing = [s.path for s in d.sources if not Path(s.path).exists()]
    if missing:
        return [f"data: {', '.join(missing)} not here (epochs not counted)"]
    try:
        ns = [samples_per_epoch(summarize(s.path).tokens["train"], t.seq_len)
              for s in d.sources]
    except DataError:
        return []
    counts = BlendOrder([s.weight for s in d.sources]).counts(t.steps * t.global_batch_size)
    each = ", ".join(f"{c / n if n else float('inf'):.3g}{' epochs' if i == 0 else ''} of {name}"
                     for i, (c, n, name) in enumerate(zip(counts, ns, names(d.sources))))
    return [f"data: this run covers {each} ({t.steps} steps x {t.global_batch_size} "
            f"samples, blended {':'.join(f'{s.weight:g}' for s in d.sources)})"]


def special(args) -> int | None:
    """--published, --search and --calibrate; None when none of them was asked for."""
    from ..config import load
    from ..planner import published, search
    from ..planner.cluster import load as load_cluster

    if args.published:
        print(published.markdown(published.table()))
        return 0
    if args.calibrate:
        from ..planner.calibrate import calibrate
        from ..planner.cluster import dumps

        base = load_cluster(args.cluster or "cpu-epyc-7763")
        out = calibrate(load(args.config, args.overrides), base, args.calibrate)
        if out is not None:
            with open(args.calibrate, "w", encoding="utf-8") as f:
                f.write(dumps(out))
            print(f"wrote {args.calibrate}:\n{dumps(out)}")
        return 0
    if args.emit_overrides:
        return emit_overrides(args)
    if not args.search:
        return None
    if not args.cluster or args.nodes < 1:
        raise ValueError("--search needs --cluster and --nodes")
    from ..planner.memory import parse_bytes

    cluster = load_cluster(args.cluster)
    if args.ranks_per_node:  # e.g. 4 GPUs per node of a cluster described with 8
        cluster = dataclasses.replace(cluster, ranks_per_node=args.ranks_per_node)
    if args.memory_per_rank:  # which layouts fit this memory per rank
        cluster = dataclasses.replace(cluster, memory=parse_bytes(args.memory_per_rank))
    cands = search.search(load(args.config, args.overrides), cluster, args.nodes)
    lines = search.report(cands, args.top, 2, sets=bool(args.memory_per_rank))
    if cands and cands[0].prediction:
        lines += ["best as --set arguments:", "  " + search.set_line(cands[0].sets),
                  "as a SLURM job (`hpctrain submit` in place of sbatch checks it first):",
                  "  " + search.slurm_line(cands[0], args.nodes, cluster, args.config,
                                           args.overrides)]
    print("\n".join(lines))
    return 0


def _cluster(name, ranks_per_node: int = 0):
    """A description; ``--ranks-per-node`` replaces its ranks per node as in --search."""
    from ..planner.cluster import load

    c = load(name)
    return dataclasses.replace(c, ranks_per_node=ranks_per_node) if ranks_per_node else c


def run(args) -> int:
    from ..checks.inputs import check_plan_inputs
    from ..checks.validate import validate
    from ..config import ConfigError, load
    from ..planner.cluster import ClusterError
    from ..planner.hsdp import on_cluster as hsdp_on_cluster
    from ..planner.memory import parse_bytes

    try:  # the command line's own values; the modes that do not plan one layout
        if not args.config and not args.published:
            raise ValueError("a CONFIG is needed (except with --published)")
        done = special(args)
        if done is not None:
            return done
        costs = _costs(args.costs)
        if args.memory_per_rank:
            parse_bytes(args.memory_per_rank)
        if (args.world_size is not None and args.world_size < 1) or args.nodes < 0 \
                or args.ranks_per_node < 0:
            raise ValueError("--world-size must be >= 1, --nodes and --ranks-per-node >= 0")
    except (ValueError, ConfigError, ClusterError) as e:
        print(f"hpctrain plan: {e}", file=sys.stderr)
        return 2
    try:
        cfg = load(args.config, args.overrides)
        t = cfg.topology
        world = args.world_size or t.pp * t.dp * t.cp * t.tp  # absent: the layout's own
        validate(cfg, world)
        check_plan_inputs(cfg)  # the data, when it is here
        # the cluster first: it turns shard_within="node" into the size a node holds
        cluster = _cluster(args.cluster, args.ranks_per_node) if args.cluster else None
        cfg = hsdp_on_cluster(cfg, cluster) if cluster else cfg
    except (ConfigError, ValueError, ClusterError) as e:
        print(f"hpctrain plan: {e}", file=sys.stderr)
        return 2
    whence = "" if args.world_size else " (from the config's topology)"
    lines = [f"{world} ranks{whence}: "
             f"dp={t.dp} (ep={t.ep}) x "
             f"{f'cp={t.cp} x ' if t.cp > 1 else ''}tp={t.tp} x pp={t.pp}"
             f"{' + sequence parallel' if t.sequence_parallel else ''}"]
    try:  # the verdict first (memory, speed, what crosses nodes), the schedule after
        lines += memory_section(cfg, args.memory_per_rank)
        lines += performance_section(cfg, cluster) if cluster else []
        if args.nodes:  # topology.crossing: the nodes must hold the world
            lines += plan_section(cfg, args.nodes, args.ranks_per_node or world // args.nodes)
    except ValueError as e:
        print(f"hpctrain plan: {e}", file=sys.stderr)
        return 2
    lines += data_section(cfg)
    lines += schedule_section(cfg, args.width if args.schedules else -1, costs)
    print("\n".join(lines))
    return 0
