"""Other trainers' checkpoints in and out: ``hpctrain import --format dcp DIR --config CONFIG
--out OUT`` and ``hpctrain export CKPT --format dcp --out DIR``. A DCP directory carries no
model description, so CONFIG (an hpctrain config of the checkpoint's model) says which model
it is; the trainer's form (:class:`TitanForm`: torchtitan's Llama 3) says what each of its
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

from ..config import Config, ModelConfig
from ..model.families import resolved
from . import dcp, hf_map, titan
from .hf_import import write_checkpoint
from .hf_map import InterchangeError

MOMENTS = ("exp_avg", "exp_avg_sq")
NOT_MODEL = ("optimizer.", "train_state.", "lr_scheduler.", "dataloader.")


def model_shapes(m: ModelConfig) -> dict[str, tuple]:
    """{hpctrain parameter: global shape} of model ``m``, without memory (meta tensors)."""
    import torch

    from .generation import whole_model

    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in whole_model(m).named_parameters()}


class TitanForm:
    """torchtitan's Llama 3: one DCP tensor per hpctrain parameter, ``wq``/``wk`` rows in
    Meta's interleaved rotary order (:mod:`.titan`)."""

    name = "torchtitan Llama 3"

    def __init__(self, m: ModelConfig, names: titan.TitanNames):
        titan.check_model(m)
        self.names = names
        self.rows = [(e.name, names.key(e.key), titan.rotary_heads(m, e.key))
                     for e in hf_map.entries(m)]

    def keys(self) -> list[str]:
        """The DCP keys of the model's tensors, in the model's order."""
        return [key for _, key, _ in self.rows]

    def expected(self, shapes: dict) -> dict[str, tuple]:
        """{DCP key: global shape} the model's tensors must have."""
        return {key: shapes[name] for name, key, _ in self.rows}

    def params(self, get):
        """(hpctrain name, array) of every parameter; ``get(key)`` reads one DCP tensor."""
        for name, key, heads in self.rows:
            a = get(key)
            yield name, titan.to_rotate_half(a, heads) if heads else a

    def moment(self, key: str, which: str) -> str:
        return self.names.moment(key, which)

    def exported(self, name: str, a: np.ndarray, heads: int | None) -> np.ndarray:
        return titan.to_interleaved(a, heads) if heads else a


def check_entries(reader: dcp.Reader, form, m: ModelConfig) -> bool:
    """Refuse a checkpoint whose model tensors are missing, unexpected or of other shapes
    than ``m``'s, naming them; True when it carries the optimizer's moments of every one."""
    want = form.expected(model_shapes(m))
    have = {k for k in reader.tensors if not k.startswith(NOT_MODEL)}
    missing, extra = sorted(set(want) - have), sorted(have - set(want) - set(tied(form, m)))
    wrong = [f"{k} {reader.tensors[k][0]} (the config's model: {want[k]})" for k in sorted(want)
             if k in have and tuple(reader.tensors[k][0]) != tuple(want[k])]
    if missing or extra or wrong:
        raise InterchangeError(
            f"{reader.dir} does not hold the model the config describes as a {form.name} "
            f"checkpoint: {len(missing)} missing ({', '.join(missing[:3])}), {len(extra)} "
            f"unexpected ({', '.join(extra[:3])}), {len(wrong)} of another shape "
            f"({'; '.join(wrong[:3])}); give --config the checkpoint's model")
    moments = [form.moment(k, w) for k in want for w in MOMENTS]
    found = [k for k in moments if k in reader.tensors]
    if found and len(found) != len(moments):
        absent = sorted(set(moments) - set(found))
        raise InterchangeError(f"{reader.dir} has optimizer moments for some parameters only "
                               f"({len(absent)} missing, e.g. {absent[0]}): refused rather "
                               f"than resuming with part of the optimizer reset")
    return bool(found)


def tied(form, m: ModelConfig) -> list[str]:
    """A head key a tied torchtitan model stores beside its embedding (checked equal)."""
    if not m.tie_embeddings or not isinstance(form, TitanForm):
        return []
    return [form.names.prefix + form.names.head]


def steps(reader: dcp.Reader, form, moments: bool) -> tuple[int, int]:
    """(training step, optimizer step) of the checkpoint: ``train_state.step`` and the
    optimizer's per-parameter ``step`` (each stands in for the other when alone); (0, 0)
    without moments."""
    if not moments:
        return 0, 0
    key = form.moment(form.keys()[0], "step")
    opt = int(reader.tensor(key).item()) if key in reader.tensors else None
    run = reader.object(titan.STEP) if titan.STEP in reader.objects else None
    run = int(run.item() if hasattr(run, "item") else run) if run is not None else None
    step = run if run is not None else (opt or 0)
    return step, opt if opt is not None else step


