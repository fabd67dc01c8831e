"""What a valid configuration points at, checked before any collective by ``hpctrain train``
(:func:`check_inputs`: the data, the run and checkpoint directories, the checkpoint to resume
from or to initialise from) and ``hpctrain plan`` (:func:`check_plan_inputs`: the data, when
it is on this machine). Only reads, so every rank reaches the same verdict on a shared file
system; every problem is reported at once, as :class:`~hpctrain.config.InputError`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import Config, InputError


def check_inputs(cfg: Config, run_dir: str) -> None:
    """``hpctrain train``: the data (:func:`data_problems`), the run and checkpoint
    directories (writable, or creatable; no committed checkpoints there for a fresh start),
    the checkpoint to resume from, the parameters to initialise from. Nothing is written."""
    from ..interchange import init_from

    errors = _dir_problems(f"--run-dir {run_dir}", run_dir)
    if cfg.checkpoint.dir:
        errors += _dir_problems(f"checkpoint.dir={cfg.checkpoint.dir}", cfg.checkpoint.dir)
    resume = cfg.checkpoint.resume
    if resume not in ("", "never", "auto") and not Path(resume).exists():
        errors.append(f"checkpoint.resume={resume!r}: no checkpoint there")
    if resume in ("", "never"):
        errors += _fresh_start_problems(resume, Path(cfg.checkpoint.dir or
                                                     Path(run_dir) / "checkpoints"))
    if cfg.checkpoint.local_every:
        errors += local_dir_problems(cfg.checkpoint.local_dir)
    errors += data_problems(cfg)
    errors += init_from.problems(cfg)
    errors += tracking_problems(cfg)
    refuse(errors)


def tracking_problems(cfg: Config, installed=None) -> list[str]:
    """The trackers the config asks for whose package is not installed (looked up, not
    imported). ``installed(name)``: whether a package is there (tests pass their own)."""
    if installed is None:
        from importlib.util import find_spec

        def installed(name):
            return find_spec(name) is not None

    tc, out = cfg.telemetry, []
    for key, value, package in (("tensorboard", tc.tensorboard, "tensorboard"),
                                ("wandb", tc.wandb, "wandb")):
        if value and not installed(package):
            out.append(f"telemetry.{key}={value!r} needs the {package} package, which is not "
                       f"installed: pip install 'hpctrain[tracking]' (or {package}), or set "
                       f"telemetry.{key}={'false' if key == 'tensorboard' else repr('')}")
    return out


def check_plan_inputs(cfg: Config) -> None:
    """``hpctrain plan``: the data, when it is here (a plan may be made on another machine)."""
    refuse(data_problems(cfg, missing_ok=True))


def refuse(errors: list[str]) -> None:
    """Raise :class:`InputError` with every problem of ``errors`` (one alone: as it is)."""
    if len(errors) == 1:
        raise InputError(errors[0])
    if errors:
        raise InputError("invalid input:\n  - " + "\n  - ".join(errors))


def data_problems(cfg: Config, missing_ok: bool = False) -> list[str]:
    """Why the model cannot train on its data: the file is missing, damaged or not
    hpctrain's, a token id has no row in ``model.vocab_size``, a split is too short. Reads
    the file's attributes (the embedded corpus: its tokens, once). ``missing_ok``: a data
    file that is not here is no problem (``hpctrain plan`` on another machine)."""
    from ..data import segments
    from ..data.dataset import DataError, fit_problems, summarize

    d, t = cfg.data, cfg.train
    if d.sources:
        return blend_problems(cfg, missing_ok)
    if missing_ok and any(p and not Path(p).exists() for p in (d.path, d.tokenizer)):
        return []
    try:
        s = summarize(d.path, d.corpus_mb, d.val_fraction, d.tokenizer)
    except DataError as e:
        return [str(e)]
    splits = ("train", "val") if t.eval_every else ("train",)
    return fit_problems(s, cfg.model.vocab_size, t.seq_len, t.eval_every) + (segments.problems(
        d.path, splits, d.corpus_mb, d.val_fraction, d.tokenizer) if d.document_mask else [])


def blend_problems(cfg: Config, missing_ok: bool = False) -> list[str]:
    """:func:`data_problems` for each source of ``data.sources`` (named
    ``data.sources[i].path``), and sources whose tokenizers differ (their files'
    ``tokenizer`` and ``tokenizer_hash`` attributes)."""
    import dataclasses

    from ..data.dataset import _open

    out, ref = [], None
    for i, s in enumerate(cfg.data.sources):
        if missing_ok and not Path(s.path).exists():
            return []
        one = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=s.path,
                                                                sources=()))
        here = [e.replace(f"data.path={s.path}", f"data.sources[{i}].path={s.path}")
                for e in data_problems(one)]
        out += here
        if here:
            continue
        with _open(s.path) as f:
            tok = tuple(str(f.attrs.get(k, "")) for k in ("tokenizer", "tokenizer_hash"))
        ref = ref or (i, s.path, tok)
        if tok != ref[2]:
            out.append(f"data.sources[{i}].path={s.path} was tokenized with {tok[0]} "
                       f"({tok[1][:12] or 'no hash'}), data.sources[{ref[0]}].path={ref[1]} "
                       f"with {ref[2][0]} ({ref[2][1][:12] or 'no hash'}): a blend needs one "
                       "tokenizer (prepare every source with the same --tokenizer)")
    return out


def _fresh_start_problems(resume: str, ckpt_dir: Path) -> list[str]:
    """A fresh start (``checkpoint.resume = "never"``) would overwrite the committed
    checkpoints of ``ckpt_dir``: refused, saying how to continue or start anew."""
    found = sorted(ckpt_dir.glob("step_*.h5")) if ckpt_dir.is_dir() else []
    if not found:
        return []
    return [f"checkpoint.resume={resume!r}: {ckpt_dir} holds {len(found)} checkpoint(s) of an "
            f"earlier run (newest {found[-1].name}) that a fresh start would overwrite. "
            f"To continue that run, set checkpoint.resume=auto (the default); to start anew, "
            f"use another --run-dir (or checkpoint.dir), or move the checkpoints aside"]


def _dir_problems(what: str, path: str) -> list[str]:
    """[] when ``path`` is a writable directory or can be created (its nearest existing
    ancestor is a writable directory)."""
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            return [f"{what} exists and is not a directory"]
        target = p if p.exists() else next(a for a in p.absolute().parents if a.exists())
        if not target.is_dir():
            return [f"{what}: {target} is not a directory"]
        if not os.access(target, os.W_OK | os.X_OK):
            return [f"{what}: {target} is not writable"]
    except OSError as e:  # e.g. a parent that cannot be searched
        return [f"{what}: {e.strerror or e}"]
    return []


def local_dir_problems(template: str) -> list[str]:
    """``checkpoint.local_dir`` on this node (``{node}``: its host name) is writable or can
    be created."""
    import socket

    if not template.strip():
        return ["checkpoint.local_dir is empty: the local tier (checkpoint.local_every) needs "
                "a node-local directory, e.g. /dev/shm/NAME/{node}"]
    where = template.replace("{node}", socket.gethostname())
    bad = _dir_problems(f"checkpoint.local_dir={template!r} ({where} on this node)", where)
    return [f"{b}; the local tier (checkpoint.local_every) needs a node-local directory this "
            f"user can write on every node (e.g. /dev/shm/NAME/{{node}}), or set "
            f"checkpoint.local_every=0" for b in bad]
