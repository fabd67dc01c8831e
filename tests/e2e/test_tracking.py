"""What a run says about itself, through the real CLI: TensorBoard event files and an offline
W&B run read back with their own readers, MFU against a nominal peak (and not computed
without one), a line per committed checkpoint, the end-of-run summary, and ``report`` with
the held-out loss and a resume on another layout.

Two launches serve every test: 2 ranks (dp=2) for 4 steps with both trackers, the cluster
peak and background saves (each write held 1 s before its commit); then the same run
directory resumed on 1 rank, stopped early by ``train.target_val_loss``, with no peak."""

import json
import re

import pytest
from launch import hpctrain, train_cli

from hpctrain.faults import ENV as FAULTS

pytestmark = pytest.mark.e2e

PEAK = 627e9  # share/clusters/cpu-epyc-7763.toml: float64 per rank (tiny-llama is float64)
TOKENS = 16 * 16  # tiny-llama: global_batch_size x seq_len


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tracking") / "run"
    first = train_cli(d, 2, "topology.dp=2", "train.steps=4", "train.eval_every=2",
                      "checkpoint.every=2", "checkpoint.async=true",
                      "telemetry.tensorboard=true", 'telemetry.wandb="offline"',
                      'telemetry.cluster="cpu-epyc-7763"', extra_env={FAULTS: "ckpt_slow@*:*:1"})
    summary = json.loads((d / "summary.json").read_text())
    second = train_cli(d, 1, "train.steps=8", "train.eval_every=2", "checkpoint.every=4",
                       "train.target_val_loss=100")
    return first, summary, second


