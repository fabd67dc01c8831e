"""A worker of the foreign-checkpoint fuzz campaign (:mod:`benchmarks.fuzz_foreign`):
``python -m benchmarks.fuzz_worker``, driven by JSON lines on stdin, answering on stdout.

At start it runs the unmutated conversions it is sent (``hpctrain.__main__.main(["import",
...])`` in this process) and records what they do: the modules they import (the admitted
list), the files they read or write outside their source and output, the processes they
start; and what they write (a digest of every ``model/`` and ``optim/`` dataset). Then, for
each case, it forks a child that runs the same conversion on the mutated files in a fresh
scratch directory and checks, through ``sys.addaudithook``, that it:

- writes, removes, renames or creates nothing outside the scratch directory (blocked, and
  recorded; HDF5 writes from C are not seen here: the campaign's sentinel tree catches them);
- reads no file outside its source but those the unmutated conversion reads;
- starts no process but those the unmutated conversion starts (others are blocked);
- imports no module outside the admitted list;
- leaves the classes and module globals a pickle can reach as they were;

and what it wrote: the same datasets as the unmutated conversion, or (exit 2) nothing. A
child that runs past its time is killed (a hang). The child ends after its case, so nothing
one case does is seen by the next.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import resource
import select
import signal
import sys
import time
import traceback
import types

PROCESS_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn",
                  "os.fork", "os.forkpty", "pty.spawn")
# event -> the positions of its arguments that are paths it creates, changes or removes
CHANGE_EVENTS = {"os.remove": (0,), "os.rename": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,),
                 "shutil.rmtree": (0,), "os.truncate": (0,), "os.chmod": (0,),
                 "os.chown": (0,), "os.utime": (0,), "os.link": (1,), "os.symlink": (1,),
                 "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (0, 1),
                 "os.mkfifo": (0,), "os.mknod": (0,)}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
MEMORY_HEADROOM = 4 << 30  # a case may map this much beyond the worker (RLIMIT_AS)
FILE_LIMIT = 256 << 20  # and write files up to this size (RLIMIT_FSIZE)
CHECKS_S = 30.0  # the checks after a conversion may take this long


def _path(value) -> str | None:
    """An audited path argument as an absolute real path (None for file descriptors)."""
    if isinstance(value, int) or value is None:
        return None
    try:
        p = os.fsdecode(os.fspath(value))
    except TypeError:
        return None
    return os.path.realpath(os.path.join(os.getcwd(), p))


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


class Watch:
    """The audit hook's state: ``mode`` off, learn (an unmutated conversion: what it does is
    admitted) or check (a case: what the unmutated conversions did not do is recorded, and
    process starts and changes outside ``scratch`` are refused)."""

    def __init__(self):
        self.mode = "off"
        self.scratch, self.source = "", ""
        self.modules: set[str] = set()
        self.reads: set[str] = set()
        self.writes: set[str] = set()
        self.processes: set[str] = set()
        import hpctrain  # its own sources (read for tracebacks), Python's, site-packages'

        code = [os.path.dirname(hpctrain.__file__), sys.prefix, sys.base_prefix,
                sys.exec_prefix, *(p for p in sys.path if "-packages" in p or
                                   p.startswith((sys.prefix, sys.base_prefix)))]
        self.system = sorted({os.path.realpath(p) for p in code})
        self.seen: list[tuple[str, str]] = []

    def arm(self, mode: str, scratch: str, source: str) -> None:
        self.scratch, self.source = os.path.realpath(scratch), os.path.realpath(source)
        self.seen, self.mode = [], mode

    def hook(self, event: str, args) -> None:
        if self.mode == "off":
            return
        try:
            self._event(event, args)
        except PermissionError:
            raise
        except Exception as e:  # noqa: BLE001 - the hook must not break what it watches
            self.seen.append(("hook", f"{event}: {e!r}"[:200]))

    def _event(self, event: str, args) -> None:
        if event == "import":
            self._import(args[0])
        elif event == "open":
            self._open(args)
        elif event in CHANGE_EVENTS:
            for i in CHANGE_EVENTS[event]:
                self._change(event, _path(args[i]) if len(args) > i else None)
        elif event.startswith(PROCESS_EVENTS):
            self._process(event, args)

    def _import(self, name) -> None:
        if self.mode == "learn":
            self.modules.add(name)
        elif name not in self.modules:
            self.seen.append(("import", str(name)))

    def _open(self, args) -> None:
        path, mode, flags = (tuple(args) + (None, None))[:3]
        path = _path(path)
        if path is None or _under(path, [self.scratch]):
            return
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
            (isinstance(flags, int) and flags & WRITE_FLAGS)
        if writing:
            self._change("open for writing", path)
        elif _under(path, [self.source, *self.system]):
            return
        elif self.mode == "learn":
            self.reads.add(path)
        elif path not in self.reads:
            self.seen.append(("read", path))

    def _change(self, event: str, path: str | None) -> None:
        if path is None or _under(path, [self.scratch]):
            return
        if self.mode == "learn":
            self.writes.add(path)
        elif path not in self.writes:
            self.seen.append(("write", f"{event} {path}"))
            raise PermissionError(f"fuzz worker: {event} {path} outside the scratch directory")

    def _process(self, event: str, args) -> None:
        what = f"{event} {' '.join(map(str, args[1])) if event == 'subprocess.Popen' else args}"
        if self.mode == "learn":
            self.processes.add(what)
        elif what not in self.processes:
            self.seen.append(("process", what[:300]))
            raise PermissionError(f"fuzz worker: {what[:100]} refused")


WATCH = Watch()


def module_state(mod) -> dict:
    """Every global of module ``mod``: name -> (the object, its attributes when it is a
    class or function: name -> object); compared by identity."""
    d = getattr(mod, "__dict__", None)
    return {key: (value, dict(value.__dict__) if isinstance(
        value, (type, types.FunctionType)) else None)
        for key, value in (list(d.items()) if isinstance(d, dict) else ())}


def reachable_state() -> dict[str, dict]:
    """module name -> :func:`module_state`, of every loaded module."""
    return {name: module_state(mod) for name, mod in list(sys.modules.items())}


def names_in(paths) -> tuple[set[str], set[str]]:
    """(loaded modules, other words) a file among ``paths`` writes out. A pickle reaches a
    class, function or module only by its module's name and its own, both spelled out in
    the file (zip records are read out of their archive)."""
    import re
    import zipfile
    from _compat_pickle import IMPORT_MAPPING

    blobs = []
    for path in paths:
        with contextlib.suppress(OSError), open(path, "rb") as f:
            blobs.append(f.read())
        with contextlib.suppress(Exception), zipfile.ZipFile(path) as z:
            blobs += [z.read(n) for n in z.namelist()]
    found = {w.decode() for b in blobs
             for w in re.findall(rb"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*", b)}
    dotted = found | {w[1:] for w in found}  # GLOBAL's "c" (INST's "i") before the module
    dotted |= {IMPORT_MAPPING[w] for w in dotted if w in IMPORT_MAPPING}
    return {w for w in dotted if w in sys.modules}, {p for w in dotted for p in w.split(".")}


def state_changes(before: dict, volatile: frozenset, modules: set[str],
                  words: set[str] | None = None) -> list[str]:
    """The globals of ``modules`` named in ``words`` (all of them when None), and the
    attributes of those that are classes or functions, that are not the objects they were
    in ``before``; a global that is a module is looked into the same way. Only those are
    read: reading every module in a forked process would copy it."""
    changed, todo, seen = [], sorted(modules), set(modules)
    while todo:
        name = todo.pop()
        then, mod = before.get(name, {}), sys.modules[name].__dict__
        keys = set(then) | set(mod)
        for key in keys if words is None else keys & words:
            old, attrs = then.get(key, (KeyError, None))
            new = mod.get(key, KeyError)
            if new is not old:
                changed.append(f"{name}.{key}")
            elif attrs is not None:
                now = new.__dict__
                changed += [f"{name}.{key}.{a}" for a in set(attrs) | set(now)
                            if now.get(a, KeyError) is not attrs.get(a, KeyError)]
            inner = getattr(new, "__name__", None) if isinstance(new, types.ModuleType) else None
            if inner in before and inner not in seen:
                seen.add(inner)
                todo.append(inner)
    return sorted(c for c in changed if c not in volatile)


def digests(out: str) -> dict[str, str] | None:
    """{dataset: sha256 of its bytes} of every model/ and optim/ dataset of the checkpoint
    an import wrote at ``out`` (a directory with ``latest``); None when there is none."""
    import h5py

    latest = os.path.join(out, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        path = os.path.join(out, f.read().strip())
    if not os.path.isfile(path):
        return None
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, hashlib.sha256(
            obj[()].tobytes()).hexdigest()) if isinstance(obj, h5py.Dataset)
            and name.startswith(("model/", "optim/")) else None)
    return found


def values(out: str):
    """Every value of the model/ and optim/ datasets of the checkpoint at ``out``, unique."""
    import h5py
    import numpy as np

    with open(os.path.join(out, "latest")) as f, \
            h5py.File(os.path.join(out, f.read().strip()), "r") as h:
        arrays = []
        h.visititems(lambda name, obj: arrays.append(np.ravel(obj[()]).astype(np.float64))
                     if isinstance(obj, h5py.Dataset) and name.startswith(("model/", "optim/"))
                     else None)
    return np.unique(np.concatenate(arrays))


class Baseline:
    """What the unmutated conversion of one fixture wrote."""

    def __init__(self, out: str):
        self.digests = digests(out)
        self.values = values(out)

    def compare(self, out: str) -> dict:
        """The checkpoint at ``out`` against this one: {"same": bool, ...details}."""
        got = digests(out)
        if got is None:
            return {"same": False, "what": "exit 0 but no checkpoint written"}
        differ = sorted(k for k in set(got) | set(self.digests)
                        if got.get(k) != self.digests.get(k))
        if not differ:
            return {"same": True}
        return {"same": False, **self._describe(out, differ, got)}

    def _describe(self, out: str, differ: list[str], got: dict) -> dict:
        """Which datasets differ, and how many values the unmutated import does not hold
        (uninitialised memory, bytes read as another dtype, another file's)."""
        import numpy as np

        new = values(out)
        foreign = new[~np.isin(new, self.values)]
        missing = [k for k in differ if k not in got]
        extra = [k for k in differ if k not in self.digests]
        kinds = sorted({k.split("/")[0] for k in differ})
        shown = ", ".join(f"{v:.3g}" for v in foreign[:3])
        return {"what": f"{len(differ)} {'/'.join(kinds)} datasets differ (e.g. {differ[0]}; "
                        f"{len(missing)} missing, {len(extra)} extra); {len(foreign)} values "
                        f"not in the unmutated import{f' (e.g. {shown})' if shown else ''}"}


@contextlib.contextmanager
def captured(directory: str):
    """File descriptors 1 and 2 (C libraries' output too) into ``directory``/stdout, stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def read_text(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def convert(cmd: dict, mode: str) -> dict:
    """Run one conversion (``cmd``: argv, scratch, source) under the audit hook in ``mode``;
    its exit status, escaped exception, output, what the hook saw, seconds."""
    from hpctrain.__main__ import main

    home = os.getcwd()
    os.chdir(cmd["scratch"])
    t0, rc, exc = time.perf_counter(), None, None
    with captured(cmd["scratch"]):
        WATCH.arm(mode, cmd["scratch"], cmd["source"])
        try:
            rc = main(list(cmd["argv"]))
        except BaseException:  # noqa: BLE001 - what escapes is the finding
            exc = traceback.format_exc(limit=-6)[-3000:]
        finally:
            WATCH.mode = "off"
            os.chdir(home)
    seen = list(dict.fromkeys(WATCH.seen))
    return {"rc": rc, "exception": exc, "seen": seen, "seconds": time.perf_counter() - t0,
            "stdout": read_text(os.path.join(cmd["scratch"], "stdout")),
            "stderr": read_text(os.path.join(cmd["scratch"], "stderr"))}


class Zygote:
    """The long-lived worker: learns from the unmutated conversions, then forks a child per
    case."""

    def __init__(self):
        self.baselines: dict[str, Baseline] = {}
        self.state: dict | None = None
        self.volatile: set = set()

    def learn(self, cmd: dict) -> dict:
        """An unmutated conversion, in this process (what it imports stays loaded for the
        children): admitted everything it does; its checkpoint is the kind's baseline."""
        res = convert(cmd, "learn")
        if res["rc"] != 0:
            return {**res, "ok": False}
        self.baselines[cmd["kind"]] = Baseline(cmd["out"])
        WATCH.modules |= set(sys.modules)
        if self.state is not None:  # what an unmutated conversion changes is not a finding
            self.volatile |= set(state_changes(self.state, frozenset(),
                                               set(self.state) & set(sys.modules)))
        self.state = reachable_state()
        gc.freeze()  # the children's collections leave these objects alone (no copies)
        return {"ok": True, "seconds": res["seconds"], "modules": len(WATCH.modules),
                "reads": sorted(WATCH.reads), "writes": sorted(WATCH.writes),
                "processes": sorted(WATCH.processes), "volatile": sorted(self.volatile)}

    def child(self, cmd: dict, fd: int) -> None:
        """The forked child: one case, its checks, the result on ``fd``; never returns."""
        marked = False
        try:
            limit_resources()
            res = convert(cmd, "check")
            os.write(fd, b"converted\n")
            marked = True
            res["modules"] = sorted(set(sys.modules) - WATCH.modules)
            res["state"] = state_changes(self.state, frozenset(self.volatile),
                                         *names_in(cmd["files"]))
            res["out_exists"] = os.path.lexists(cmd["out"])
            if res["rc"] == 0:
                res["model"] = self.baselines[cmd["kind"]].compare(cmd["out"])
            payload = json.dumps(res, default=str).encode()
        except BaseException:  # noqa: BLE001 - the checks failed: say why
            payload = (b"" if marked else b"converted\n") + json.dumps(
                {"error": traceback.format_exc()[-3000:]}).encode()
        while payload:
            payload = payload[os.write(fd, payload):]
        os._exit(0)

    def case(self, cmd: dict) -> dict:
        """Fork a child for case ``cmd``; kill it when its conversion runs past
        ``cmd["timeout"]`` seconds (a hang) or its checks past CHECKS_S more."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            self.child(cmd, w)
        os.close(w)
        data, deadline, converted = b"", time.monotonic() + cmd["timeout"], False
        while True:
            ready, _, _ = select.select([r], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(r, 1 << 16) if ready else None
            if not chunk:
                break
            data += chunk
            if not converted and b"\n" in data:
                converted, deadline = True, time.monotonic() + CHECKS_S
        os.close(r)
        if chunk is None:  # past its time
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"hang": True, "after": "checks" if converted else "conversion"}
        _, status = os.waitpid(pid, 0)
        body = data.split(b"\n", 1)[1] if converted else b""
        if os.WIFSIGNALED(status) or not body:
            why = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else \
                f"exit {os.WEXITSTATUS(status)}"
            return {"died": f"the case's process died ({why}) without a result"}
        return json.loads(body)


def limit_resources() -> None:
    """A case may map MEMORY_HEADROOM more than the worker, write files up to FILE_LIMIT
    (beyond: an error, not a signal), and dumps no core."""
    with open("/proc/self/status") as f:
        size = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + MEMORY_HEADROOM,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def serve() -> int:
    """Answer the campaign's commands (one JSON line each: ``learn`` or ``case``) until
    stdin closes. Stray output of this process goes to stderr (the worker's log)."""
    import h5py  # noqa: F401 - what every conversion uses, loaded while the campaign starts
    import torch
    import torch.distributed.checkpoint  # noqa: F401

    import hpctrain.__main__  # noqa: F401

    torch.set_num_threads(1)
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.addaudithook(WATCH.hook)
    zygote = Zygote()
    for line in sys.stdin:
        cmd = json.loads(line)
        res = zygote.learn(cmd) if cmd["op"] == "learn" else zygote.case(cmd)
        reply.write(json.dumps({"id": cmd.get("id"), **res}, default=str) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
