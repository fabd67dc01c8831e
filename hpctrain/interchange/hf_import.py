"""``hpctrain import DIR --out CKPT``: a Hugging Face Llama or Mixtral directory (one
``model.safetensors`` or shards with ``model.safetensors.index.json``) as an hpctrain
checkpoint in the format a run writes (global shapes, CRC-32 per dataset, config and lineage
attributes, zeroed AdamW state at step 0), which any layout resumes or starts from
(``checkpoint.init_from``). One process, no MPI."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..checkpoint import integrity as cv
from ..checkpoint.integrity import BLOCK_BYTES
from ..config import Config, ModelConfig, dumps_toml
from . import hf_map
from .hf_map import INDEX

DERIVED = (".rotary_emb.inv_freq",)  # buffers computed from config.json, not weights
HEAD = "lm_head.weight"
HF_DTYPES = {"float32": "float32", "float64": "float64", "bfloat16": "bfloat16",
             "float16": "float16"}


FLOATS = ("F16", "BF16", "F32", "F64")  # the safetensors dtypes a weight may have


def open_safetensors(path: Path):
    """``safetensors.safe_open(path)``; a file it cannot read (a header too large, not JSON,
    offsets outside the file) is one :class:`InterchangeError` naming it."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), "pt")
    except Exception as e:  # the library's SafetensorError, OSError
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise hf_map.InterchangeError(f"{path} is not a readable safetensors file ({detail}): "
                                      f"damaged or truncated; download it again") from None


