"""A job's life outside the training loop: starting ranks with the machine's launcher
(``launch``: Open MPI ``mpirun``, Hydra ``mpiexec``, ``srun``), relaunching a failed job step on
the nodes left (``relaunch``) and the SLURM job itself (``slurm``: launch check, signals,
requeue, its end time). Nothing here imports torch; ``launch`` and ``relaunch`` use the
standard library only, so ``python -m hpctrain.job.launch`` starts in milliseconds."""
