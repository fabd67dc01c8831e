"""The local tier (``checkpoint.local_every``): every N steps each rank writes all of its
pieces to node-local storage and sends a copy to its partner rank on the next node, which
writes it under its own node's directory (shards.py: the files and their commit).

The step only takes the snapshot (the same pieces and attributes as the HDF5 save:
``Checkpointer.pieces`` and its attributes); a thread does the rest on a duplicate of the
world communicator (the exchange with the partner, CRC-32, the files, pruning), like an
asynchronous HDF5 save (background.py: at most one generation in flight, its end or failure
agreed by all ranks at the same step). Without ``MPI_THREAD_MULTIPLE`` the write happens in
the step. A node keeps at most ``checkpoint.local_keep`` complete generations plus the one
being written: older ones are deleted when a new one starts, after every rank agreed the
previous one was written.

The partner of a rank is the rank with the same local rank on the next node (nodes ordered
by their lowest world rank; the MPI shared-memory split says which ranks share a node), so
losing one node loses no shard while its two neighbours live. On one node there is no
partner copy (said once in the log).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from .. import comm, faults
from .background import CheckpointFailed, InFlight
from .shards import (
    MARKER_FORMAT,
    crc_of,
    drop_newer,
    dumps,
    encode,
    gen_name,
    node_dir,
    prune,
    run_dir,
    run_identity,
    write_shard,
)
from .write import snapshot

MSG_TAG = 7301


def partner_map(nodes: list[tuple[int, int, int]]) -> list[int | None]:
    """World rank -> its partner's world rank, from every rank's ``(node leader, local
    rank, ranks on the node)``: the same local rank (modulo that node's size) on the next
    node in leader order; None everywhere when there is one node."""
    leaders = sorted({n[0] for n in nodes})
    if len(leaders) < 2:
        return [None] * len(nodes)
    where = {(lead, local): r for r, (lead, local, _) in enumerate(nodes)}
    size = {lead: sz for lead, _, sz in nodes}
    out: list[int | None] = []
    for lead, local, _ in nodes:
        nxt = leaders[(leaders.index(lead) + 1) % len(leaders)]
        out.append(where[(nxt, local % size[nxt])])
    return out


class LocalWriter:
    """Writes one generation: this rank's shard and the partner copies it receives."""

    def __init__(self, tier: LocalTier, group):
        self.tier, self.group = tier, group

    def write(self, snap) -> dict:
        t0, tier, g = time.perf_counter(), self.tier, self.group
        folder = tier.folder / gen_name(snap.step)
        done = sorted(int(p.name[5:]) for p in tier.folder.glob("step_*")
                      if int(p.name[5:]) < snap.step)
        if len(done) > tier.keep:  # the newest `keep` agreed generations stay
            prune(tier.folder, done[-tier.keep])
        table, bufs = encode(snap.pieces, snap.bufs, snap.writes)
        crc, nbytes = crc_of(bufs)
        marker = {"format": MARKER_FORMAT, "run": tier.run_id, "step": snap.step, "rank": g.rank,
                  "world": g.size, "dims": list(tier.dims), "node": tier.host,
                  "crc32": crc, "bytes": nbytes, "pieces": table, "meta": snap.meta}
        received = self._exchange(marker, bufs) if tier.partner_of is not None else []
        t_sent = time.perf_counter() - t0
        write_shard(folder, marker, bufs, killer=tier.world_rank)
        for m, blob in received:
            write_shard(folder, m, [blob])
        dt = time.perf_counter() - t0
        return {"local_save_s": dt + snap.taken_s, "local_send_s": t_sent,
                "local_save_bytes": float(nbytes), "local_partner_bytes":
                float(sum(m["bytes"] for m, _ in received))}

    def _exchange(self, marker: dict, bufs) -> list[tuple[dict, np.ndarray]]:
        """Send this rank's shard (its marker as JSON, then its bytes) to its partner and
        receive those whose partner this rank is: [(marker, bytes)]. Collective over the
        writer's group (one allgather of the sizes, then point-to-point)."""
        g, tier = self.group, self.tier
        head = np.frombuffer(dumps(marker).encode(), dtype=np.uint8).copy()
        sizes = g.allgather_obj((head.size, marker["bytes"]))
        blob = (np.concatenate([np.asarray(b).view(np.uint8).reshape(-1) for b in bufs])
                if bufs else np.empty(0, np.uint8))
        wards = [r for r, p in enumerate(tier.partner_of) if p == g.rank]
        heads = {r: torch.empty(sizes[r][0], dtype=torch.uint8) for r in wards}
        recv = {r: torch.empty(sizes[r][1], dtype=torch.uint8) for r in wards}
        handles = [g.irecv(heads[r], r, MSG_TAG) for r in wards]
        handles += [g.irecv(recv[r], r, MSG_TAG + 1) for r in wards if sizes[r][1]]
        dest = tier.partner_of[g.rank]
        handles.append(g.isend(torch.from_numpy(head), dest, MSG_TAG))
        if blob.size:
            handles.append(g.isend(torch.from_numpy(blob), dest, MSG_TAG + 1))
        if faults.find("partner_kill", tier.world_rank, marker["step"]):
            faults.die(f"rank {tier.world_rank} killed in the partner exchange of step "
                       f"{marker['step']}")
        comm.wait_all(handles)
        return [(json.loads(heads[r].numpy().tobytes()), recv[r].numpy()) for r in wards]


class LocalTier:
    """The run's local tier: the save every ``local_every`` steps and its flight."""

    def __init__(self, cfg, topo, saver, info=None, warn=None):
        self.every, self.keep, self.saver, self.topo = cfg.local_every, cfg.local_keep, saver, topo
        self.host, self.dims, self.world_rank = topo.hostname, tuple(topo.dims), topo.world.rank
        self.folder = run_dir(node_dir(cfg.local_dir, topo.hostname), saver.dir)
        self.info, self.warn = info or (lambda _m: None), warn or (lambda _m: None)
        self.recovery: dict | None = None  # how the run started (recover.py), summary.json
        self.flight: InFlight | None = None
        self.sync_writer: LocalWriter | None = None
        self.partner_of: list | None = None
        self.metrics: dict = {}
        self.stale_after: int | None = None  # generations past it go at the next save
        self.run_id = ""
        if self.every:
            self.run_id = topo.world.bcast_obj(
                run_identity(saver.dir) if topo.world.rank == 0 else None)
            self._start(topo.world, topo.node_comm)

    def _start(self, world, node) -> None:
        """Partners (one allgather of every rank's node) and the writer. Collective."""
        lead = int(node.allreduce(float(world.rank), "min"))
        self.partner_of = partner_map(world.allgather_obj((lead, node.rank, node.size)))
        if self.partner_of[0] is None:
            self.partner_of = None
            if world.rank == 0:
                self.info("checkpoint.local_every: every rank is on one node: no partner copies")
        ok, _ = comm.thread_multiple()
        if ok:
            self.flight = InFlight(LocalWriter(self, world.dup("local-writer")), world,
                                   "the local checkpoint tier's write",
                                   "the generation before it stays in use")
        else:
            self.sync_writer = LocalWriter(self, world)

    def restore(self, how: str, named_params, optimizer) -> dict | None:
        """``checkpoint.resume``: with the local tier on and "auto", the freshest complete
        tier (recover.py); otherwise the HDF5 checkpoints alone (Checkpointer.restore).
        Collective."""
        if how == "auto" and self.every:
            from .recover import restore

            return restore(self, named_params, optimizer)
        from .recover import resharded

        t0 = time.perf_counter()
        resumed = self.saver.restore(how, named_params, optimizer)
        if self.every:  # an explicit start: the generations past it are another line
            drop_newer(self.folder, int(resumed["step"]) if resumed else 0)
        self.recovery = {"tier": "hdf5" if resumed else "none",
                         "step": int(resumed["step"]) if resumed else 0,
                         "recovery_s": time.perf_counter() - t0,
                         "path": resumed["path"] if resumed else None,
                         "reshard": resharded(resumed, self.dims)}
        return resumed

    def roll_back(self, named_params, optimizer) -> str | None:
        """The numeric guard's rollback to the newest HDF5 checkpoint; the local
        generations after it are deleted (they belong to the line rolled back)."""
        self.wait()
        path = self.saver.roll_back(named_params, optimizer)
        if self.every:
            drop_newer(self.folder, int(Path(path).stem[5:]) if path else 0)
        return path

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def disable(self, why: str) -> None:
        """A local write failed (alike on every rank): the tier is off for the rest of the
        run, said once; the HDF5 checkpoints carry on."""
        self.every, self.flight = 0, None
        if self.world_rank == 0:
            self.warn(f"local checkpoint tier disabled for the rest of this run: {why}; the "
                      "HDF5 checkpoints (checkpoint.every) carry on")

    def save(self, step: int, named_params, optimizer, attrs: dict) -> None:
        """Snapshot every piece of this rank for generation ``step`` and hand it to the
        writer thread (after the previous generation is written). Collective."""
        t0 = time.perf_counter()
        self.wait()
        if not self.every:  # the wait found the previous generation failed
            return
        if self.stale_after is not None:  # superseded now: the restart abandoned them
            if self.topo.node_comm.rank == 0:  # the node's folder: its first rank
                drop_newer(self.folder, self.stale_after)
            self.topo.world.barrier()  # before any rank of the node writes this generation
            self.stale_after = None
        pieces = self.saver.pieces(named_params, optimizer)
        writes = {path: p.writes for path, p in pieces.items()}
        for p in pieces.values():
            p.writes = True  # every piece, so that the same layout reads its own file alone
        meta = self.saver.attributes(step, optimizer, attrs) if self.world_rank == 0 else {}
        snap = snapshot(step, pieces, meta, copy=True)
        snap.writes = writes
        if self.flight is not None:
            self.flight.start(snap)
        else:
            self._write_here(snap)
        self.metrics["local_blocked_s"] = time.perf_counter() - t0

    def _write_here(self, snap) -> None:
        """The write in the step (no MPI_THREAD_MULTIPLE): a failure on any rank, agreed by
        every rank, disables the tier."""
        why = ""
        try:
            self.metrics.update(self.sync_writer.write(snap))
        except OSError as e:
            why = f"rank {self.world_rank}: {e}"
        failed = [w for w in self.topo.world.allgather_obj(why) if w]
        if failed:
            self.disable(f"the local write of step {snap.step} failed on {failed[0]}")

    def poll(self) -> None:
        """Once per step while a generation is in flight: its end joins the metrics, a
        failure on any rank raises on every rank. Collective."""
        if self.flight is not None and self.flight.busy:
            self._finished(self._polled(block=False))

    def wait(self) -> None:
        if self.flight is not None and self.flight.busy:
            self._finished(self._polled(block=True))

    def _polled(self, block: bool) -> dict | None:
        """The flight's poll; a failed generation disables the tier (every rank alike)."""
        try:
            return self.flight.poll(block=block)
        except CheckpointFailed as e:
            self.disable(str(e))
            return None

    def background_write(self) -> tuple[float, str] | None:
        """(start, what) while this rank writes a generation (for ``Watchdog.watch``)."""
        return self.flight.running() if self.flight is not None else None

    def _finished(self, metrics: dict | None) -> None:
        if metrics:
            metrics["local_step"] = metrics.pop("ckpt_async_step")
            self.metrics.update(metrics)

    def take_metrics(self) -> dict:
        out, self.metrics = self.metrics, {}
        return out
