"""Published checkpoints (safetensors, Hugging Face's layout) into a ZeRO layout, and back out.

`load_safetensors` reads each parameter's slices that this process's devices hold, straight
from the files, in the plan's layout: no device and no host holds the whole model. A name map
says where each leaf comes from (`Tensor`: a checkpoint name, PyTorch's (out, in) `Linear`
layout transposed, per-layer tensors stacked into a scanned layer axis); nothing is guessed, and
everything that does not fit is refused before anything is placed. `save_safetensors` writes
parameters back in the same names and layout, one tensor in host memory at a time.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from zerojax._src import plan as plan_lib
from zerojax._src import transform, validation

LOG = logging.getLogger('zerojax')
LAYER = '{layer}'
INDEX = 'model.safetensors.index.json'
SINGLE = 'model.safetensors'


@dataclasses.dataclass(frozen=True)
class Tensor:
  """Where one parameter leaf lives in a published checkpoint.

  Attributes:
    name: the checkpoint tensor's name, e.g. `'bert.pooler.dense.bias'`. With `'{layer}'` in
      it, the leaf is a stack of per-layer tensors along its leading (layer) axis: layer i is
      the tensor named with i in its place.
    transpose: the checkpoint holds the leaf transposed (its dimensions reversed): PyTorch's
      `nn.Linear` weight is (out, in) where Flax's `Dense` kernel is (in, out). GPT-2's
      `Conv1D` weights are (in, out) already.

  >>> Tensor('bert.encoder.layer.{layer}.attention.self.query.weight', transpose=True).stacked
  True
  """

  name: str
  transpose: bool = False

  @property
  def stacked(self) -> bool:
    return LAYER in self.name

  def names(self, layers: int) -> list[str]:
    """The checkpoint names this leaf reads: one, or one per layer."""
    return (
      [self.name.replace(LAYER, str(i)) for i in range(layers)] if self.stacked else [self.name]
    )


NameMap = Mapping[str, Tensor | str] | Callable[[str], Tensor | str | None]


def leaf_name(path: tuple) -> str:
  """A leaf's key path as the name maps spell it: keys joined by '/', e.g. 'encoder/query/kernel'."""
  return '/'.join(str(validation.key_name(k)) for k in path)


# ---------------------------------------------------------------------------------------------
# The checkpoint's files and headers.


@dataclasses.dataclass(frozen=True)
class _Entry:
  file: str
  shape: tuple[int, ...]
  dtype: np.dtype


def _safetensors():
  try:
    import safetensors
  except ImportError as e:
    e.add_note("Published checkpoints need the safetensors package: pip install 'zerojax[hf]'.")
    raise
  return safetensors


def _files(path: str) -> tuple[list[str], dict[str, str] | None]:
  """The checkpoint's files, and the index's name -> file map (None without an index)."""
  if os.path.isdir(path):
    for candidate in (INDEX, SINGLE):
      if os.path.exists(os.path.join(path, candidate)):
        return _files(os.path.join(path, candidate))
    raise FileNotFoundError(
      f'`path`={path!r} holds neither {SINGLE} nor {INDEX}: pass a Hugging Face model folder,'
      ' a .safetensors file or its index.'
    )
  if not os.path.exists(path):
    raise FileNotFoundError(f'`path`={path!r} does not exist.')
  if not path.endswith('.json'):
    return [path], None
  with open(path) as f:
    weight_map = json.load(f).get('weight_map')
  if not isinstance(weight_map, dict):
    raise ValueError(f'{path} has no "weight_map": it is not a safetensors index.')
  folder = os.path.dirname(path)
  files = sorted(set(weight_map.values()))
  missing = [f for f in files if not os.path.exists(os.path.join(folder, f))]
  if missing:
    lost = {f: [n for n, g in weight_map.items() if g == f] for f in missing}
    listing = '\n'.join(
      f'  {f}: {len(names)} tensors, e.g. {names[0]}' for f, names in lost.items()
    )
    raise FileNotFoundError(
      f'{len(missing)} shard file(s) named in {path} are missing from {folder}:\n{listing}\n'
      'Download the whole checkpoint folder again.'
    )
  return [os.path.join(folder, f) for f in files], weight_map