class HFReader:
    """The tensors of an HF directory by key, wherever (which shard) they are."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        cfg_path = self.dir / "config.json"
        if not cfg_path.is_file():
            raise hf_map.InterchangeError(f"{self.dir} has no config.json: not a Hugging "
                                          f"Face model directory")
        try:
            self.config = json.loads(cfg_path.read_text())
        except (ValueError, RecursionError) as e:
            raise hf_map.InterchangeError(f"{cfg_path} is not valid JSON: {e}") from None
        self.where = self._index()
        self._open: dict = {}

    def _index(self) -> dict[str, Path]:
        if (self.dir / INDEX).is_file():
            try:
                wm = json.loads((self.dir / INDEX).read_text()).get("weight_map", {})
            except (ValueError, AttributeError, RecursionError):  # not JSON, nested too deep
                wm = None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise hf_map.InterchangeError(f"{self.dir / INDEX} is not a safetensors index "
                                              f"(JSON whose weight_map names a file per "
                                              f"tensor): damaged; download it again")
            shards = {v: self._shard(k, v) for k, v in wm.items()}
            self._check_shards(wm, shards)
            return {k: shards[v] for k, v in wm.items()}
        single = self.dir / "model.safetensors"
        if not single.is_file():
            raise hf_map.InterchangeError(
                f"{self.dir} has neither model.safetensors nor {INDEX} (only safetensors "
                f"weights are read, never pickled .bin files)")
        with open_safetensors(single) as f:
            return {k: single for k in f.keys()}

    def _check_shards(self, weight_map: dict, shards: dict) -> None:
        """Every tensor the index names is in the header of the shard it names."""
        held = {}
        for name, path in shards.items():
            if path.is_file():
                with open_safetensors(path) as f:
                    held[name] = set(f.keys())
        wrong = next((k for k, v in weight_map.items() if v in held and k not in held[v]), None)
        if wrong is not None:
            raise hf_map.InterchangeError(
                f"{self.dir / INDEX} names {weight_map[wrong]} for {wrong}, but that shard does "
                f"not hold it: the index and the shards disagree; download the model again")

    def _shard(self, key: str, name: str) -> Path:
        """The shard the index names for ``key``: a file name inside the directory (or, in a
        Hugging Face hub cache's ``snapshots/REV``, a link into the repository's ``blobs``);
        anything leading elsewhere is refused."""
        path, root = self.dir / name, self.dir.resolve()
        blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else root
        try:
            real = path.resolve()
            inside = not Path(name).is_absolute() and ".." not in Path(name).parts and any(
                real.is_relative_to(r) for r in (root, blobs.resolve()))
        except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
            inside = False
        if not inside:
            raise hf_map.InterchangeError(
                f"{self.dir / INDEX}: weight_map[{key!r}] is {name!r}, which leads outside "
                f"{self.dir}: refused (a model's shards lie in its own directory)")
        return path

    def _file(self, key: str):
        """The open file holding ``key``, for its header (shapes, dtypes) only: see
        :meth:`_mapped`."""
        path = self.where[key]
        if path not in self._open:
            if not path.is_file():
                raise hf_map.InterchangeError(f"shard {path} named by {INDEX} is missing")
            self._open[path] = open_safetensors(path)
        return self._open[path]

    @contextlib.contextmanager
    def _mapped(self, key: str):
        """``key``'s slice object in a mapping of its file made for one read: the pages a
        read touches count in the process's resident memory until the mapping closes, so
        values read through a file kept open would add up to the whole model."""
        self._file(key)  # the shard exists and its header reads
        with open_safetensors(self.where[key]) as f:
            yield f.get_slice(key)

    def get(self, key: str):
        """Tensor ``key``, in memory of its own."""
        return self.get_slice(key, ...)

    def shape(self, key: str) -> tuple:
        return tuple(self._file(key).get_slice(key).get_shape())

    def stored_dtype(self, key: str) -> str:
        """The safetensors dtype of ``key`` ("F32", "BF16", ...), from the header."""
        return self._file(key).get_slice(key).get_dtype()

    def read_dtype(self, key: str) -> type:
        """The numpy dtype tensor ``key`` is read as: float64 stays, the rest is float32."""
        wide = self.stored_dtype(key) == "F64"
        return np.float64 if wide else np.float32

    def read_into(self, key: str, dest: np.ndarray) -> None:
        """Tensor ``key`` into ``dest`` (its shape; 16-bit values widened exactly), a block of
        about ``BLOCK_BYTES`` at a time."""
        import torch

        out = torch.from_numpy(dest)
        if dest.ndim == 0:
            out.copy_(self.get(key))
            return
        step = max(1, BLOCK_BYTES // max(1, out[0].numel() * out.element_size()))
        for start in range(0, len(out), step):
            with self._mapped(key) as part:
                out[start:start + step].copy_(part[start:start + step])

    def get_slice(self, key: str, index):
        """``tensor[index]`` read without loading the rest of it."""
        with self._mapped(key) as part:
            return part[index]

    def slice_of(self, m: ModelConfig, name: str, index: tuple):
        """hpctrain parameter ``name``'s global ``index`` (experts stacked), as numpy;
        None when the directory has no such tensor."""
        import torch

        keys = [e for e in hf_map.entries(m, self.config) if e.name == name]
        if not keys or any(e.key not in self.where for e in keys):
            return None
        if keys[0].rows is not None:  # reordered rows: the whole tensor, then the slice
            t = keys[0].to_hpctrain(self.get(keys[0].key))[index]
        elif keys[0].expert is None:
            t = self.get_slice(keys[0].key, index)
        else:  # (E, ...) stacked: index[0] picks experts, the rest slices each
            experts = range(m.num_experts)[index[0]]
            t = torch.stack([self.get_slice(keys[e].key, index[1:]) for e in experts])
        return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()

    def model_config(self, dtype: str = "auto") -> ModelConfig:
        section = hf_map.model_section(self.config, set(self.where))
        hf_dtype = self.config.get("dtype") or self.config.get("torch_dtype") or "float32"
        section["dtype"] = HF_DTYPES.get(str(hf_dtype), "float32") if dtype == "auto" else dtype
        try:
            return ModelConfig(**section)
        except TypeError as e:  # this hpctrain has no llama architecture
            raise hf_map.InterchangeError(f"this hpctrain cannot hold the model: {e}") from None


def check_keys(reader: HFReader, m: ModelConfig) -> None:
    """Refuse missing and unexpected HF tensors, naming them. Buffers derived from the config
    (``rotary_emb.inv_freq``, which Llama-2-era checkpoints store) are ignored; an
    ``lm_head.weight`` stored beside ``tie_word_embeddings = true`` must equal the
    embedding."""
    entries = hf_map.entries(m, reader.config)
    known = {e.key for e in entries}
    missing = [e.key for e in entries if e.key not in reader.where]
    extra = set(reader.where) - known - {k for k in reader.where if k.endswith(DERIVED)}
    if m.tie_embeddings and HEAD in extra:
        extra.discard(HEAD)
        _check_tied_head(reader)
    unexpected = sorted(extra)
    not_float = [f"{k} ({reader.stored_dtype(k)})" for k in sorted(known & set(reader.where))
                 if reader.stored_dtype(k) not in FLOATS]
    if not_float:
        raise hf_map.InterchangeError(
            f"{reader.dir}: {len(not_float)} weight(s) stored in a dtype that is not floating "
            f"point ({', '.join(not_float[:3])}): not weights of this model, or a damaged "
            f"safetensors header; download the model again")
    if missing or unexpected:
        raise hf_map.InterchangeError(
            f"{reader.dir} does not match its config.json as a "
            f"{reader.config.get('model_type')} model: "
            f"{len(missing)} missing ({', '.join(missing[:3])}), {len(unexpected)} "
            f"unexpected ({', '.join(unexpected[:3])})")


def _check_tied_head(reader: HFReader, rows: int = 4096) -> None:
    """A stored head of a tied model equals the embedding (compared in blocks of rows)."""
    import torch

    embed = "model.embed_tokens.weight"
    shape = reader.shape(HEAD)
    same = shape == reader.shape(embed)
    for start in range(0, shape[0] if same else 0, rows):
        block = slice(start, start + rows)
        same = torch.equal(reader.get_slice(HEAD, block), reader.get_slice(embed, block))
        if not same:
            break
    if not same:
        raise hf_map.InterchangeError(
            f"{reader.dir}: config.json sets tie_word_embeddings = true, but the stored "
            f"{HEAD} differs from {embed}; set tie_word_embeddings = false in config.json "
            f"to import the head as its own tensor, or remove {HEAD} to tie it")


def parameter_entries(reader: HFReader, m: ModelConfig) -> dict[str, list]:
    """{hpctrain parameter: its HF entries} in HF's order (an expert-stacked parameter has
    one entry per expert)."""
    groups: dict[str, list] = {}
    for e in hf_map.entries(m, reader.config):
        groups.setdefault(e.name, []).append(e)
    return groups


def global_specs(reader: HFReader, m: ModelConfig) -> dict[str, tuple]:
    """{hpctrain parameter: (global shape, numpy dtype as read)} from the files' headers
    alone: experts stacked along dim 0, 16-bit tensors widened to float32."""
    out = {}
    for name, group in parameter_entries(reader, m).items():
        shape = reader.shape(group[0].key)
        stacked = group[0].expert is not None
        out[name] = ((len(group), *shape) if stacked else shape, reader.read_dtype(group[0].key))
    return out


def global_tensor(reader: HFReader, group: list, expert: int | None = None) -> np.ndarray:
    """The global array of the parameter whose HF entries are ``group`` (only expert
    ``expert`` of a stacked one when given), 16-bit values widened: read into its destination
    a block at a time, each expert into its slice of the stacked array."""
    first = group[0]
    if first.rows is not None:  # reordered rows (DeepSeek's projections): whole, then reordered
        import torch

        t = first.to_hpctrain(reader.get(first.key))
        return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
    parts = group if expert is None else [e for e in group if e.expert == expert]
    stacked = first.expert is not None and expert is None
    shape = reader.shape(first.key)
    out = np.empty((len(group), *shape) if stacked else shape, reader.read_dtype(first.key))
    for e in parts:
        reader.read_into(e.key, out[e.expert] if stacked else out)
    return out


def global_tensors(reader: HFReader, m: ModelConfig):
    """(hpctrain parameter name, global array) pairs of a directory :func:`open_hf` checked,
    one parameter at a time; experts stacked along dim 0."""
    for name, group in parameter_entries(reader, m).items():
        yield name, global_tensor(reader, group)


class Zeros(NamedTuple):
    """A dataset of zeros (fresh optimizer moments), made by HDF5's fill value: no array of
    zeros in memory, no bytes on disk (:func:`write_checkpoint`)."""

    shape: tuple
    dtype: type


def file_arrays(tensors, dtype: str):
    """(dataset, array) pairs of model/ and optim/ as a fresh run at step 0 would write them
    (16-bit parameters widened to float32, zero moments, float32 master copies), made one
    parameter at a time from ``tensors`` ({name: global array} or (name, array) pairs)."""
    pdt = np.float64 if dtype == "float64" else np.float32
    for name, a in tensors.items() if isinstance(tensors, dict) else tensors:
        yield f"model/{name}", a.astype(pdt, copy=False)
        if not name.endswith(".route_bias"):  # an MoE layer's selection bias: no moments
            yield f"optim/{name}/exp_avg", Zeros(a.shape, pdt)
            yield f"optim/{name}/exp_avg_sq", Zeros(a.shape, pdt)
            if dtype in ("bfloat16", "float16"):
                yield f"optim/{name}/master", a.astype(np.float32, copy=False)
        del a  # not held while the next parameter is read


def file_attributes(cfg: Config, lineage: dict, step: int, optim_step: int) -> dict:
    """The attributes a one-process save of ``cfg``'s model at ``step`` gets."""
    return {"format": cv.FORMAT, "step": step, "optim_step": optim_step,
            "data_next_step": step, "data_samples_seen": step * cfg.train.global_batch_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "versions": cv.versions(), "git_commit": cv.git_commit(), "writer": "serial",
            "world_size": 1, "rng_layout": "(1, 1, 1, 1, 1)", "topology": "(1, 1, 1, 1, 1)",
            "layout": json.dumps({"dims(pp,dp_outer,ep,cp,tp)": [1, 1, 1, 1, 1],
                                  "mpi_hints": {}, "alignment": 0}),
            "config": dumps_toml(cfg), "lineage": json.dumps(lineage), "data_hash": ""}


