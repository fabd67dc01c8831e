# jobs/site.example.sh -- a site's settings, to fill in once: copy it to
# ~/.config/hpctrain/site.sh (or anywhere, with HPCTRAIN_SITE=/path/to/file in the
# environment of sbatch and of the job). It lives outside the checkout: `git pull` keeps it.
# Read twice:
#   1. by your login shell before submitting:   source ~/.config/hpctrain/site.sh
#      (or from ~/.bashrc): sbatch takes the SBATCH_* variables below as if they were
#      options (the command line still wins);
#   2. by every job (jobs/env.sh sources it first): modules, scratch, MPI settings.
# Everything here is optional; a line left commented out keeps the default.

# -- Submission: what most sites require (ask your centre, or see `sacctmgr show assoc
# user=$USER` and `sinfo -s`). Exported so that sbatch sees them.
# export SBATCH_ACCOUNT=project123        # --account: the allocation the hours come from
# export SBATCH_PARTITION=batch           # --partition (GPU nodes are often a partition)
# export SBATCH_QOS=normal                # --qos
# Cores per rank: sbatch reads no variable for --cpus-per-task; give it on the command line
# (sbatch --cpus-per-task=N ...; jobs/gpu.sbatch asks for 8: the node's cores / its GPUs).
# export SBATCH_EXPORT=NONE               # sites that want it: templates take their input
                                          # as arguments (jobs/env.sh), so CONFIG survives

# -- Scratch: where runs go when RUN_DIR is not set. $SCRATCH wins when the site defines it;
# otherwise runs go to $HPCTRAIN_SCRATCH/hpctrain-runs/<run name>; with neither, to runs/
# in the submit directory (with a warning: home quotas are small).
# HPCTRAIN_SCRATCH=/lustre/project123/$USER

# -- Modules: the MPI, parallel HDF5 and Python that the venv was built with (`make setup`;
# docs/slurm.md has a row per MPI family), and CUDA on GPU nodes, e.g.
# module load openmpi/4.1 hdf5/1.14-parallel python/3.11 cuda/12.4
# HPCTRAIN_MODULES="openmpi/4.1 hdf5/1.14-parallel python/3.11"   # the same, as a list

# -- MPI and binding (jobs/env.sh documents each; the defaults fit most sites):
# SRUN_MPI=pmix                           # srun --mpi= plugin (`srun --mpi=list`)
# CPU_BIND=cores                          # srun --cpu-bind=; empty: the site's default
# PYTHON=/path/to/venv/bin/python         # default: python3 with hpctrain, else the checkout's .venv
# export MPICH_GPU_SUPPORT_ENABLED=1      # GPU-aware MPI settings: docs/slurm.md