def read_headers(path: str) -> dict[str, _Entry]:
  """Every tensor's file, shape and dtype, from the safetensors headers only.

  Raises:
    FileNotFoundError: the path, or a shard file its index names, does not exist.
    safetensors.SafetensorError: a file is truncated or corrupted (with a note naming it).
  """
  st = _safetensors()
  entries = {}
  files, weight_map = _files(path)
  for file in files:
    try:
      with st.safe_open(file, framework='np') as f:
        for name in f.keys():
          piece = f.get_slice(name)
          entries[name] = _Entry(file, tuple(piece.get_shape()), _np_dtype(piece.get_dtype()))
    except st.SafetensorError as e:
      e.add_note(f'{file} is truncated or corrupted: download it again.')
      raise
  if weight_map is not None:
    absent = sorted(set(weight_map) - set(entries))
    if absent:
      raise ValueError(
        f'{len(absent)} tensor(s) the index names are in none of its files, e.g. {absent[0]!r}'
        f' (said to be in {weight_map[absent[0]]}): the shard files do not match the index;'
        ' download the checkpoint again.'
      )
  return entries


def read_tensor_names(path: str | os.PathLike) -> list[str]:
  """The tensor names of a safetensors checkpoint (a folder, a file or an index), sorted,
  read from the headers alone: what a name map may check a checkpoint's spelling against.

  >>> import tempfile, numpy as np
  >>> from safetensors.numpy import save_file
  >>> folder = tempfile.mkdtemp()
  >>> save_file({'b': np.zeros(2), 'a': np.zeros(3)}, f'{folder}/model.safetensors')
  >>> read_tensor_names(folder)
  ['a', 'b']
  """
  return sorted(read_headers(os.fspath(path)))


_DTYPES = {
  'F64': 'float64',
  'F32': 'float32',
  'F16': 'float16',
  'BF16': 'bfloat16',
  'I64': 'int64',
  'I32': 'int32',
  'I16': 'int16',
  'I8': 'int8',
  'U8': 'uint8',
  'BOOL': 'bool',
}


def _np_dtype(name: str) -> np.dtype:
  import jax.numpy as jnp

  return jnp.dtype(_DTYPES.get(name, name.lower()))


# ---------------------------------------------------------------------------------------------
# Matching the model's leaves to the checkpoint's tensors.


@dataclasses.dataclass(frozen=True)
class _Source:
  """A model leaf and where it is read from."""

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  tensor: Tensor


def _resolve(names: NameMap, path: str) -> Tensor | None:
  found = names.get(path) if isinstance(names, Mapping) else names(path)
  return Tensor(found) if isinstance(found, str) else found


def _castable(src: np.dtype, dst: np.dtype) -> bool:
  kind = lambda d: 'f' if np.issubdtype(d, np.floating) or d.name == 'bfloat16' else d.kind
  return kind(src) == kind(dst) or (kind(src) in 'iu' and kind(dst) in 'iu')


def _check_leaf(leaf: _Source, entries: dict[str, _Entry]) -> list[str]:
  """What is wrong with reading `leaf` (empty when nothing is)."""
  t = leaf.tensor
  layers = leaf.shape[0] if t.stacked else 0
  if t.stacked and not leaf.shape:
    return [f'  {leaf.path}: {t.name!r} stacks layers, but the leaf is a scalar']
  want = leaf.shape[1:] if t.stacked else leaf.shape
  want = tuple(reversed(want)) if t.transpose else want
  problems = []
  for name in t.names(layers):
    entry = entries.get(name)
    where = f'  {name!r} -> {leaf.path}'
    if entry is None:
      problems.append(f'{where}: not in the checkpoint (the model expects shape {want})')
    elif entry.shape != want:
      hint = ''
      if entry.shape == tuple(reversed(want)) and len(want) >= 2:
        hint = f'; it matches transposed: Tensor({t.name!r}, transpose={not t.transpose})'
      problems.append(f'{where}: checkpoint shape {entry.shape}, model expects {want}{hint}')
    elif not _castable(entry.dtype, leaf.dtype):
      problems.append(
        f'{where}: checkpoint dtype {entry.dtype.name} cannot be cast to the model'
        f"'s {leaf.dtype.name}"
      )
  return problems


