"""The configuration's rules: every reason a :class:`~hpctrain.config.Config` cannot run on a
world size, as messages that name the key, its value and the rule (``optim.eps=0.0 must be >
0``) or show the arithmetic (``dp*tp*pp = 2*1*1 = 2 but the world has 4 ranks``).

The rules of one key alone are declared beside the key in ``hpctrain/config/`` and checked
by :func:`hpctrain.checks.keys.key_problems`; here are the rules that span keys or sections
and the layout arithmetic.

Pure, no MPI, imports only ``config``, ``checks.keys`` and the model families' registry
(``model.families``, whose checks ``_check_arch`` runs) and the gradient-sync factory
(``parallel.grad_sync.factory``, whose refusals ``_check_layout`` reports) and the fault
injector's parser (``faults``):
:func:`hpctrain.checks.validate.validate` calls :func:`problems` first, on every rank, before
any collective, and reports everything it finds at once. Types and unknown keys are refused
earlier, when the config is read (:func:`hpctrain.config.load`); what needs the pipeline
split or the schedule builder is asked by ``validate`` of a config that passes these.
"""

from __future__ import annotations

import dataclasses

from .. import faults
from ..config import Config, trace_window
from ..model import families
from ..parallel.grad_sync import factory as grad_sync
from ..pipeline import schedules
from .keys import key_problems, rule_problem


def problems(cfg: Config, world_size: int) -> list[str]:
    """Every reason why ``cfg`` cannot run on ``world_size`` ranks; [] when none."""
    bad = key_problems(cfg, ("topology",))
    if bad:  # the arithmetic below divides by the axes
        return bad
    errors = key_problems(cfg, tuple(f.name for f in dataclasses.fields(cfg)
                                     if f.name != "topology"))

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    for check in (_check_layout, _check_model, _check_context, _check_experts, _check_batch,
                  _check_optim, _check_schedule, _check_run):
        check(cfg, world_size, need)
    return errors


def _rule(cfg: Config, need, name: str, **rule) -> None:
    """A single-key rule (as :func:`hpctrain.config.key` declares it) that holds only with
    other keys' values, checked as the declared ones are (``name``: a dotted key)."""
    section, key = name.split(".")
    why = rule_problem(name, getattr(getattr(cfg, section), key), rule)
    if why is not None:
        need(False, why)


def _at_least(cfg: Config, need, lo, *names: str) -> None:
    """``name=value must be >= lo`` for each of ``names`` (dotted keys)."""
    for name in names:
        _rule(cfg, need, name, ge=lo)


def _check_layout(cfg: Config, world_size: int, need) -> None:
    top, o = cfg.topology, cfg.optim
    n = top.dp * top.tp * top.pp * top.cp
    names, values = ("dp*cp*tp*pp", f"{top.dp}*{top.cp}*{top.tp}*{top.pp}") if top.cp > 1 \
        else ("dp*tp*pp", f"{top.dp}*{top.tp}*{top.pp}")
    if world_size == 1 and n > 1:  # started without a launcher: say how to launch
        need(False, f"layout {names} = {values}: this layout needs {n} ranks but the world has "
             f"1: launch with `mpirun -n {n} hpctrain train ...` or `srun -n {n} hpctrain "
             "train ...`")
    else:
        need(n == world_size, f"layout {names} = {values} = {n} but the world has {world_size} "
             f"ranks; set topology.{names.replace('*', '/')} so that the product is {world_size}")
    need(top.dp % top.ep == 0, f"topology.ep={top.ep} must divide topology.dp={top.dp} "
         "(expert parallelism is carved out of data parallelism)")
    why = grad_sync.refusal(cfg)  # the gradient-sync factory's own choice
    need(why is None, why)
    _check_shards(top, o.zero, need)