def file_pairs(reader: dcp.Reader, form, dtype: str, moments: bool):
    """(dataset, array) pairs of the checkpoint, one parameter at a time: the parameter in
    the run's storage dtype (16-bit ones rounded, then widened to float32, with the exact
    value as the float32 ``master``), its moments or zeros."""
    import torch

    from ..model import DTYPES

    def get(key):
        t = reader.tensor(key)
        return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()

    store = np.float64 if dtype == "float64" else np.float32
    half = dtype in ("bfloat16", "float16")
    state = {w: form.params(lambda k, w=w: get(form.moment(k, w))) for w in MOMENTS} \
        if moments else {}
    for name, a in form.params(get):
        value = torch.from_numpy(a).to(DTYPES[dtype]).to(torch.float64).numpy() if half else a
        yield f"model/{name}", value.astype(store)
        if half:
            yield f"optim/{name}/master", a.astype(np.float32)
        for w in MOMENTS:
            m = next(state[w])[1] if moments else np.zeros(a.shape)
            yield f"optim/{name}/{w}", m.astype(store)


def form_of(reader: dcp.Reader, m: ModelConfig):
    """The trainer form of the checkpoint in ``reader`` for model ``m``."""
    return TitanForm(m, titan.detect(reader.tensors))


def check_tied_head(reader: dcp.Reader, form, m: ModelConfig) -> None:
    """A head stored beside the embedding of a tied model must equal it."""
    import torch

    for key in tied(form, m):
        if key in reader.tensors and not torch.equal(
                reader.tensor(key), reader.tensor(form.names.prefix + "tok_embeddings.weight")):
            raise InterchangeError(f"{reader.dir}: the config ties the embeddings "
                                   f"(model.tie_embeddings = true) but {key} differs from the "
                                   f"embedding; set model.tie_embeddings = false")


def import_dcp(directory: str | Path, out: str | Path, cfg: Config, say=print) -> Path:
    """Convert DCP checkpoint ``directory`` of ``cfg``'s model into an hpctrain checkpoint
    at ``out`` (a file ``*.h5``, or a directory that gets ``step_N.h5`` and ``latest``)."""
    m = resolved(cfg.model)
    cfg = dataclasses.replace(cfg, model=m)
    dcp.release_freed_memory()
    reader = dcp.Reader(directory)
    form = form_of(reader, m)
    moments = check_entries(reader, form, m)
    check_tied_head(reader, form, m)
    step, optim_step = steps(reader, form, moments)
    lineage = {"imported_from": str(Path(directory).resolve()), "format": "dcp",
               "dcp_form": form.name, "dcp_names": dataclasses.asdict(form.names),
               "dcp_dtype": str(reader.tensors[form.keys()[0]][1]).replace("torch.", "")}
    final = write_checkpoint(Path(out), cfg, file_pairs(reader, form, m.dtype, moments),
                             lineage, step, optim_step)
    how = (f"resume it at step {step} with --set checkpoint.resume={final}" if moments else
           f"start a run from it with --set checkpoint.init_from={final}")
    say(f"wrote {final}: {form.name}, {len(form.rows)} tensors"
        f"{', with the optimizer moments' if moments else ', no optimizer state'} "
        f"({m.dtype}); {how}")
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
    (``optim_step`` > 0), its moments and step, in ``dtype`` (auto: float32, float64 for a
    float64 model); one tensor read at a time."""
    import h5py
    import torch

    from ..checkpoint import integrity as cv
    from ..model import DTYPES
    from .hf_export import read_attributes

    cfg, attrs = read_attributes(path, verify)
    form = TitanForm(resolved(cfg.model), export_names(attrs))
    if dtype == "auto":
        dtype = "float64" if cfg.model.dtype == "float64" else "float32"
    if out.exists() and any(out.iterdir()):
        raise InterchangeError(f"{out} exists and is not empty: give a new directory")
    step, optim_step = int(attrs.get("step", 0)), int(attrs.get("optim_step", 0))
    cv.disable_file_locking()
    dcp.release_freed_memory()
    with h5py.File(path, "r") as f:
        source = {}
        for name, key, heads in form.rows:
            master = f"optim/{name}/master"
            source[key] = (master if master in f else f"model/{name}", heads)
            if optim_step:
                source.update({form.moment(key, w): (f"optim/{name}/{w}", heads)
                               for w in MOMENTS})
        specs = {k: (f[d].shape, DTYPES[dtype]) for k, (d, _) in source.items()}
        if optim_step:
            specs.update({form.moment(k, "step"): ((), torch.float32) for k in form.keys()})
            specs[titan.STEP] = step

        def produce(key: str):
            if key not in source:  # an optimizer step count
                return torch.tensor(float(optim_step))
            dataset, heads = source[key]
            a = titan.to_interleaved(f[dataset][...], heads) if heads else f[dataset][...]
            return torch.from_numpy(np.ascontiguousarray(a)).to(DTYPES[dtype])

        dcp.save(out, specs, produce)
    say(f"wrote {out}: torchtitan Llama 3 DCP, {len(form.rows)} parameters ({dtype})"
        f"{f', optimizer moments at step {step}' if optim_step else ''}")
