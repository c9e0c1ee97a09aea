"""Checkpoints with orbax: save sharded state, restore it onto any device count.

- `Checkpointer(directory)`: saves and restores a train state (asynchronously,
  every process writing its own shards), with its plan's metadata.
- `restore_train_state(directory, init_fn, *init_args, tx=...)`: a train state
  restored straight into `tx`'s layout.
- `export_params(params, path)`: whole parameters, for use without zerojax.
- `format_checkpoint(directory)`: what a checkpoint folder holds (also
  `python -m zerojax inspect`).
- `load_safetensors(path, init_fn, *init_args, tx=..., names=...)`: a published
  checkpoint (safetensors, Hugging Face's layout) read straight into `tx`'s layout, each
  process reading only its devices' slices; `Tensor` says where a leaf comes from.
- `save_safetensors(params, directory, names=...)`: parameters written back in that
  checkpoint's names and layout, one tensor at a time.
- `Preempted`: what `Checkpointer.save` raises once the checkpoint of a
  preemption notice is committed (`save_on_preemption=True`): a SystemExit
  with `PREEMPTED_EXIT_CODE` (143).
"""

from zerojax._src.checkpoint import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from zerojax._src.checkpoint import Checkpointer as Checkpointer
from zerojax._src.checkpoint import Preempted as Preempted
from zerojax._src.checkpoint import export_params as export_params
from zerojax._src.checkpoint import format_checkpoint as format_checkpoint
from zerojax._src.checkpoint import restore_train_state as restore_train_state
from zerojax._src.pretrained import Tensor as Tensor
from zerojax._src.pretrained import load_safetensors as load_safetensors
from zerojax._src.pretrained import read_tensor_names as read_tensor_names
from zerojax._src.pretrained import save_safetensors as save_safetensors

__all__ = [
  'Checkpointer',
  'restore_train_state',
  'export_params',
  'format_checkpoint',
  'load_safetensors',
  'save_safetensors',
  'read_tensor_names',
  'Tensor',
  'Preempted',
  'PREEMPTED_EXIT_CODE',
]