def test_tensorboard_events_hold_every_series_and_the_config(runs):
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util.tensor_util import make_ndarray

    first = runs[0]
    assert len(list((first.run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0
    acc = ea.EventAccumulator(str(first.run_dir / "tensorboard"),
                              size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "matmul_tflops",
            "time_s/compute", "time_s/grad_sync", "comm_s/dp", "val_loss", "mem_params",
            "mem_peak"} <= tags, tags
    by_step = {m["step"]: m for m in first.metrics}
    for tag in ("loss", "lr", "grad_norm", "mfu"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3, 4]
        assert [e.value for e in events] == pytest.approx([by_step[s][tag] for s in (1, 2, 3, 4)])
    assert [e.step for e in acc.Scalars("val_loss")] == [2, 4]
    config = make_ndarray(acc.Tensors("config/text_summary")[0].tensor_proto).flat[0].decode()
    assert 'cluster = "cpu-epyc-7763"' in config and "steps = 4" in config
    lineage = make_ndarray(acc.Tensors("lineage/text_summary")[0].tensor_proto).flat[0].decode()
    assert "content_hash" in lineage


def wandb_records(path):
    """The records of an offline W&B run file: a 7-byte header (``:W&B``), then a LevelDB-style
    log (32 KiB blocks; each piece: CRC (4), length (2, little-endian), type (1: whole,
    2-4: first, middle, last)) of protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(part)
            out.append(rec)
            part = b""
    return out


def test_offline_wandb_run_holds_the_config_and_every_step(runs):
    first = runs[0]
    dirs = list((first.run_dir / "wandb").glob("offline-run-*"))
    assert len(dirs) == 1, dirs
    files = list(dirs[0].glob("run-*.wandb"))
    assert len(files) == 1, list(dirs[0].iterdir())
    records = wandb_records(files[0])
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "run" in kinds and "exit" in kinds, kinds
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["config"]["train"]["steps"] == 4
    assert config["config"]["telemetry"]["wandb"] == "offline"
    assert "content_hash" in config["lineage"]["data"]
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history[r.history.step.num] = {"/".join(i.nested_key) or i.key: json.loads(
                i.value_json) for i in r.history.item}
    assert sorted(history) == [1, 2, 3, 4]
    for m in first.metrics:
        assert history[m["step"]]["loss"] == pytest.approx(m["loss"])
        assert history[m["step"]]["time_s/compute"] == pytest.approx(m["time_s"]["compute"])
    assert "val_loss" in history[2] and "val_loss" not in history[3]


def test_mfu_is_over_the_clusters_peak_and_the_probe_is_apart(runs):
    first, _, second = runs
    for m in first.metrics:
        assert m["peak_source"] == "cluster cpu-epyc-7763 (float64)"
        assert m["mfu"] == pytest.approx(m["tflops_per_rank"] * 1e12 / PEAK)
        assert m["matmul_tflops"] == first.metrics[0]["matmul_tflops"] > 0
    assert ("MFU against 0.627 TFLOP/s per rank (cluster cpu-epyc-7763 (float64)), matmul "
            "probe") in first.stdout
    resumed = [m for m in second.metrics if m["step"] > 4]
    assert resumed and all("mfu" not in m and m["matmul_tflops"] > 0 for m in resumed)
    assert "MFU not computed (no telemetry.peak_flops or telemetry.cluster)" in second.stdout
    assert "| MFU - |" in second.stdout


def lines(stdout):
    return [x for x in stdout.splitlines() if x.startswith("[hpctrain]")]


def index_of(out, pattern):
    hits = [i for i, x in enumerate(out) if re.search(pattern, x)]
    assert len(hits) == 1, (pattern, out)
    return hits[0]


def test_a_line_per_commit_when_it_happens(runs):
    first, _, second = runs
    out = lines(first.stdout)
    ckpt = re.escape(str(first.run_dir / "checkpoints"))
    # background: step 2's write is held 1 s, so its commit is said after step 2's record
    two = index_of(out, rf"checkpoint of step 2 committed: {ckpt}/step_00000002\.h5 \([0-9.]+ s\)")
    assert index_of(out, r"step 2/4 \|") < two < index_of(out, r"step 4/4 \|")
    index_of(out, rf"checkpoint of step 4 committed: {ckpt}/step_00000004\.h5")
    out = lines(second.stdout)  # synchronous: committed before the step's record
    assert index_of(out, r"checkpoint of step 6 committed") < index_of(out, r"step 6/8 \|")


def test_summary_at_the_end_of_each_run(runs):
    first, summary, second = runs
    val = [m["val_loss"] for m in first.metrics if "val_loss" in m]
    assert summary == {**summary, "stop_reason": "finished: train.steps=4 reached", "steps": 4,
                       "first_step": 0, "final_step": 4, "tokens": 4 * TOKENS,
                       "final_loss": pytest.approx(first.metrics[-1]["loss"]),
                       "final_val_loss": pytest.approx(val[-1]),
                       "best_val_loss": pytest.approx(min(val)),
                       "checkpoint": str(first.run_dir / "checkpoints" / "step_00000004.h5")}
    assert summary["wall_s"] > 0
    assert re.search(r"run summary: 4 steps \(0 -> 4\), 1,024 tokens, final loss [0-9.]+, "
                     rf"held-out loss final {val[-1]:.4f} best {min(val):.4f}", first.stdout)
    assert "stopped: finished: train.steps=4 reached" in first.stdout
    # resumed on 1 rank, stopped by the target held-out loss at its first evaluation
    end = json.loads((second.run_dir / "summary.json").read_text())
    assert (end["first_step"], end["final_step"], end["steps"]) == (4, 6, 2)
    assert end["stop_reason"].startswith("target validation loss 100")
    assert end["checkpoint"].endswith("step_00000006.h5")
    assert "run summary: 2 steps (4 -> 6), 512 tokens" in second.stdout


def test_report_plots_held_out_loss_and_keeps_layouts_apart(runs):
    d = runs[0].run_dir
    assert hpctrain(["report", str(d)]).returncode == 0
    md = (d / "report" / "summary.md").read_text()
    assert "- steps 1..4 on pp=1 dp=2 ep=1 cp=1 tp=1: mean step time" in md, md
    assert "- steps 5..6 on pp=1 dp=1 ep=1 cp=1 tp=1: mean step time" in md, md
    assert "held-out loss final" in md and "stopped at step 6: target validation loss" in md
    assert "## Per rank on pp=1 dp=1 ep=1 cp=1 tp=1" in md
    assert "| 0 |" in md and "| 1 |" not in md.split("## Per rank")[1]
    assert (d / "report" / "loss_lr.png").read_bytes()[:4] == b"\x89PNG"
