"""Across nodes, side by side: hpctrain's best layouts against the naive baseline, PyTorch
DDP and FSDP2, and the bound, where the step is communication-bound.

``python -m benchmarks --only nodes`` makes 2 simulated nodes x 2 ranks (``scripts/cluster.sh``,
the inter-node link shaped to ``cluster.RATE`` by a token bucket) and runs ONE ``mpirun`` over
them (:mod:`benchmarks.nodes_worker`) in which every variant trains the same model, init,
data and global batch, interleaved repeat by repeat:

- hpctrain's layouts, each a list of config overrides (``nodes_worker.HPCTRAIN``, HSDP
  among them);
- the naive baseline: flat dp, one blocking all-reduce per parameter, full replication, no
  overlap, ``experimental.placement = "naive"``;
- PyTorch DDP (gloo; bucket 4 and 25 MB, ``gradient_as_bucket_view``, ``static_graph``;
  float32, or bfloat16 by torch's bf16 compress hook) and FSDP2 (``fully_shard`` on gloo per
  block and root; full shard over 4, HSDP 2 x 2 mesh; ``reduce_dtype`` float32 or bfloat16),
  each repeat's in one child process per rank (:mod:`benchmarks.torch_peers`), so that no
  gloo thread lives in the ranks that time hpctrain;
- ``compute``: each rank alone on its quarter of the batch (no communication).

Ratios are taken between equal precisions only (float32 or bfloat16 gradient traffic, each
variant's name says which). The limit is max(``compute``, the link time of the bytes that must
cross each node's link: every gradient element once in each direction, at the wire dtype of
hpctrain's fastest variant, at the rate ``plan --calibrate`` measured for a node's link in the
same run: one rank's bandwidth across times the ports, what all of a node's ranks carry across
at once, both directions at once, as an all-reduce across nodes moves them; the nominal rate
where the run measured none); compute + link is the second line.
The plan's prediction of each hpctrain variant comes from the description ``hpctrain plan
--calibrate`` measures of this model on these nodes at the start of the same ``mpirun``
(written beside the result as ``plan_cluster``; long messages for the link's rate, the
ports of a node's link, the 16-bit sum). Every missed target prints its measured reason.
"""

from __future__ import annotations

import functools
import re

from hpctrain.job.launch import ROOT

from .cluster import RATE, begin
from .cluster_worker import MODEL
from .common import median, pair_ratios, ratio, row, same_losses
from .nodes_worker import CALIBRATED, hpctrain_variants

RANKS = (1,)
DESCRIPTION = ROOT / "share" / "clusters" / "this-machine-2node.toml"


