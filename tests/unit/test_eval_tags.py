"""MPI tags of the evaluation's pipeline transfers stay within the communicator's
``MPI_TAG_UB`` (MPI guarantees only 32767) for any number of microbatches and stages, and
every receive still meets the send of its own (microbatch, stage) in posting order.

Every pp rank's ``forward_only`` runs against a fake ``pp_comm`` that records each posted
transfer; the links are then matched as MPI would (non-overtaking: on one (source, dest, tag)
the i-th send meets the i-th receive)."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hpctrain.evaluate import forward_only
from hpctrain.parallel.pipeline import chunks_of_rank, rank_of_stage, style_of
from hpctrain.pipeline.actions import Action, link

MPI_MIN_TAG_UB = 32767  # the least MPI_TAG_UB the standard allows


class FakeComm:
    """Records (op, peer, tag) of every transfer; checks the bound."""

    def __init__(self, tag_ub: int):
        self.tag_ub, self.ops = tag_ub, []

    def _post(self, op, t, peer, tag):
        assert 0 <= tag <= self.tag_ub, f"{op} tag {tag} outside [0, TAG_UB={self.tag_ub}]"
        self.ops.append((op, peer, tag))
        return SimpleNamespace(wait=lambda: None)

    def isend(self, t, dest, tag=0):
        return self._post("send", t, dest, tag)

    def irecv(self, t, source, tag=0):
        return self._post("recv", t, source, tag)


class FakeChunk(torch.nn.Module):
    """Virtual stage ``stage`` of ``stages``: the last one returns a loss of 1."""

    def __init__(self, stage: int, stages: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.first, self.last = stage == 0, stage == stages - 1

    def forward(self, h, y=None):
        return torch.tensor(1.0) if self.last else torch.zeros(h.shape)


def run_rank(pp: int, rank: int, virtual: int, m: int, tag_ub: int, kind="1f1b") -> list:
    cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_size=1, seq_len=2),
                          model=SimpleNamespace(d_model=3), schedule=SimpleNamespace(kind=kind),
                          topology=SimpleNamespace(sequence_parallel=False))
    comm = FakeComm(tag_ub)
    topo = SimpleNamespace(pp_size=pp, pp_rank=rank, tp_size=1, cp_size=1, pp_comm=comm)
    style = style_of(kind)
    chunks = [FakeChunk(s, pp * virtual) for s in chunks_of_rank(rank, pp, virtual, style)]
    microbatches = [(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
                    for _ in range(m)]
    total = forward_only(chunks, microbatches, topo, cfg)
    assert total == (m if rank == rank_of_stage(pp * virtual - 1, pp, style) else 0)
    return comm.ops


def match(pp: int, virtual: int, m: int, tag_ub: int, kind="1f1b") -> int:
    """All ranks' transfers matched link by link in posting order; returns the top tag."""
    sends, recvs, top = defaultdict(list), defaultdict(list), 0
    for rank in range(pp):
        for op, peer, tag in run_rank(pp, rank, virtual, m, tag_ub, kind):
            top = max(top, tag)
            key = (rank, peer, tag) if op == "send" else (peer, rank, tag)
            (sends if op == "send" else recvs)[key].append(op)
    assert sends.keys() == recvs.keys()
    assert all(len(sends[k]) == len(recvs[k]) for k in sends)
    return top


@pytest.mark.parametrize("pp,virtual,kind", [(2, 1, "1f1b"), (4, 1, "1f1b"),
                                             (2, 3, "interleaved"), (4, 2, "interleaved"),
                                             (2, 2, "zbv"), (4, 2, "zbv")])
@pytest.mark.parametrize("tag_ub", [MPI_MIN_TAG_UB, 16])
def test_eval_tags_stay_within_tag_ub_for_a_long_evaluation(pp, virtual, kind, tag_ub):
    top = match(pp, virtual, m=1500, tag_ub=tag_ub, kind=kind)  # old: 1e6 + 1024 * mb + stage
    assert top <= tag_ub


@pytest.mark.parametrize("tag_ub", [MPI_MIN_TAG_UB, 2])  # 2: tags wrap (8 stages)
def test_eval_transfers_meet_their_own_microbatch_and_stage(tag_ub):
    # MPI matching simulated link by link, each transfer naming (microbatch, stage).
    pp, virtual, m = 4, 2, 7
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank in range(pp):
        log = run_rank_payloads(pp, rank, virtual, m, tag_ub)
        for op, peer, tag, payload in log:
            key = (rank, peer, tag) if op == "send" else (peer, rank, tag)
            (sends if op == "send" else recvs)[key].append(payload)
    assert sends and sends == recvs


def run_rank_payloads(pp, rank, virtual, m, tag_ub):
    """Transfers of one rank, each with (microbatch, receiving virtual stage)."""
    out = run_rank(pp, rank, virtual, m, tag_ub)
    # forward_only's order: microbatch by microbatch, chunk by chunk: recv (unless first
    # stage) then send (unless last stage) per (microbatch, chunk).
    stages = pp * virtual
    payloads = [(j, rank + k * pp + d) for j in range(m) for k in range(virtual)
                for d, ok in ((0, rank + k * pp > 0), (1, rank + k * pp < stages - 1)) if ok]
    assert len(payloads) == len(out)
    return [(*o, p) for o, p in zip(out, payloads)]


def test_runner_tags_are_small():
    # The pipeline runner's tags (2 * stage + 1 at most) fit MPI's least TAG_UB for any
    # stage count the trainer can build (pp * virtual_stages < 16384).
    stages = 64 * 8
    tags = [link(Action(k, 0), s, 64)[1] for s in range(stages) for k in ("SF", "RF", "SB", "RB")]
    assert max(tags) <= 2 * stages <= MPI_MIN_TAG_UB
