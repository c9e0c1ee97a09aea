"""Several processes on JAX's own runtime (`jax.distributed`).

- `initialize(...)`: joins the processes of a run (a TPU pod, SLURM, Open MPI,
  or an explicit coordinator address), with clear errors when they do not meet.
- `check_mesh(mesh)`: a mesh that uses every device of every process once.
- `process_batch_slice(global_batch_size)`: this process's rows of a batch.
- `global_batch(local_batch, mesh)`: one global array from each process's rows.
- `to_numpy(tree)`: whole values on every process (for logging and checks).
"""

from zerojax._src.distributed import check_mesh as check_mesh
from zerojax._src.distributed import global_batch as global_batch
from zerojax._src.distributed import initialize as initialize
from zerojax._src.distributed import process_batch_slice as process_batch_slice
from zerojax._src.distributed import to_numpy as to_numpy

__all__ = ['initialize', 'check_mesh', 'process_batch_slice', 'global_batch', 'to_numpy']