def rate_bytes(rate: str) -> float:
    """``tc`` rate text (``200mbit``) in bytes per second."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"HPCTRAIN_CLUSTER_RATE={rate!r}: expected e.g. 200mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8


def _steady(xs: list) -> list:
    return xs[1:] if len(xs) > 1 else xs


def _comm(sample: dict) -> float:
    """Exposed communication seconds per steady step (hpctrain's metrics, rank 0)."""
    steps = _steady(sample["comm_s"])
    return sum(sum(c.values()) for c in steps) / len(steps)


def _config(size: str, overrides: list[str]):
    from .common import train_config

    return train_config(size, *MODEL[size], *overrides)


def cluster_of(description: str):
    """The cluster description ``plan --calibrate`` measured in the run (its TOML text)."""
    import tomllib

    from hpctrain.planner.cluster import from_dict

    return from_dict(tomllib.loads(description), "calibrated in the run")


def predicted(size: str, description: str | None = None) -> dict[str, dict]:
    """The plan's step (checkpoint left out) of each hpctrain variant on ``description``
    (TOML: the one calibrated in the run; None: :data:`DESCRIPTION`), and its parts:
    ``{"step": s, "compute": s, "dp": s}``."""
    from hpctrain.planner.cluster import load as load_cluster
    from hpctrain.planner.cost import predict

    cluster = cluster_of(description) if description else load_cluster(str(DESCRIPTION))
    out = {}
    for name, overrides in hpctrain_variants().items():  # (tiny runs only some)
        p = predict(_config(size, overrides), cluster)
        out[name] = {"step": p.step_s - p.parts["checkpoint"], "dp": p.parts.get("dp", 0.0),
                     "compute": p.parts.get("compute", 0.0)}
    return out


def node_rate(description: str | None) -> tuple[float, str]:
    """Bytes per second one node's link carries each way during an all-reduce, and where the
    figure comes from: the calibrated description's inter link (``bandwidth`` times the
    ports; ``ports = 0``: one per rank), else ``RATE``, the shaper's nominal rate."""
    if not description:
        return rate_bytes(RATE), f"{RATE} (nominal)"
    c = cluster_of(description)
    rate = c.inter.bandwidth * (c.inter.ports or c.ranks_per_node)
    return rate, f"{rate / 1e6:.1f} MB/s (measured; nominal {RATE})"


@functools.cache
def _elements(size: str) -> int:
    """The benchmark model's parameter elements (the model built once per size)."""
    from .common import local_model

    return sum(p.numel() for p in local_model(_config(size, [])).parameters())


def wire_s(size: str, bf16: bool, rate: float) -> float:
    """Seconds the gradients need on one node's link at ``rate`` bytes/s: every element in
    and out once."""
    return _elements(size) * (2 if bf16 else 4) / rate


def _why(name: str, step: dict, comm: dict, compute: float) -> str:
    exposed = (f"exposed communication {comm[name] * 1e3:.0f} ms" if name in comm else
               f"about {(step[name] - compute) * 1e3:.0f} ms beyond compute")
    return f"{name}: step {step[name] * 1e3:.0f} ms, compute {compute * 1e3:.0f} ms, {exposed}"


def traffic(name: str) -> str:
    """The precision a variant's gradients cross the link in (the naive baseline: float32)."""
    return "bf16" if name.endswith("bf16") else "float32"


def fastest(step: dict, prefix: str, precision: str) -> str | None:
    names = [n for n in step if n.startswith(prefix) and traffic(n) == precision]
    return min(names, key=step.get) if names else None


def peer_ratios(per: dict, step: dict, comm: dict, limits: dict | None = None) -> list[dict]:
    """Like for like: at each precision, hpctrain's fastest against the fastest DDP and
    FSDP2 of that precision (>= 1.3) and, in float32, against the naive baseline (>= 1.5).
    ``limits``: the limit's seconds per precision; a missed target then also says how close
    the peer runs to it (:func:`headroom`)."""
    compute, out = step["compute"], []
    for precision in ("float32", "bf16"):
        best = fastest(step, "hpctrain", precision)
        peers = [(fastest(step, "DDP", precision), ">= 1.3"),
                 (fastest(step, "FSDP2", precision), ">= 1.3")]
        if precision == "float32":
            peers.insert(0, ("naive baseline", ">= 1.5"))
        for peer, target in peers:
            if best is None or peer is None or peer not in per:
                continue
            q = ratio(f"{peer} / {best}", 0.0, target, pair_ratios(per[peer], per[best]))
            q["why"] = f"{_why(best, step, comm, compute)}; {_why(peer, step, comm, compute)}"
            if not q["met"] and limits:
                q["why"] += headroom(peer, step[peer], limits[precision], target)
            out.append(q)
    return out


def headroom(peer: str, peer_s: float, limit_s: float, target: str) -> str:
    """What the target asks of hpctrain against the limit: a peer at ``x`` times the limit
    leaves ``x / target``; below 1, the target asks for a step faster than the limit."""
    need = peer_s / limit_s / float(target.split()[1])
    return (f"; {peer} runs at {peer_s / limit_s:.2f}x the limit ({limit_s * 1e3:.0f} ms), "
            f"so the target needs hpctrain at {need:.2f}x it"
            + (" (faster than the limit: not reachable on this link)" if need < 1 else ""))


def ratios(per: dict, step: dict, comm: dict, plan: dict, size: str,
           rate: tuple[float, str]) -> list[dict]:
    """The targets of the issue, each with its measured reason (``why``); against a peer,
    the median of per-repeat ratios (``per``: each variant's step per repeat, interleaved).
    The limit of a step whose communication hides behind compute is max(compute, link time
    of the bytes that must cross at ``rate``, :func:`node_rate`); compute + link stays as a
    second line."""
    compute = step["compute"]
    wires = {p: wire_s(size, p == "bf16", rate[0]) for p in ("float32", "bf16")}
    out = peer_ratios(per, step, comm, {p: max(compute, w) for p, w in wires.items()})
    best = min((n for n in step if n.startswith("hpctrain")), key=step.get)
    link = wires[traffic(best)]
    for what, each, target in (
            ("limit max(compute, link)", [max(c, link) for c in per["compute"]], "<= 1.25"),
            ("bound compute + link", [c + link for c in per["compute"]], "<= 1.25")):
        q = ratio(f"{best[9:]} / {what}", 0.0, target, pair_ratios(per[best], each))
        q["why"] = (f"compute {compute * 1e3:.0f} ms, link {link * 1e3:.0f} ms at {rate[1]}; "
                    f"{_why(best, step, comm, compute)}")
        out.append(q)
    for name in (n for n in step if n.startswith("hpctrain")):
        p = plan[name]
        q = ratio(f"plan error |predicted / measured - 1|, {name[9:]}",
                  abs(p["step"] / step[name] - 1), "<= 0.25")
        q["why"] = (f"predicted {p['step'] * 1e3:.0f} ms (compute {p['compute'] * 1e3:.0f} ms, "
                    f"exposed dp {p['dp'] * 1e3:.0f} ms), measured {step[name] * 1e3:.0f} ms "
                    f"({_why(name, step, comm, compute)}; compute alone {compute * 1e3:.0f} ms)")
        out.append(q)
    return out


def check(samples: dict) -> dict:
    """Same losses: float32 traffic exactly as the naive baseline (1e-4); bf16 within 1e-2."""
    f32 = {k: v[0]["losses"] for k, v in samples.items() if k != "compute" and "bf16" not in k}
    b16 = {k: v[0]["losses"] for k, v in samples.items() if "bf16" in k}
    out = same_losses(f32, tol=1e-4)
    if b16:
        loose = same_losses({"naive baseline": f32["naive baseline"], **b16}, tol=1e-2)
        out["ok"] = out["ok"] and loose["ok"]
        out["values"].update(loose["values"])
        out["rel_err_bf16"] = loose["rel_err"]
    out["what"] = ("per-step losses: float32 traffic within 1e-4 of the naive baseline, "
                   "bfloat16 traffic within 1e-2")
    return out


def run(world, size: str, repeats: int) -> dict:
    """Drive the cluster from world rank 0 (world size 1); see the module docstring."""
    out, samples = begin("nodes", world, size, repeats, "same model, data and global batch",
                         "nodes_worker")
    if samples is None:
        return out
    description = samples.pop(CALIBRATED, None)
    per = {k: [median(_steady(s["step_s"])) for s in v] for k, v in samples.items()}
    step = {k: median(v) for k, v in per.items()}
    comm = {k: median([_comm(s) for s in v]) for k, v in samples.items()
            if k == "naive baseline" or k.startswith("hpctrain")}
    best = min((n for n in step if n.startswith("hpctrain")), key=step.get)
    rate = node_rate(description)
    link = wire_s(size, traffic(best) == "bf16", rate[0])
    plan = predicted(size, description)
    out["plan_cluster"] = description
    out["rows"] = [row(k, v, "s/step") for k, v in per.items()]
    out["ratios"] = ratios(per, step, comm, plan, size, rate)
    out["table"] = [{"variant": k, "step_s": step[k], "exposed_comm_s": comm.get(k),
                     "predicted_s": plan[k]["step"] if k in plan else None} for k in step]
    out["table"] += [{"variant": f"limit max(compute, link), {traffic(best)}",
                      "step_s": max(step["compute"], link)},
                     {"variant": f"bound compute + link, {traffic(best)}",
                      "step_s": step["compute"] + link}]
    out["notes"].append(f"hpctrain variants: {', '.join(hpctrain_variants())}")
    out["check"] = check(samples)
    return out