@dataclasses.dataclass(frozen=True)
class Matched:
  """The outcome of matching a model to a checkpoint, before anything is read.

  Attributes:
    sources: per model leaf path, where it is read from (leaves left at init absent).
    at_init: model leaf paths left at their initial values (`init=`).
    skipped: checkpoint tensors not read (`skip=`).
  """

  sources: dict[str, _Source]
  at_init: tuple[str, ...]
  skipped: tuple[str, ...]


def match(
  abstract: Any,
  entries: dict[str, _Entry],
  names: NameMap,
  *,
  skip: Sequence[str] = (),
  init: Sequence[str] = (),
) -> Matched:
  """Matches every model leaf to checkpoint tensors, collecting every problem into one error.

  Raises:
    ValueError: listing each checkpoint tensor the model has no place for, each model leaf
      the checkpoint lacks, each shape that does not match (and one that matches only
      transposed) and each dtype that cannot be cast, with the fix.
  """
  if isinstance(names, Mapping):
    paths = {leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    unknown = sorted(set(names) - paths)
    if unknown:
      raise ValueError(
        f'the name map has {len(unknown)} key(s) that are not model leaves, e.g.'
        f' {unknown[0]!r}; model leaves are spelled like {sorted(paths)[0]!r}.'
      )
  sources, at_init, problems, used = {}, [], [], set()
  for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    path = leaf_name(p)
    if any(fnmatch.fnmatchcase(path, pattern) for pattern in init):
      at_init.append(path)
      continue
    tensor = _resolve(names, path)
    if tensor is None:
      problems.append(f'  (none) -> {path}: the name map gives this model leaf no tensor')
      continue
    leaf = _Source(path, tuple(x.shape), np.dtype(x.dtype), tensor)
    problems += _check_leaf(leaf, entries)
    used.update(tensor.names(x.shape[0] if tensor.stacked and x.shape else 0))
    sources[path] = leaf
  unused = sorted(set(entries) - used)
  skipped = [n for n in unused if any(fnmatch.fnmatchcase(n, s) for s in skip)]
  problems += [
    f'  {n!r} -> (none): the model has no place for it (shape {entries[n].shape})'
    for n in unused
    if n not in skipped
  ]
  if problems:
    raise ValueError(
      f'the checkpoint does not fit the model ({len(problems)} problem(s)):\n'
      + '\n'.join(problems)
      + '\nFix the name map (zerojax.checkpoint.Tensor: name, transpose), or opt out by name:'
      ' `skip=[pattern, ...]` for checkpoint tensors not to read, `init=[pattern, ...]` for'
      ' model leaves to keep at their initial values (e.g. a new classification head).'
    )
  return Matched(sources, tuple(at_init), tuple(skipped))


# ---------------------------------------------------------------------------------------------
# Reading each device's slices.


def _source_index(tensor: Tensor, index: tuple[slice, ...]) -> tuple[slice, ...]:
  """The slice of one checkpoint tensor behind a leaf's `index` (its layer axis removed)."""
  return tuple(reversed(index)) if tensor.transpose else index


def _read_slice(entries, name: str, index: tuple[slice, ...], transpose: bool) -> np.ndarray:
  """Part of one checkpoint tensor, in the leaf's orientation. The file is opened for this read
  and closed after it: closing unmaps the pages the read touched, so they leave this
  process's resident memory."""
  with _safetensors().safe_open(entries[name].file, framework='np') as f:
    piece = np.asarray(f.get_slice(name)[index])
  return piece.T if transpose else piece


def _shard_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
  return tuple(len(range(n)[s]) for n, s in zip(shape, index))


def _read(entries, leaf: _Source, index: tuple[slice, ...]) -> np.ndarray:
  """The part `index` of a leaf, read from the files (only the bytes it covers) into one
  buffer of the leaf's dtype, a layer at a time for a stack."""
  t = leaf.tensor
  out = np.empty(_shard_shape(leaf.shape, index), leaf.dtype)
  if not t.stacked:
    out[...] = _read_slice(entries, t.name, _source_index(t, index), t.transpose)
    return out
  rest = _source_index(t, index[1:])
  for j, i in enumerate(range(leaf.shape[0])[index[0]]):
    out[j] = _read_slice(entries, t.name.replace(LAYER, str(i)), rest, t.transpose)
  return out


def _normalise(index: tuple, ndim: int) -> tuple[slice, ...]:
  return tuple(index) + (slice(None),) * (ndim - len(index))


def _place(entries, leaf: _Source, sharding) -> jax.Array:
  """One leaf as a global array in `sharding`, from this process's devices' slices only: each
  distinct slice read once, put on the devices that hold it, and dropped from host memory."""
  groups: dict[tuple, tuple[tuple[slice, ...], list]] = {}
  for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
    index = _normalise(index, len(leaf.shape))
    key = tuple((s.start, s.stop, s.step) for s in index)
    groups.setdefault(key, (index, []))[1].append(device)
  arrays = []
  for index, devices in groups.values():
    host = _read(entries, leaf, index)
    arrays += [jax.device_put(host, d) for d in devices]
    del host
  return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)


