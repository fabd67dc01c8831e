"""What the GPU check runs on, as one JSON line (run under ``mpirun -n 1 python -m mpi4py``).

``mpi_cuda_support`` asks the MPI library mpi4py actually loaded (found in /proc/self/maps:
mpi4py 4 wheels open it RTLD_LOCAL, so a global symbol lookup does not see it) for
``MPIX_Query_cuda_support()``; ``hpctrain_auto_aware`` is what ``hpctrain.comm.gpu`` decides by
itself when ``HPCTRAIN_GPU_AWARE_MPI`` is unset. Usage: probe.py cuda|cpu
"""

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys

import mpi4py
import torch
from mpi4py import MPI

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
info = {"python": sys.version.split()[0], "host": platform.node(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda}
if device == "cuda":
    if not torch.cuda.is_available():
        raise SystemExit("probe: torch sees no CUDA device")
    p = torch.cuda.get_device_properties(0)
    info["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True)
        info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
info["mpi4py"] = f"{mpi4py.__version__} ({os.path.dirname(mpi4py.__file__)})"
info["mpi_library"] = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
libs = sorted({line.split()[-1] for line in open("/proc/self/maps")
               if "/libmpi.so" in line or "/libmpi_" in line})
info["libmpi"] = ", ".join(libs) or "?"
support: object = "unknown"
for lib in libs or [None]:
    try:
        support = bool(ctypes.CDLL(lib).MPIX_Query_cuda_support())
        break
    except (OSError, AttributeError) as e:
        support = f"no MPIX_Query_cuda_support ({e.__class__.__name__})"
info["mpi_cuda_support"] = support
saved = os.environ.pop("HPCTRAIN_GPU_AWARE_MPI", None)
from hpctrain.comm import gpu  # noqa: E402

auto = gpu.query()
info["hpctrain_auto_aware"] = auto.aware
info["hpctrain_aware_decided_by"] = auto.decided_by
if saved is not None:
    os.environ["HPCTRAIN_GPU_AWARE_MPI"] = saved
try:
    import cupy

    info["cupy"] = cupy.__version__
except ImportError:
    info["cupy"] = "not installed (torch's __cuda_array_interface__ is used)"
import h5py  # noqa: E402

info["h5py"] = f"{h5py.__version__}, mpi={h5py.get_config().mpi}" + (
    "" if h5py.get_config().mpi else " (checkpoints: serial writer)")
if os.environ.get("HPCTRAIN_CKPT_SERIAL"):
    info["HPCTRAIN_CKPT_SERIAL"] = os.environ["HPCTRAIN_CKPT_SERIAL"]
mpirun = shutil.which("mpirun")
info["mpirun"] = mpirun or "?"
print(json.dumps(info), flush=True)