def check_destination(out: Path) -> None:
    """Refuse an import's ``out`` that holds anything: an existing ``*.h5``, a directory
    that is not empty, a file where a directory is meant. An import writes a new checkpoint;
    it never replaces one or moves a run's ``latest``."""
    out = Path(out)
    if out.suffix == ".h5" and (out.exists() or out.is_symlink()):
        raise hf_map.InterchangeError(f"{out} exists: an import never overwrites a "
                                      f"checkpoint; give --out a new file or directory")
    if out.suffix != ".h5" and out.is_dir() and any(out.iterdir()):
        held = ", ".join(sorted(p.name for p in out.iterdir())[:3])
        raise hf_map.InterchangeError(f"{out} is not empty (it holds {held}): an import "
                                      f"never replaces a checkpoint or moves `latest`; give "
                                      f"--out a new directory")
    if out.suffix != ".h5" and (out.exists() or out.is_symlink()) and not out.is_dir():
        raise hf_map.InterchangeError(f"{out} is a file, not a directory: give --out a new "
                                      f"directory, or a new file ending in .h5")


def make_directories(path: Path) -> list[Path]:
    """Create ``path`` and its missing parents; the ones created, outermost first (what a
    failed import removes again)."""
    missing = [p for p in (path, *path.parents) if not p.exists()][::-1]
    try:
        for p in missing:
            p.mkdir()
    except OSError as e:
        raise hf_map.InterchangeError(f"cannot create {path}: {e.strerror}") from None
    return missing