def _progress(leaves: list[_Source]) -> Iterator[_Source]:
  """The leaves, logged as they are placed (logger 'zerojax', INFO) with the bytes done."""
  total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves) or 1
  done = 0
  for i, leaf in enumerate(leaves):
    yield leaf
    done += math.prod(leaf.shape) * leaf.dtype.itemsize
    share = 100 * done / total
    LOG.info(
      'load_safetensors: %d/%d leaves (%.0f%% of the bytes), %s',
      i + 1,
      len(leaves),
      share,
      leaf.path,
    )


def load_safetensors(
  path: str | os.PathLike,
  init_fn: Callable[..., optax.Params],
  *init_args: Any,
  tx: optax.GradientTransformation,
  names: NameMap,
  skip: Sequence[str] = (),
  init: Sequence[str] = (),
  convert: Callable[[str, jax.Array], Any] | None = None,
) -> optax.Params:
  """Parameters from a safetensors checkpoint, placed directly in `tx`'s ZeRO layout.

  The model's structure, shapes and dtypes come from `init_fn(*init_args)`, evaluated
  abstractly (`jax.eval_shape`); the layout is `zerojax.plan_for(tx, ...)`'s `params`. Each
  process reads only the slices its own devices hold (safetensors reads part of a tensor
  without the rest), so at stage 3 a process holds about its devices' share of the model
  and one tensor's slice while loading. Checkpoint values are cast to the dtype the model's
  init gives (bf16 -> fp32, for example; float to int and back is refused).

  Strict: every model leaf must come from the checkpoint and every checkpoint tensor must
  go somewhere, with matching shapes; everything that does not is listed in one ValueError
  before anything is read. `skip` and `init` opt out by name, and what they left out is
  logged (logger 'zerojax', WARNING).

  Args:
    path: a Hugging Face model folder (`model.safetensors`, or shards listed in
      `model.safetensors.index.json`), a `.safetensors` file, or an index file.
    init_fn: returns the model's parameter tree, e.g. `lambda k: model.init(k, x)['params']`.
    *init_args: its arguments (e.g. a PRNG key).
    tx: the optimizer from `zerojax.zero_stage`: its stage and options decide the layout.
    names: for each model leaf, keyed by its path joined with '/' (`'encoder/query/kernel'`),
      the checkpoint tensor: a `Tensor`, or a name. A mapping, or a function of the path.
    skip: glob patterns of checkpoint tensors not to read (e.g. a pretraining head).
    init: glob patterns of model leaf paths kept at their value from `init_fn` (e.g. a new
      classification head); `init_fn` runs for those leaves only, in their layout.
    convert: `(leaf path, placed array) -> value`, applied to each leaf as soon as it is read
      (before the next is), so a leaf stored in another form (a quantized base weight) is
      never held beside the others at full precision.

  Returns:
    The parameter tree, each leaf a global `jax.Array` with the plan's sharding. A train
    state follows with `zerojax.create_train_state(lambda p: p, params, tx=tx)`.

  Raises:
    ValueError: the checkpoint does not fit the model (every problem listed, with the fix).
    FileNotFoundError: the path, or a shard file its index names, is missing.
    safetensors.SafetensorError: a file is truncated or corrupted (a note names it).
  """
  path = os.fspath(path)
  config = transform.config_of(tx)
  if config is None:
    raise TypeError(
      '`tx` must be the optimizer from zerojax.zero_stage (it holds the stage and layout), got'
      f' {type(tx).__name__}.'
    )
  abstract = jax.eval_shape(init_fn, *init_args)
  entries = read_headers(path)
  matched = match(abstract, entries, names, skip=skip, init=init)
  plan = plan_lib.plan_of(config, abstract)
  shardings = {leaf_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(plan.params)[0]}
  leaves = _progress(list(matched.sources.values()))
  done = convert or (lambda path, x: x)
  loaded = {
    leaf.path: done(leaf.path, _place(entries, leaf, shardings[leaf.path])) for leaf in leaves
  }
  if matched.at_init:
    loaded.update(_initial(init_fn, init_args, matched.at_init, shardings))
  _log_opt_outs(matched)
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  return jax.tree.unflatten(treedef, [loaded[leaf_name(p)] for p, _ in flat])


