"""hpctrain: an actor-free MPI trainer for large neural networks on supercomputers."""

__version__ = "0.1.0"
