"""Cluster descriptions: what one rank can compute and what each link costs (no MPI).

A description is a TOML file (``share/clusters/NAME.toml``; ``hpctrain plan --cluster NAME``
or a path)::

    name = "dgx-a100"
    source = "where the numbers come from"
    ranks_per_node = 8
    device = "cuda"              # cpu (default) | cuda: one rank per GPU (plan's sbatch line)
    memory = "80GB"              # per rank (bytes, or 80GB / 80GiB)
    efficiency = 0.6             # achievable fraction of peak for the model's matrix multiplies
    collective = "ring"          # ring | tree | hierarchical: the all-reduce algorithm
    memory_bandwidth = 2.0e12    # bytes/s per rank (the optimizer step is bound by it)
    checkpoint_bandwidth = 5e9   # bytes/s per node to the file system
    overhead_s = 0.0             # per layer per forward or backward pass (launches, Python)
    pass_overhead_s = 0.0        # per stage per forward or backward pass (embedding, loss,
                                 # the autograd call: what does not scale with the layers)
    hook_overhead_s = 0.0        # per parameter tensor and microbatch whose gradient hook
                                 # moves it (ZeRO 2/3, overlap, 16-bit main grads)
    ring_overhead_s = 0.0        # per layer and pass unit of ring attention (cp > 1)
    split_b = 0.74               # zb-h1/zbv: B (input gradients) in backwards
    split_w = 0.38               # and W (the weight matmuls' gradients)
    step_overhead_s = 0.0        # per step (norm, clip, bookkeeping)
    call_overhead_s = 0.0        # per collective the passes issue (tp, cp, ep, ZeRO-3): the
                                 # fixed time around each call beyond its link's alpha-beta
    post_overhead_s = 0.0        # per reduction a gradient hook posts (ZeRO-2: every bucket
                                 # and microbatch; overlap: every bucket) beyond alpha-beta
    sum16_s = 0.0                # per element a 16-bit gradient reduction sums in software
                                 # (optim.grad_comm_dtype: MPI's sum16 op), on the rank's CPU
    compute_share = 1.0          # fraction of its device a rank gets (< 1: oversubscribed)
    [peak_flops]                 # per rank, by model dtype
    bfloat16 = 312e12
    [link.intra]                 # inside a node; alpha-beta: latency s, bandwidth bytes/s
    latency = 3e-6               # per message
    bandwidth = 300e9            # per rank, one direction
    [link.inter]                 # between nodes (per rank's share of its node's network)
    latency = 5e-6
    bandwidth = 25e9
    ports = 0                    # how many ranks' bandwidth a node's link carries at once
                                 # (0: each rank has its own; 1.5: one and a half); more
                                 # flows share the ports

Bad files raise :class:`ClusterError` naming the file, the key, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SHARE = Path(__file__).resolve().parents[2] / "share" / "clusters"
COLLECTIVES = ("ring", "tree", "hierarchical")
DTYPES = ("float64", "float32", "bfloat16", "float16")


class ClusterError(ValueError):
    """A cluster description that cannot be used; the message names file, key and rule."""


@dataclass(frozen=True)
class Link:
    latency: float  # seconds per message (alpha)
    bandwidth: float  # bytes per second per rank, one direction (1 / beta)
    # how many transfers of one node cross at ``bandwidth`` at once (0: one port per rank, as
    # on nodes with a NIC per GPU; 1: one shared link; a fraction: several flows carry more
    # than one, less than one each, as on the simulated nodes)
    ports: float = 0

    def p2p(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def carrying(self, flows: int) -> Link:
        """This link while ``flows`` transfers of each node cross it at once: where they
        outnumber its ports, each gets ``bandwidth x ports / flows``."""
        if not self.ports or flows <= self.ports:
            return self
        return dataclasses.replace(self, bandwidth=self.bandwidth * self.ports / flows)


@dataclass(frozen=True)
class Cluster:
    name: str
    peak_flops: dict  # dtype -> FLOP/s per rank
    memory: int  # bytes per rank
    ranks_per_node: int
    intra: Link
    inter: Link
    efficiency: float = 0.6
    collective: str = "ring"
    memory_bandwidth: float = 1e12
    checkpoint_bandwidth: float = 1e9
    overhead_s: float = 0.0
    pass_overhead_s: float = 0.0
    hook_overhead_s: float = 0.0
    ring_overhead_s: float = 0.0
    split_b: float = 0.74  # zero-bubble B and W, in backwards (planner/cost.py)
    split_w: float = 0.38
    step_overhead_s: float = 0.0
    # seconds each collective issued inside the passes (tp, cp, ep, ZeRO-3) costs beyond its
    # link's alpha-beta: dispatch, the autograd function around it, on a shared machine the
    # wait until the peers run (``plan --calibrate`` measures it; 0 where not measured)
    call_overhead_s: float = 0.0
    # seconds each reduction posted from a gradient hook (nonblocking: ZeRO-2 per bucket and
    # microbatch, overlap per bucket) costs beyond its link's alpha-beta: posting the
    # schedule and the tests that drive it (``plan --calibrate``; 0 where not measured)
    post_overhead_s: float = 0.0
    # seconds per element a software 16-bit sum costs (``comm/sum16.py``; 0: not measured)
    sum16_s: float = 0.0
    compute_share: float = 1.0
    source: str = ""
    device: str = "cpu"  # what a rank computes on: cpu, or cuda (one rank per GPU)
    extra: dict = field(default_factory=dict)  # measured details kept by --calibrate

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ClusterError(f"cluster {self.name}: no peak_flops.{dtype} (has "
                               f"{', '.join(self.peak_flops)})")
        return self.peak_flops[dtype]


def _number(where: str, raw: dict, key: str, default=None, low=0.0, high=math.inf,
            strict_low=True) -> float:
    value = raw.get(key, default)
    if value is None:
        raise ClusterError(f"{where}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where}: {key} must be a number, got {value!r}")
    bad_low = value <= low if strict_low else value < low
    if not math.isfinite(value) or bad_low or value > high:
        rule = f"> {low:g}" if strict_low else f">= {low:g}"
        rule += f" and <= {high:g}" if high != math.inf else ""
        raise ClusterError(f"{where}: {key} = {value!r} must be {rule}")
    return float(value)


def _memory(where: str, value) -> int:
    from .memory import parse_bytes

    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        try:
            text = value.upper().replace("GB", "G").replace("MB", "M").replace("TB", "T")
            n = parse_bytes(value) if "I" in value.upper() else _decimal(text)
            if n > 0:
                return n
        except ValueError:
            pass
    raise ClusterError(f"{where}: memory = {value!r} must be bytes > 0 or e.g. 80GB / 80GiB")


def _decimal(text: str) -> int:
    mult = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}.get(text.strip()[-1:], 1)
    return int(float(text.strip()[:-1] if mult > 1 else text) * mult)


def _link(where: str, raw: dict, level: str) -> Link:
    body = raw.get("link", {}).get(level)
    if not isinstance(body, dict):
        raise ClusterError(f"{where}: [link.{level}] with latency and bandwidth is missing")
    w = f"{where} [link.{level}]"
    ports = body.get("ports", 0)
    if isinstance(ports, bool) or not isinstance(ports, (int, float)) or not (
            ports == 0 or 1 <= ports < float("inf")):
        raise ClusterError(f"{w}: ports = {ports!r} must be 0 (one per rank) or a number >= 1")
    return Link(_number(w, body, "latency", low=0.0, strict_low=False),
                _number(w, body, "bandwidth"), ports)


def from_dict(raw: dict, where: str = "cluster") -> Cluster:
    """A :class:`Cluster` from parsed TOML; every value checked (see the module docstring)."""
    peaks = raw.get("peak_flops")
    if not isinstance(peaks, dict) or not peaks:
        raise ClusterError(f"{where}: [peak_flops] (FLOP/s per rank by dtype) is missing")
    for key in peaks:
        if key not in DTYPES:
            raise ClusterError(f"{where}: peak_flops.{key}: unknown dtype; valid: "
                               f"{', '.join(DTYPES)}")
    collective = raw.get("collective", "ring")
    if collective not in COLLECTIVES:
        raise ClusterError(f"{where}: collective = {collective!r}; valid: "
                           f"{', '.join(COLLECTIVES)}")
    rpn = raw.get("ranks_per_node")
    if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
        raise ClusterError(f"{where}: ranks_per_node = {rpn!r} must be an integer >= 1")
    device = raw.get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise ClusterError(f"{where}: device = {device!r}; valid: cpu, cuda")
    num = lambda key, default=None, **kw: _number(where, raw, key, default, **kw)  # noqa: E731
    return Cluster(
        name=str(raw.get("name", where)), source=str(raw.get("source", "")),
        peak_flops={k: _number(f"{where} [peak_flops]", peaks, k) for k in peaks},
        memory=_memory(where, raw.get("memory")), ranks_per_node=rpn,
        intra=_link(where, raw, "intra"), inter=_link(where, raw, "inter"),
        efficiency=num("efficiency", 0.6, high=1.0), collective=collective,
        memory_bandwidth=num("memory_bandwidth", 1e12),
        checkpoint_bandwidth=num("checkpoint_bandwidth", 1e9),
        overhead_s=num("overhead_s", 0.0, strict_low=False),
        pass_overhead_s=num("pass_overhead_s", 0.0, strict_low=False),
        hook_overhead_s=num("hook_overhead_s", 0.0, strict_low=False),
        ring_overhead_s=num("ring_overhead_s", 0.0, strict_low=False),
        split_b=num("split_b", 0.74, high=4.0), split_w=num("split_w", 0.38, high=4.0),
        step_overhead_s=num("step_overhead_s", 0.0, strict_low=False),
        call_overhead_s=num("call_overhead_s", 0.0, strict_low=False),
        post_overhead_s=num("post_overhead_s", 0.0, strict_low=False),
        sum16_s=num("sum16_s", 0.0, strict_low=False),
        compute_share=num("compute_share", 1.0, high=1.0), device=device,
        extra=dict(raw.get("measured", {})))


def load(name_or_path: str) -> Cluster:
    """A description by name (``share/clusters/NAME.toml``) or by path."""
    p = Path(name_or_path)
    if not p.suffix and not p.exists():
        p = SHARE / f"{name_or_path}.toml"
    if not p.is_file():
        known = ", ".join(sorted(x.stem for x in SHARE.glob("*.toml")))
        raise ClusterError(f"cluster {name_or_path!r}: no such file or shipped description "
                           f"(shipped: {known})")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ClusterError(f"cluster file {p}: cannot be read as TOML: {e}") from None
    return from_dict(raw, str(p))


def shipped() -> list[str]:
    return sorted(x.stem for x in SHARE.glob("*.toml"))


def dumps(c: Cluster) -> str:
    """A description as TOML (what ``plan --calibrate`` writes); :func:`from_dict` reads it."""
    lines = [f'name = "{c.name}"', f'source = "{c.source}"',
             f"ranks_per_node = {c.ranks_per_node}", f'device = "{c.device}"',
             f"memory = {c.memory}",
             f"efficiency = {c.efficiency:.6g}", f'collective = "{c.collective}"',
             f"memory_bandwidth = {c.memory_bandwidth:.6g}",
             f"checkpoint_bandwidth = {c.checkpoint_bandwidth:.6g}",
             f"overhead_s = {c.overhead_s:.6g}", f"pass_overhead_s = {c.pass_overhead_s:.6g}",
             f"hook_overhead_s = {c.hook_overhead_s:.6g}",
             f"ring_overhead_s = {c.ring_overhead_s:.6g}",
             f"split_b = {c.split_b:.6g}", f"split_w = {c.split_w:.6g}",
             f"step_overhead_s = {c.step_overhead_s:.6g}",
             f"call_overhead_s = {c.call_overhead_s:.6g}",
             f"post_overhead_s = {c.post_overhead_s:.6g}", f"sum16_s = {c.sum16_s:.6g}",
             f"compute_share = {c.compute_share:.6g}", "", "[peak_flops]"]
    lines += [f"{k} = {v:.6g}" for k, v in c.peak_flops.items()]
    for level, link in (("intra", c.intra), ("inter", c.inter)):
        lines += ["", f"[link.{level}]", f"latency = {link.latency:.6g}",
                  f"bandwidth = {link.bandwidth:.6g}"]
        lines += [f"ports = {link.ports:.6g}"] if link.ports else []
    if c.extra:
        lines += ["", "[measured]"]
        lines += [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"'
                  for k, v in c.extra.items()]
    return "\n".join(lines) + "\n"


def mfu_peak(peak_flops: float, cluster: str, dtype: str) -> tuple[float | None, str]:
    """MFU's denominator and where it comes from: ``telemetry.peak_flops`` when set, else the
    ``[peak_flops]`` of ``dtype`` in the description ``cluster`` names, else (None, why not).
    Raises :class:`ClusterError` for a description that cannot be read or lacks ``dtype``."""
    if peak_flops:
        return peak_flops, "telemetry.peak_flops"
    if cluster:
        return load(cluster).peak(dtype), f"cluster {cluster} ({dtype})"
    return None, "no telemetry.peak_flops or telemetry.cluster"