def read_placed(path: str | os.PathLike, abstract: Any, shardings: Any, names: NameMap) -> Any:
  """The leaves of `abstract` (ShapeDtypeStructs) read from the safetensors at `path` into
  `shardings` (a tree of `abstract`'s structure), as strictly as `load_safetensors`: every
  leaf from the file and every tensor of the file to a leaf, each problem listed in one
  ValueError before anything is read; each process reads its devices' slices."""
  entries = read_headers(os.fspath(path))
  matched = match(abstract, entries, names)
  flat_shardings = {leaf_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
  loaded = {
    leaf.path: _place(entries, leaf, flat_shardings[leaf.path]) for leaf in matched.sources.values()
  }
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  return jax.tree.unflatten(treedef, [loaded[leaf_name(p)] for p, _ in flat])


def _initial(init_fn, init_args, paths: tuple[str, ...], shardings) -> dict[str, jax.Array]:
  """The leaves at `paths` from `init_fn`, computed in their layout (the rest is unused and
  the compiler drops it)."""

  def pick(*args):
    tree = init_fn(*args)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {leaf_name(p): x for p, x in flat if leaf_name(p) in paths}

  return jax.jit(pick, out_shardings={p: shardings[p] for p in paths})(*init_args)


def _log_opt_outs(matched: Matched) -> None:
  # The caller named both lists (skip=, init=): said, not warned of.
  if matched.skipped:
    LOG.info(
      'load_safetensors: %d checkpoint tensor(s) not read (skip=): %s',
      len(matched.skipped),
      ', '.join(matched.skipped),
    )
  if matched.at_init:
    LOG.info(
      'load_safetensors: %d model leaf(s) left at their initial values (init=): %s',
      len(matched.at_init),
      ', '.join(matched.at_init),
    )


# ---------------------------------------------------------------------------------------------
# Writing parameters back out.


def _host_value(x: jax.Array) -> np.ndarray:
  """One leaf whole in this process's memory (an all-gather across processes if it spans
  several): one tensor at a time, never the model."""
  if getattr(x, 'is_fully_addressable', True):
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _tensors_of(params: Any, names: NameMap) -> Iterator[tuple[str, np.ndarray]]:
  """(checkpoint name, value) for each tensor the map gives the parameters, in tree order."""
  for p, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    path = leaf_name(p)
    tensor = _resolve(names, path)
    if tensor is None:
      raise ValueError(f'the name map gives the model leaf {path} no tensor name to save it as.')
    value = _host_value(x)
    layers = value.shape[0] if tensor.stacked else 0
    parts = [value[i] for i in range(layers)] if tensor.stacked else [value]
    for name, part in zip(tensor.names(layers), parts):
      yield name, np.ascontiguousarray(part.T if tensor.transpose else part)


def save_safetensors(
  params: Any,
  directory: str | os.PathLike,
  *,
  names: NameMap,
  max_shard_bytes: int = 1 << 30,
  file_name: str = SINGLE,
) -> list[str]:
  """Writes parameters as safetensors in a checkpoint's names and layout: the map inverted.

  Each tensor is brought whole into host memory on its own (across processes, an all-gather
  of that tensor), and tensors go into shard files of at most `max_shard_bytes` listed in a
  `model.safetensors.index.json`, as Hugging Face shards checkpoints (`model.safetensors`
  alone when everything fits in one). Only process 0 writes; every process must call it.
  The files read back with `load_safetensors` and with the `safetensors` library alone.

  Args:
    params: the parameter tree (any layout).
    directory: where to write; created if missing. Each file appears only once complete.
    names: the same name map `load_safetensors` takes.
    max_shard_bytes: the largest shard file, in tensor bytes.
    file_name: the file's name when one holds everything (PEFT's adapters:
      'adapter_model.safetensors').

  Returns:
    The files written (on process 0; empty elsewhere).
  """
  directory = os.fspath(directory)
  tensors = _tensors_of(params, names)
  if jax.process_index() != 0:
    for _ in tensors:  # the all-gathers of multi-process leaves need every process
      pass
    return []
  os.makedirs(directory, exist_ok=True)
  current: dict[str, np.ndarray] = {}
  written_names: list[list[str]] = []  # the tensors of each shard written so far
  size = total = 0
  for name, value in tensors:
    if size and size + value.nbytes > max_shard_bytes:
      written_names.append(list(current))
      _write(current, directory, f'model-{len(written_names):05d}.safetensors')
      current, size = {}, 0
    current[name] = value
    size += value.nbytes
    total += value.nbytes
  if not written_names:
    return [_write(current, directory, file_name)]
  written_names.append(list(current))
  count = len(written_names)
  files = [f'model-{i + 1:05d}-of-{count:05d}.safetensors' for i in range(count)]
  written = _rename_shards(directory, count, files)
  written.append(_write(current, directory, files[-1]))
  weight_map = {n: file for names, file in zip(written_names, files) for n in names}
  _write_index(directory, weight_map, total)
  return written


def _write(tensors: dict[str, np.ndarray], directory: str, name: str) -> str:
  """One safetensors file, written under a temporary name and renamed once complete."""
  target = os.path.join(directory, name)
  _safetensors()  # names the extra to install when it is missing
  from safetensors.numpy import save_file

  save_file(tensors, target + '.partial', metadata={'format': 'pt'})
  os.replace(target + '.partial', target)
  return target


def _rename_shards(directory: str, count: int, files: list[str]) -> list[str]:
  """Gives the shards written before their count was known their final names."""
  out = []
  for i in range(count - 1):
    os.replace(
      os.path.join(directory, f'model-{i + 1:05d}.safetensors'), os.path.join(directory, files[i])
    )
    out.append(os.path.join(directory, files[i]))
  return out


def _write_index(directory: str, weight_map: dict[str, str], total: int) -> None:
  target = os.path.join(directory, INDEX)
  with open(target + '.partial', 'w') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  os.replace(target + '.partial', target)