def write_checkpoint(out: Path, cfg: Config, arrays, lineage: dict, step: int = 0,
                     optim_step: int = 0) -> Path:
    """Write ``arrays`` ({dataset: array}, or (dataset, array) pairs made one at a time) as
    a committed checkpoint at ``step``: ``out`` itself when it ends in .h5, otherwise
    ``out/step_NNNNNNNN.h5`` with ``latest`` naming it. Atomic like a run's save."""
    import h5py

    from ..checkpoint.checkpointer import LATEST, step_name

    check_destination(out)
    cv.disable_file_locking()
    final = out if out.suffix == ".h5" else out / step_name(step)
    created = make_directories(final.parent)
    tmp = final.parent / f".{final.name}.tmp"
    attrs = file_attributes(cfg, lineage, step, optim_step)
    pairs = sorted(arrays.items()) if isinstance(arrays, dict) else arrays
    names = []
    try:
        with h5py.File(tmp, "w") as f:
            for name, array in pairs:
                _dataset(f, name, array)
                names.append(name)
                del array  # not held while the next one is made
            f.attrs.update(attrs)
        cv.stamp(tmp, cv.compute_checksums(tmp, sorted(names)))
        cv.fsync_file(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a refusal half way leaves nothing behind
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    cv.replace_durably(tmp, final)
    if out.suffix != ".h5":
        cv.write_durably(out / LATEST, final.name + "\n")
    return final


def _dataset(f, name: str, array) -> None:
    """Dataset ``name`` holding ``array``; :class:`Zeros` as a dataset whose fill value is 0
    and whose space is never allocated: nothing of it is written, and every reader (h5py,
    MPI-IO through HDF5, the checksums) gets zeros."""
    if isinstance(array, Zeros):
        f.create_dataset(name, shape=array.shape, dtype=array.dtype, fillvalue=0)
    else:
        f.create_dataset(name, data=array)


def tokenizer_lineage(directory: Path, m: ModelConfig) -> dict:
    """``{"data": ...}`` naming the directory's tokenizer.json and its sha256 (what export,
    generate and init_from check against later), or {} when it has none. One that cannot be
    read, or has more ids than the model's vocabulary, is refused."""
    from ..data import tokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        return {}
    try:
        tok = tokenizer.load(str(path))
    except tokenizer.TokenizerError as e:
        raise hf_map.InterchangeError(f"{e} (move it aside to import the weights without a "
                                      f"tokenizer)") from None
    if tok.vocab_size > m.vocab_size:
        raise hf_map.InterchangeError(f"{path} has {tok.vocab_size} ids, more than the "
                                      f"model's vocab_size {m.vocab_size}: not this model's")
    return {"data": {"tokenizer": tok.name, "tokenizer_hash": tok.hash,
                     "tokenizer_file": str(path.resolve()), "vocab_size": tok.vocab_size}}


def is_hf_directory(path: str | Path) -> bool:
    """A Hugging Face model directory (it has config.json), not an hpctrain checkpoint."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def open_hf(directory: str | Path, dtype: str = "auto"):
    """(reader, config with the directory's model, lineage) of an HF directory, checked
    (:func:`check_keys`, the tokenizer) before anything is read or written; ``import``,
    ``export`` and ``generate`` read it the same way."""
    reader = HFReader(directory)
    m = reader.model_config(dtype)
    check_keys(reader, m)
    cfg = dataclasses.replace(Config(), model=m)
    lineage = {"imported_from": str(Path(directory).resolve()),
               "hf_architectures": reader.config.get("architectures"),
               "hf_config": reader.config, **tokenizer_lineage(reader.dir, m)}
    return reader, cfg, lineage


def read_hf(directory: str | Path, dtype: str = "auto"):
    """(reader, config, {parameter: global array}, lineage) of an HF directory: the whole
    model in memory (``generate`` builds it anyway)."""
    reader, cfg, lineage = open_hf(directory, dtype)
    return reader, cfg, dict(global_tensors(reader, cfg.model)), lineage


def import_hf(directory: str | Path, out: str | Path, dtype: str = "auto",
              say=print) -> Path:
    """Convert HF directory ``directory`` into an hpctrain checkpoint at ``out``, one
    parameter in memory at a time."""
    check_destination(Path(out))
    reader, cfg, lineage = open_hf(directory, dtype)
    m = cfg.model
    specs = global_specs(reader, m)
    final = write_checkpoint(Path(out), cfg, file_arrays(global_tensors(reader, m), m.dtype),
                             lineage)
    n = sum(int(np.prod(shape)) for shape, _ in specs.values())
    keys = ", ".join(f"model.{k}={v!r}" for k, v in hf_map.model_section(reader.config,
                                                                         set(reader.where))
                     .items())
    say(f"wrote {final}: {reader.config.get('architectures', ['?'])[0]}, {len(specs)} "
        f"tensors, {n:,} parameters ({m.dtype}); train from it with "
        f"--set checkpoint.init_from={final} and the model keys {keys}")
    return final