def _check_shards(top, zero: int, need) -> None:
    """``topology.shard_within`` (HSDP): a ZeRO level to shard, a size that divides dp*cp and
    cuts the expert replicas (each ep rank's members of the dp*cp order) into equal groups."""
    w = top.shard_within
    if not w:
        return
    need(zero >= 1, f"topology.shard_within={w!r} shards the ZeRO state: it needs optim.zero "
         "= 1, 2 or 3")
    if w == "node":
        return
    if not w.isdigit() or int(w) < 1:
        need(False, f"topology.shard_within={w!r} must be \"\", \"node\" or a shard group "
             "size such as \"2\"")
        return
    s, n = int(w), top.dp * top.cp
    if n % s:
        need(False, f"topology.shard_within={s} must divide dp*cp = {top.dp}*{top.cp} = {n} "
             "(the ranks that hold the same parameters); choose a divisor of it")
        return
    sizes = {sum((i // top.cp) % top.ep == e for i in range(k, k + s))
             for k in range(0, n, s) for e in range(top.ep)} - {0}
    need(len(sizes) == 1, f"topology.shard_within={s} cuts the expert replicas unevenly "
         f"(ep={top.ep}, cp={top.cp}); choose a multiple of ep*cp = {top.ep * top.cp} or a "
         f"divisor of cp = {top.cp}")


def _check_model(cfg: Config, world_size: int, need) -> None:
    top, m, t = cfg.topology, cfg.model, cfg.train
    latent = getattr(families.find(m), "latent_attention", False)  # heads sized otherwise
    need(latent or m.d_head > 0 or m.d_model % max(m.n_heads, 1) == 0,
         f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; set "
         "model.d_head for heads of another size")
    need(m.n_heads % top.tp == 0,
         f"model.n_heads={m.n_heads} is not divisible by topology.tp={top.tp} "
         "(attention is split by heads)")
    _check_arch(cfg, need)
    need(m.ffn_dim % top.tp == 0,
         f"model.d_ff={m.ffn_dim} is not divisible by topology.tp={top.tp} "
         "(the MLP is split on its hidden dimension)")
    if top.sequence_parallel:
        need(t.seq_len % top.tp == 0,
             f"train.seq_len={t.seq_len} is not divisible by topology.tp={top.tp} "
             "(sequence parallelism splits the sequence over tp)")
    if m.tie_embeddings:
        need(top.pp == 1, "model.tie_embeddings needs topology.pp=1 (the embedding and the "
             "head would live on different pipeline stages)")
    if m.mtp_depth:
        need(top.pp == 1, f"model.mtp_depth={m.mtp_depth} needs topology.pp=1: the "
             "multi-token-prediction modules read the embedding, which lives on the first "
             "pipeline stage and hpctrain keeps no copy on the last; set pp=1 (use tp, cp, "
             "ep or ZeRO) or mtp_depth=0")
        need(cfg.optim.zero < 3, f"model.mtp_depth={m.mtp_depth} with optim.zero=3: "
             "ZeRO-3 gathers the head once, after the last block, and the modules run after "
             "it; use optim.zero <= 2")


def _check_arch(cfg: Config, need) -> None:
    """``model.arch`` (one of the registry's families) and what the family asks of the
    config (``model.families``: grouped-query attention, rotary, ...)."""
    _rule(cfg, need, "model.arch", choices=families.arch_names())
    family = families.find(cfg.model)
    if family is not None:
        family.check(cfg, need)


def _check_context(cfg: Config, world_size: int, need) -> None:
    """Context parallelism: the sequence in 2*cp chunks (rank i holds chunks i and
    2cp-1-i), attention as a ring over ``cp_comm`` (``parallel/ring_attention.py``)."""
    top, m, t = cfg.topology, cfg.model, cfg.train
    need(top.cp_ulysses <= top.cp, f"topology.cp_ulysses={top.cp_ulysses} exceeds "
         f"topology.cp={top.cp} (the hybrid's Ulysses groups are cp ranks); set it to a "
         "divisor of cp, or 0")
    if top.cp <= 1:
        return
    need(t.seq_len % (2 * top.cp) == 0,
         f"train.seq_len={t.seq_len} is not divisible by 2*topology.cp = {2 * top.cp} "
         "(context parallelism cuts the sequence into 2*cp equal chunks)")
    if top.sequence_parallel:
        need(t.seq_len % (top.cp * top.tp) == 0,
             f"train.seq_len={t.seq_len} is not divisible by topology.cp*tp = "
             f"{top.cp}*{top.tp} (sequence parallelism splits each cp rank's "
             f"seq_len/cp tokens over tp)")
    need(m.num_experts <= 0 or m.capacity_factor <= 0,
         f"model.capacity_factor={m.capacity_factor} needs topology.cp=1 (capacity follows "
         "the global token order, which context parallelism does not keep); set "
         "model.capacity_factor=0 (dropless) or topology.cp=1")
    need(not cfg.schedule.moe_overlap,
         "schedule.moe_overlap needs topology.cp=1 (not combined with context parallelism)")
    _check_ulysses(cfg, need)


def _check_ulysses(cfg: Config, need) -> None:
    """``topology.cp_kind``: Ulysses splits each tp rank's query and kv heads over cp; the
    hybrid over ``cp_ulysses`` (a divisor of cp; 0: a degree the heads allow)."""
    top, m = cfg.topology, cfg.model
    u = top.cp_ulysses
    if top.cp > 1 and u:
        need(top.cp_kind == "hybrid",
             f"topology.cp_ulysses={u} applies to topology.cp_kind=\"hybrid\" only (it is "
             f"\"{top.cp_kind}\"); set topology.cp_kind=\"hybrid\" or topology.cp_ulysses=0")
        need(top.cp % u == 0,
             f"topology.cp_ulysses={u} does not divide topology.cp={top.cp} (the hybrid "
             "cuts cp into groups of cp_ulysses ranks); choose a divisor of cp or 0")
    if top.cp_kind == "ulysses":
        split, what = top.cp, "topology.tp*cp"
    elif top.cp_kind == "hybrid" and u and top.cp % u == 0:
        split, what = u, "topology.tp*cp_ulysses"
    else:
        return
    family = families.find(m)
    kv = family.kv_heads(m) if family is not None else m.n_heads
    named = {"model.n_heads": m.n_heads}
    if kv != m.n_heads:  # without grouped-query attention the kv heads are the same verdict
        named["key/value heads"] = kv
    kind = top.cp_kind
    why = ("(Ulysses gives each cp rank heads/(tp*cp) heads); change topology.cp or use "
           "topology.cp_kind=\"ring\"" if kind == "ulysses" else
           "(each rank of a Ulysses group holds heads/(tp*cp_ulysses) heads); choose a "
           "smaller topology.cp_ulysses, or 0 for the largest that divides")
    for name, heads in named.items():
        need(heads % (top.tp * split) == 0,
             f"topology.cp_kind=\"{kind}\": {name}={heads} is not divisible by "
             f"{what} = {top.tp}*{split} {why}")


def _check_experts(cfg: Config, world_size: int, need) -> None:
    top, m = cfg.topology, cfg.model
    if m.num_experts <= 0:
        need(top.ep == 1, "topology.ep > 1 needs an MoE model (model.num_experts > 0)")
        return
    need(m.num_experts % top.ep == 0,
         f"model.num_experts={m.num_experts} is not divisible by topology.ep={top.ep}")
    need(1 <= m.top_k <= m.num_experts,
         f"model.top_k={m.top_k} must be >= 1 and <= model.num_experts={m.num_experts}")
    _at_least(cfg, need, 1, "model.moe_every")
    need(m.moe_every <= m.n_layers,
         f"model.moe_every={m.moe_every} > model.n_layers={m.n_layers}: no layer would have "
         f"experts (model.num_experts={m.num_experts}); lower moe_every or set num_experts=0")
    need(m.moe_every > m.n_layers or any(m.moe_layer(i) for i in range(m.n_layers)),
         f"model.dense_layers={m.dense_layers} leaves no block with experts among the "
         f"{m.n_layers} (model.num_experts={m.num_experts}); lower dense_layers or set "
         "num_experts=0")
    _at_least(cfg, need, 0, "model.capacity_factor", "model.aux_loss_coef",
              "model.z_loss_coef")
    _check_routing(m, top.tp, need)


def _check_routing(m, tp: int, need) -> None:
    """Group-limited routing and shared experts (docs/models.md)."""
    G, top_g, E = m.route_groups, m.route_top_groups, m.num_experts
    need(E % G == 0, f"model.route_groups={G} does not divide model.num_experts={E}; choose "
         "a divisor of num_experts (1: no groups)")
    need(top_g <= G, f"model.route_top_groups={top_g} > model.route_groups={G}; at most "
         "route_groups (0: all)")
    reach = (top_g if 0 < top_g < G else G) * (E // G if E % G == 0 else 0)
    need(E % G or m.top_k <= reach,
         f"model.top_k={m.top_k} > the {reach} experts of the model.route_top_groups={top_g} "
         f"groups of {E // G}; raise route_top_groups or lower top_k")
    need(m.shared_experts > 0 or (m.shared_expert_d_ff == 0 and not m.shared_expert_gate),
         "model.shared_expert_d_ff and model.shared_expert_gate need model.shared_experts > 0")
    need(m.shared_dim % tp == 0,
         f"model.shared_expert_d_ff={m.shared_dim} (the shared experts' hidden size) is not "
         f"divisible by topology.tp={tp}; each tp rank holds an equal part, as of the MLP")


def _check_batch(cfg: Config, world_size: int, need) -> None:
    top, t = cfg.topology, cfg.train
    per_step = top.dp * t.micro_batch_size
    need(
        per_step > 0 and t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size} is not divisible by "
        f"dp*micro_batch_size = {top.dp}*{t.micro_batch_size} = {per_step}",
    )
    need(t.eval_batches >= 1 or not t.eval_every,
         f"train.eval_batches={t.eval_batches} must be >= 1 (train.eval_every={t.eval_every})")
    need(not (t.patience or t.target_val_loss) or t.eval_every,
         "train.patience / target_val_loss need train.eval_every > 0 (they act on evaluations)")


def _check_optim(cfg: Config, world_size: int, need) -> None:
    o = cfg.optim
    need(o.min_lr <= o.lr or o.min_lr < 0 or o.lr < 0,
         f"optim.min_lr={o.min_lr!r} must be <= optim.lr={o.lr!r} (the learning rate decays "
         "from lr to min_lr)")
    _check_comm_dtype(cfg, need)


def _check_comm_dtype(cfg: Config, need) -> None:
    """``optim.grad_comm_dtype``: bfloat16 only, and only where a float32 reduction on host
    buffers crosses ranks (docs/decisions.md says why float16 is refused)."""
    wire, key = cfg.optim.grad_comm_dtype, "optim.grad_comm_dtype"
    if not wire:
        return
    need(wire != "float16", f"{key}=float16 is refused: gradients of the mean loss underflow "
         "float16's range (smallest normal 6e-5); use bfloat16 (float32's range)")
    top = cfg.topology
    need(top.dp * top.cp > 1, f"{key}={wire} needs a gradient reduction: topology.dp * "
         f"topology.cp = {top.dp}*{top.cp} = 1; set it back to \"\" or raise dp")
    need(cfg.model.dtype != "float64", f"{key}={wire} with model.dtype=float64 throws away the "
         "precision float64 is for; use model.dtype=float32, or grad_comm_dtype=\"\"")
    need(cfg.model.device == "cpu", f"{key}={wire} needs model.device=cpu (its 16-bit sum "
         "runs on host memory); set it to \"\" on cuda")
    need(cfg.experimental.reduction != "per-parameter", f"{key}={wire} with "
         "experimental.reduction=per-parameter: the naive baseline carries the gradients' "
         "dtype; drop one of the two")


def _check_schedule(cfg: Config, world_size: int, need) -> None:
    """Pipeline arithmetic (whether the microbatch count fits the schedule is asked by
    ``hpctrain.checks.validate`` of an otherwise valid config)."""
    top, m, s = cfg.topology, cfg.model, cfg.schedule
    if s.kind not in schedules.REGISTRY:
        return  # refused by its key's rule (checks.keys: the registry's names)
    kind = schedules.REGISTRY[s.kind]
    free = [n for n, k in schedules.REGISTRY.items() if not k.chunks]
    need(not kind.chunks or s.virtual_stages <= 1,
         f"schedule.virtual_stages={s.virtual_stages} is used only by "
         f"schedule.kind={' or '.join(map(repr, free))}, not {s.kind!r}: set it to 1 or use "
         f"{' or '.join(free)}")
    v = kind.virtual(s.virtual_stages)
    need(not (s.moe_overlap and m.recompute == "full"), "schedule.moe_overlap cannot be "
         "combined with model.recompute='full' (the forward is cut into segments at the "
         "expert all-to-alls); 'selective' can")
    if cfg.optim.zero == 3:  # the gathers hang on module calls and backward hooks
        for bad, why in ((m.recompute == "full", "model.recompute='full' (the recomputed "
                          "forward would free the block its backward needs)"),
                         (s.moe_overlap, "schedule.moe_overlap (its executor steps into "
                          "blocks without the module calls that gather them)")):
            need(not bad, f"optim.zero=3 cannot be combined with {why}; use optim.zero=2")
    need(m.n_layers >= top.pp * v,
         f"model.n_layers={m.n_layers} < pp*virtual_stages = {top.pp}*{v}: every (virtual) "
         "stage needs at least one layer")


def _check_run(cfg: Config, world_size: int, need) -> None:
    """Data, checkpoints, logging and stopping: the housekeeping keys."""
    tc = cfg.telemetry
    try:
        trace_window(tc.trace_steps)
    except ValueError as e:
        need(False, str(e))
    need(tc.loss_spike == 0 or tc.loss_spike > 1,
         f"telemetry.loss_spike={tc.loss_spike} must be 0 (off) or > 1 (a loss above "
         f"{tc.loss_spike} x the recent mean would flag ordinary steps)")
    need(not (cfg.data.path and cfg.data.tokenizer),
         f"data.tokenizer={cfg.data.tokenizer!r} tokenizes the embedded corpus, but "
         f"data.path={cfg.data.path!r} is a prepared file that carries its own tokenizer: "
         "set one of the two (prepare a file with `hpctrain prepare FILES --tokenizer "
         "tokenizer.json --out DATA.h5`)")
    _check_blend(cfg.data, need)
    try:  # both forms feed one injector: a wrong item is refused before any collective
        faults.parse(faults.spec(cfg.experimental.faults))
    except ValueError as e:
        need(False, f"experimental.faults / ${faults.ENV}: {e}")


def _check_blend(d, need) -> None:
    """``data.sources``: positive weights, named files, not beside ``data.path``."""
    need(not (d.sources and (d.path or d.tokenizer)),
         f"data.sources blends prepared files, so data.path={d.path!r} and "
         f"data.tokenizer={d.tokenizer!r} must be \"\": set data.path for one file or "
         "data.sources for a blend, not both")
    for i, s in enumerate(d.sources):
        need(s.weight > 0, f"data.sources[{i}].weight={s.weight:g} must be > 0 (the source's "
                           "share of the samples; leave a source out to drop it)")
        need(bool(s.path), f"data.sources[{i}].path is empty: name a file made by "
                           "`hpctrain prepare`")
    if d.sources and all(s.weight > 0 for s in d.sources):
        from ..data.blend import integer_weights  # numpy, not torch

        try:  # the blend's order in exactly the proportions given, or refused
            integer_weights([s.weight for s in d.sources])
        except ValueError as e:
            need(False, str(e))
