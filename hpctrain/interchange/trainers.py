"""Other trainers' checkpoints in and out: ``hpctrain import --format dcp DIR --config
CONFIG --out OUT`` and ``hpctrain export CKPT --format dcp --out DIR`` (torchtitan's form).
A DCP directory carries no model description, so CONFIG (an hpctrain config of the
checkpoint's model) says which model it is; the trainer's form (:mod:`.forms`; torchtitan's
Llama 3 in ``titan.py``, Megatron-Core's GPT in ``megatron.py``) says what each of its
tensors is in hpctrain's names. Every tensor is checked against the model (names, global
shapes) from the metadata alone, before anything is written; then each is read, reordered and
written to the HDF5 checkpoint one at a time (:mod:`.dcp`), so a conversion holds one tensor
of the checkpoint, not the model. With the optimizer's moments the checkpoint resumes at the
writer's step (``checkpoint.resume``); without, it starts a run (``checkpoint.init_from``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..checkpoint.integrity import BLOCK_BYTES
from ..config import Config, ModelConfig
from ..model.families import resolved
from . import dcp, megatron, titan
from .forms import either
from .hf_import import Zeros, check_destination, write_checkpoint
from .hf_map import InterchangeError

MOMENTS = ("exp_avg", "exp_avg_sq")
NOT_MODEL = ("optimizer.", "train_state.", "lr_scheduler.", "dataloader.")


def model_shapes(m: ModelConfig) -> dict[str, tuple]:
    """{hpctrain parameter: global shape} of model ``m``, without memory (meta tensors)."""
    import torch

    from .generation import whole_model

    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in whole_model(m).named_parameters()}


def check_entries(reader: dcp.Reader, form, m: ModelConfig) -> bool:
    """Refuse a checkpoint whose model tensors are missing, unexpected or of other shapes
    than ``m``'s, naming them; True when it carries the optimizer's moments of every one."""
    want = form.expected(model_shapes(m))
    have = {k for k in reader.tensors if not k.startswith(NOT_MODEL)}
    missing, extra = sorted(set(want) - have), sorted(have - set(want) - set(form.ignored))
    rows = {k: p.rows for k, p in form.padded.items()}
    wrong = [k for k in sorted(want) if k in have
             and not fits(reader.tensors[k][0], want[k], rows.get(k, ()))]
    if missing or extra or wrong:
        shapes = [misfit(k, reader.tensors[k][0], want[k], rows.get(k)) for k in wrong]
        counts = [f"{len(items)} {what} ({sep.join(items[:3])})" for items, what, sep in
                  ((missing, "missing", ", "), (extra, "unexpected", ", "),
                   (shapes, "of another shape", "; ")) if items]
        fix = next((form.padded[k].rule for k in wrong if k in form.padded),
                   "give --config the checkpoint's model")
        raise InterchangeError(f"{reader.dir} does not hold the model the config describes as "
                               f"a {form.name} checkpoint: {', '.join(counts)}; {fix}")
    moments = [form.moment(k, w) for k in want for w in MOMENTS]
    found = [k for k in moments if k in reader.tensors]
    if found and len(found) != len(moments):
        absent = sorted(set(moments) - set(found))
        raise InterchangeError(f"{reader.dir} has optimizer moments for some parameters only "
                               f"({len(absent)} missing, e.g. {absent[0]}): refused rather "
                               f"than resuming with part of the optimizer reset")
    return bool(found)


def fits(have: tuple, want: tuple, rows=()) -> bool:
    """Shapes equal, or the stored first dimension one of ``rows`` (the sizes its writer's
    padding rule gives the model's vocabulary) and the rest equal."""
    have, want = tuple(have), tuple(want)
    return have == want or (len(have) == len(want) > 0 and have[1:] == want[1:]
                            and have[0] in rows)


def misfit(key: str, have: tuple, want: tuple, rows=None) -> str:
    """``key``'s stored shape against the model's, with the padded sizes its writer's rule
    gives (``rows``) when it pads."""
    padded = f"; padded by its writer's rule: {either(sorted(rows))}" if rows else ""
    return f"{key} {tuple(have)} (the config's model: {tuple(want)}{padded})"


def file_pairs(reader: dcp.Reader, form, dtype: str, moments: bool):
    """(dataset, array) pairs of the checkpoint, one tensor in memory at a time: each unit's
    parameters in the run's storage dtype (16-bit ones rounded, then widened to float32,
    with the exact float32 value as ``master``: the form's float32 copy where it has one),
    then each of its moments, read in turn, or zeros (written by HDF5, :class:`Zeros`)."""
    store = np.float64 if dtype == "float64" else np.float32
    for unit in form.units:
        exact = next((k for k in form.masters(unit.key) if k in reader.tensors), unit.key)
        shapes = {}
        for name, a in unit_parts(reader, unit, exact):
            shapes[name] = a.shape
            yield from parameter_pairs(name, a, dtype, store)
            del a
        for w in MOMENTS:
            if not moments:
                yield from ((f"optim/{n}/{w}", Zeros(s, store)) for n, s in shapes.items())
                continue
            for name, a in unit_parts(reader, unit, form.moment(unit.key, w)):
                yield f"optim/{name}/{w}", a.astype(store, copy=False)
                del a


def unit_parts(reader: dcp.Reader, unit, key: str):
    """(parameter, array) of each hpctrain parameter ``unit`` holds, read from checkpoint
    tensor ``key`` (the unit's own, its float32 copy or one of its moments; 16-bit values
    widened exactly): the tensor is read once, its parts cut one at a time."""
    import torch

    t = reader.tensor(key, unit.index, unit.rows)
    a = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
    del t
    yield from unit.cut(a)


def parameter_pairs(name: str, a: np.ndarray, dtype: str, store):
    """model/NAME in the run's storage, and for 16-bit models the float32 master (the
    rounding made a block of rows at a time into the one new array)."""
    import torch

    from ..model import DTYPES

    if dtype not in ("bfloat16", "float16"):
        yield f"model/{name}", a.astype(store, copy=False)
        return
    exact = a.astype(np.float32, copy=False)
    rounded = np.empty_like(exact)
    flat, out = exact.reshape(-1), rounded.reshape(-1)
    step = BLOCK_BYTES // 4
    for start in range(0, flat.size, step):
        block = torch.from_numpy(flat[start:start + step])
        out[start:start + step] = block.to(DTYPES[dtype]).float().numpy()
    yield f"model/{name}", rounded.astype(store, copy=False)
    del rounded, out
    yield f"optim/{name}/master", exact


def form_of(reader: dcp.Reader, m: ModelConfig):
    """The trainer form of the checkpoint in ``reader`` for model ``m``: Megatron-Core's
    when it has Megatron's names, else torchtitan's."""
    if megatron.is_megatron(reader.tensors):
        return megatron.MegatronForm(m, reader.tensors, megatron.common_state(reader.dir))
    return titan.TitanForm(m, titan.detect(reader.tensors), reader.tensors.keys() |
                           reader.objects, reader.tensors)


def check_tied_head(reader: dcp.Reader, form, m: ModelConfig) -> None:
    """A head a tied model stores beside its embedding must equal it."""
    import torch

    key = form.tied_head() if m.tie_embeddings else None
    if key in reader.tensors and not torch.equal(reader.tensor(key),
                                                 reader.tensor(form.units[0].key)):
        raise InterchangeError(f"{reader.dir}: the config ties the embeddings "
                               f"(model.tie_embeddings = true) but {key} differs from the "
                               f"embedding; set model.tie_embeddings = false")


def import_dcp(directory: str | Path, out: str | Path, cfg: Config, say=print) -> Path:
    """Convert DCP checkpoint ``directory`` of ``cfg``'s model into an hpctrain checkpoint
    at ``out`` (a file ``*.h5``, or a directory that gets ``step_N.h5`` and ``latest``)."""
    check_destination(Path(out))
    m = resolved(cfg.model)
    cfg = dataclasses.replace(cfg, model=m)
    dcp.release_freed_memory()
    directory = megatron.iteration_directory(Path(directory))
    reader = titan.fused_moments(dcp.Reader(directory), m)
    form = form_of(reader, m)
    moments = check_entries(reader, form, m)
    check_tied_head(reader, form, m)
    step, optim_step = form.steps(reader) if moments else (0, 0)
    lineage = {"imported_from": str(Path(directory).resolve()), "format": "dcp",
               "dcp_form": form.name, "dcp_names": form.naming(),
               "dcp_dtype": str(reader.tensors[form.units[0].key][1]).replace("torch.", "")}
    final = write_checkpoint(Path(out), cfg, file_pairs(reader, form, m.dtype, moments),
                             lineage, step, optim_step)
    how = (f"resume it at step {step} with --set checkpoint.resume={final}" if moments else
           f"start a run from it with --set checkpoint.init_from={final}")
    n = sum(len(u.parts) for u in form.units)
    say(f"wrote {final}: {form.name}, {n} parameters"
        f"{', with the optimizer moments' if moments else ', no optimizer state'} "
        f"({m.dtype}); {how}" + "".join(f"; {note}" for note in form.notes))
    return final


def export_names(attrs: dict) -> titan.TitanNames:
    """The naming an import recorded (so a round trip writes what it read), else
    torchtitan's classic one."""
    import json

    try:
        names = json.loads(str(attrs.get("lineage") or "{}")).get("dcp_names") or {}
        return titan.TitanNames(**names)
    except (ValueError, TypeError):
        return titan.TitanNames()


def export_dcp(path: Path, out: Path, dtype: str = "auto", verify: bool = True,
               say=print) -> None:
    """Write checkpoint ``path`` (verified) as torchtitan's Llama 3 DCP at ``out``:
    parameters (the float32 master of 16-bit ones) and, once the optimizer has stepped
    (``optim_step`` > 0), what torchtitan's ``CheckpointManager`` loads beside them (moments,
    steps, hyperparameters, schedule and train state: :meth:`.titan.TitanForm.trainer_state`),
    in ``dtype`` (auto: float32, float64 for a float64 model); one tensor read at a time."""
    import h5py
    import torch

    from ..checkpoint import integrity as cv
    from ..config.derived import lr_at
    from ..model import DTYPES
    from .hf_export import read_attributes

    cfg, attrs = read_attributes(path, verify)
    m = resolved(cfg.model)
    form = titan.TitanForm(m, export_names(attrs))
    if dtype == "auto":
        dtype = "float64" if m.dtype == "float64" else "float32"
    if out.exists() and any(out.iterdir()):
        raise InterchangeError(f"{out} exists and is not empty: give a new directory")
    step, optim_step = int(attrs.get("step", 0)), int(attrs.get("optim_step", 0))
    written, values, counts = form.written(bool(optim_step)), {}, set()
    if optim_step:
        horizon = cfg.optim.decay_steps or cfg.train.steps
        tokens = int(attrs.get("data_samples_seen", 0)) * cfg.train.seq_len
        values = form.trainer_state(cfg.optim, lr_at(step, cfg.optim, horizon),
                                    model_shapes(m), step, tokens)
        counts = {f"optimizer.state.{param}.step" for param in form.optimizer_params()}
    cv.disable_file_locking()
    dcp.release_freed_memory()
    with h5py.File(path, "r") as f:
        source = ExportSource(f, written)
        specs = {k: (source.shape(k), DTYPES[dtype]) for k in written}
        specs.update({k: ((), torch.float32) for k in counts})

        def produce(key: str):
            if key in counts:
                return torch.tensor(float(optim_step))
            return source.fill(key, torch.empty(specs[key][0], dtype=DTYPES[dtype]))

        dcp.save(out, specs, produce, values)
    say(f"wrote {out}: torchtitan Llama 3 DCP, {len(form.rows)} parameters ({dtype})"
        + (f", optimizer moments, schedule and train state at step {step}; torchtitan "
           f"resumes it as step-{step} of its checkpoint folder with "
           f"--checkpoint.exclude_from_loading dataloader" if optim_step else ""))


class ExportSource:
    """The tensors of an export (:meth:`.titan.TitanForm.written`) from open hpctrain
    checkpoint ``f``: each piece's dataset, rows back in the interleaved rotary order, fused
    q/k/v moments joined."""

    def __init__(self, f, written: dict):
        self.f, self.written = f, written

    def dataset(self, name: str, which: str | None):
        """The parameter's float32 master where it has one, else its value; or a moment."""
        master = f"optim/{name}/master"
        key = f"optim/{name}/{which}" if which else (
            master if master in self.f else f"model/{name}")
        return self.f[key]

    def shape(self, key: str) -> tuple:
        shapes = [self.dataset(name, which).shape for name, which, _ in self.written[key]]
        return shapes[0] if len(shapes) == 1 else (sum(s[0] for s in shapes), shapes[0][1])

    def fill(self, key: str, out):
        """Tensor ``out`` (torch, any float dtype) filled with :meth:`read`'s values; an
        entry of one plain piece is copied a block of rows at a time, never whole."""
        import torch

        from .hf_export import Arrays

        (name, which, heads), *rest = self.written[key]
        if rest or heads or out.dim() == 0:
            out.copy_(torch.from_numpy(self.read(key)))
            return out
        start = 0
        for block in Arrays({key: self.dataset(name, which)}).blocks(key):
            out[start:start + len(block)].copy_(torch.from_numpy(block))
            start += len(block)
            del block  # before the next is read: one block in memory, not two
        return out

    def read(self, key: str) -> np.ndarray:
        pieces = self.written[key]
        arrays = [titan.to_interleaved(self.dataset(name, which)[...], heads) if heads else
                  self.dataset(name, which)[...] for name, which, heads in pieces]
        if len(arrays) == 1:
            return np.ascontiguousarray(arrays[0])
        return titan.fuse_qkv(*arrays, kv_heads=pieces[1][2])
