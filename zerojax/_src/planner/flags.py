"""The command line's flags and their checks: `python -m zerojax plan`'s (a plan, a search),
`estimate`'s and `inspect`'s parsers, and what a flag's value must be."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zerojax._src.options import OFFLOADS, UPDATE_ON
from zerojax._src.planner import candidates, presets, program_cache, roofline, tpu
from zerojax._src.planner.candidates import LEAN_SHARE, SCHEDULER_OPTION
from zerojax._src.planner.lowering import SLICE, TENSOR

# HBM per chip, GiB, by the topology name's prefix.
OPTIMIZERS = ('adam', 'adamw', 'sgd', 'lion', 'adafactor')


def optimizer(name: str, lr: float = 1e-4):
  return {
    'adam': lambda: optax.adam(lr),
    'adamw': lambda: optax.adamw(lr),
    'sgd': lambda: optax.sgd(lr, momentum=0.9),
    'lion': lambda: optax.lion(lr),
    'adafactor': lambda: optax.adafactor(lr),
  }[name]()


def _positive_int(text: str) -> int:
  """An argparse type: a whole number of at least 1 (a batch, a length, a chunk)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'expected a whole number >= 1, got {text!r}') from None
  if value < 1:
    raise argparse.ArgumentTypeError(f'expected a whole number >= 1, got {value}')
  return value


def _count(text: str) -> int:
  """An argparse type: a count of at least 1, written as an integer or in e-notation (7e9)."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'expected a count such as 7e9, got {text!r}') from None
  if not (math.isfinite(value) and value >= 1 and value == int(value)):
    raise argparse.ArgumentTypeError(f'expected a whole count >= 1 such as 7e9, got {text!r}')
  return int(value)


def _csv(kind):
  def parse(text: str):
    try:
      return tuple(kind(v.strip()) for v in text.split(',') if v.strip())
    except ValueError:
      raise argparse.ArgumentTypeError(f'expected a comma-separated list, got {text!r}') from None

  return parse


def _none_or(choices):
  """A parser for one of `choices`, where 'none' on the command line is None in zerojax (no
  offload, no quantization)."""

  def parse(text: str) -> str | None:
    if text != 'none' and text not in choices:
      raise argparse.ArgumentTypeError(
        f'unknown {text!r}; choose from {", ".join(["none", *choices])}'
      )
    return None if text == 'none' else text

  return parse


# `plan` flags that only a --search reads, and those only a single plan reads: given to the
# other, each is an error, not ignored.
SEARCH_ONLY = tuple(
  'stages layouts tensor_sizes micro_batches remats prefetch_options offloads update_ons'
  ' offload_params_options quantizes batches_per_chip hbm_gib max_candidates out slice_counts'
  ' scheduler_shares collective_offloads'.split()
)


SINGLE_ONLY = tuple(
  'stage batch_per_chip no_remat remat gather_all mesh grad prefetch json offload update_on'
  ' offload_params slices scheduler_share collective_offload'.split()
)


def check_plan_flags(parser: argparse.ArgumentParser, p: argparse.ArgumentParser, args) -> None:
  """Refuses a `plan` flag that the chosen mode (a single plan or --search) does not read, and
  offload flags that do not make one candidate (`offload_flags_error`)."""
  flag = lambda name: '--' + name.replace('_', '-')
  unread = SINGLE_ONLY if args.search else SEARCH_ONLY
  given = [flag(n) for n in unread if getattr(args, n) != p.get_default(n)]
  if not given:
    wrong = offload_flags_error(args)
    if wrong:
      parser.error(wrong)
  if given:
    if args.search:
      parser.error(
        f'plan --search does not read {", ".join(given)}: those set a single plan. Give the'
        ' search its space instead (--stages, --layouts, --batches-per-chip, --remats,'
        ' --prefetch-options, --out), or drop --search.'
      )
    parser.error(
      f'{", ".join(given)} set the space of plan --search; a single plan does not read them.'
      ' Add --search, or set the plan with --stage, --batch-per-chip, --mesh, --no-remat,'
      ' --offload, --update-on.'
    )


def offload_flags_error(args) -> str | None:
  """What is wrong with a plan's offload flags, before anything is traced, else None.

  Each refused combination would otherwise compile something other than what the flags say
  (an update on the host without the state there; 'stream' without zerojax.mixed_precision's
  master step, which runs as 'host' with a warning a command-line user cannot act on), so a
  plan and a search of the same candidate could differ. The message names the flag to add.
  """
  if args.search:
    if 'stream' in (args.update_ons or ()) and not args.mixed_precision:
      return (
        "--update-ons stream sends the new parameters back through zerojax.mixed_precision's"
        ' master step, which the search plans only with --mixed-precision: add'
        ' --mixed-precision, or drop stream from --update-ons.'
      )
    return None
  if args.update_on != 'device' and args.offload is None:
    return (
      f'--update-on {args.update_on} runs the optimizer update where an offloaded state lives:'
      ' add --offload opt_state (or --offload opt_state+master), or drop --update-on.'
    )
  if args.update_on == 'stream' and not args.mixed_precision:
    return (
      "--update-on stream sends the new parameters back through zerojax.mixed_precision's"
      ' master step (without it the update runs as --update-on host): add --mixed-precision,'
      ' or say --update-on host.'
    )
  if args.offload_params and (args.offload is None or args.update_on == 'device'):
    wanted = [('--offload opt_state+master', args.offload is None)]
    wanted.append(('--update-on host (or stream)', args.update_on == 'device'))
    missing = ' and '.join(flag for flag, lacking in wanted if lacking)
    return (
      '--offload-params keeps the parameters in host memory, so the optimizer update runs'
      f' there too, on an offloaded state: add {missing}.'
    )
  return None


def _compiler_option(text: str) -> tuple[str, Any]:
  """NAME=VALUE for the compiler; the value an int, a float, true/false or else text."""
  name, eq, value = text.partition('=')
  if not eq or not name.strip() or not value.strip():
    raise argparse.ArgumentTypeError(
      f'expected NAME=VALUE, got {text!r} (e.g. xla_tpu_rematerialization_min_size_in_bytes=33554432)'
    )
  value = value.strip()
  if value.lower() in ('true', 'false'):
    return name.strip(), value.lower() == 'true'
  for kind in (int, float):
    try:
      return name.strip(), kind(value)
    except ValueError:
      pass
  return name.strip(), value


def _share(text: str) -> int | str:
  """A scheduler share: a whole percent of HBM >= 1, or 'compiler' (the compiler's default)."""
  if text == 'compiler':
    return text
  try:
    share = int(text)
  except ValueError:
    share = 0
  if share < 1:
    raise argparse.ArgumentTypeError(
      f"expected a whole percent of HBM >= 1 or 'compiler', got {text!r}"
    )
  return share


def scheduler_shares(
  args, given: Sequence[int | str] | None, flag: str
) -> tuple[int | None, ...] | None:
  """The scheduler shares a plan or a search compiles with: `given` ('compiler' is None), else
  None (each candidate's `candidates.default_scheduler_share`); refused where the topology's
  compiler has no such option."""
  if given is None:
    return None
  shares = tuple(None if s == 'compiler' else s for s in given)
  try:
    candidates.check_scheduler_shares(args.topology, shares, dict(args.compiler_options), flag)
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  return shares


def _on_off(text: str) -> bool:
  if text not in ('on', 'off'):
    raise ValueError(text)
  return text == 'on'


def check_compiler_options(args) -> None:
  """Refuses, in a second, a --compiler-option the topology's compiler does not take, before
  a compile of minutes: a one-line program is compiled with the options first."""

  options = dict(args.compiler_options)
  if not options:
    return
  device = devices_of(args.topology)[0][0]
  x = jax.ShapeDtypeStruct(
    (8, 128), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  try:
    jax.jit(lambda a: a + 1).trace(x).lower().compile(compiler_options=options)
  except jax.errors.JaxRuntimeError as e:
    given = ' '.join(f'--compiler-option {k}={v}' for k, v in options.items())
    raise SystemExit(
      f'error: {given}: the compiler for {args.topology} refused it: {str(e).splitlines()[0]}.'
      ' Option names and values are those of the installed jaxlib and libtpu.'
    ) from None


def plan_parser(sub) -> argparse.ArgumentParser:
  """`plan`'s parser, with its single-plan flags."""
  shown = argparse.ArgumentDefaultsHelpFormatter  # --help shows every default
  p = sub.add_parser(
    'plan', help='compile a training step ahead of time and report its cost', formatter_class=shown
  )
  p.add_argument(
    '--model',
    default='gpt2-small',
    help=f'a preset {sorted(presets.PRESETS)}; a decoder of any shape, decoder:KEY=VALUE,...'
    ' (vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff, head_size, gated) or'
    ' decoder:FILE.json of the same keys; a published Llama, Mistral or Qwen model from its'
    " Hugging Face folder's config.json alone, hf:DIR (zerojax.llama's decoder, at --seq-len,"
    ' default 2048); or module:function returning a zerojax.inspect.ModelSpec (given a `remat`'
    " parameter, it is told each candidate's policy)",
  )
  p.add_argument(
    '--topology', default='v5e:2x4', help='TPU topology (v5e:16x16, v4:2x2x1, ...) or cpu:N'
  )
  p.add_argument('--stage', type=int, default=3, choices=(0, 1, 2, 3), help='ZeRO stage')
  p.add_argument('--optimizer', default='adamw', choices=OPTIMIZERS, help='optax optimizer')
  p.add_argument(
    '--batch-per-chip', type=_positive_int, default=1, help='sequences per chip per step'
  )
  p.add_argument(
    '--seq-len', type=_positive_int, default=None, help="sequence length; None: the preset's"
  )
  p.add_argument('--compute-dtype', default='bfloat16', help='dtype of the matmuls')
  p.add_argument(
    '--remat',
    default='full',
    choices=presets.REMAT,
    help='what each block keeps for the backward pass (the rest is recomputed): full (nothing),'
    " gathers (all but the parameters' gathers), none (everything), or a policy named by what it"
    " keeps in HBM (save_qkv, save_attention, save_mlp, minimal: MaxText's) or moves to host"
    ' memory and back (offload_qkv, offload_minimal, offload_all, offload_layer_inputs: full'
    " with the layer loop's stack of block inputs on the host, ...); docs/planner.md",
  )
  p.add_argument('--no-remat', action='store_true', help='the same as --remat none')
  p.add_argument(
    '--gather-all', action='store_true', help='gather all parameters up front (not per layer)'
  )
  _layout_arguments(p)
  _precision_and_offload_arguments(p)
  return p


def _layout_arguments(p: argparse.ArgumentParser) -> None:
  """`plan`'s flags for the mesh, the gradients, the prefetch and the attention."""
  p.add_argument(
    '--mesh',
    default='data',
    help="the device mesh: 'data' (one ZeRO axis over every chip), the chip grid, e.g."
    ' 16x16 (one ZeRO axis per torus dimension, named x, y, z: on a 2-D torus the TPU'
    ' compiler keeps per-axis reduce-scatters, where over a whole 2-D torus it all-reduces),'
    f' or named axes, e.g. data=16,{TENSOR}=4: the axis named {TENSOR!r} splits the presets'
    ' Megatron-style (heads, MLP columns, vocabulary), ZeRO splits over the others',
  )
  p.add_argument(
    '--grad',
    default='auto',
    choices=('auto', 'jax', 'zerojax'),
    help='how gradients are taken: jax.value_and_grad (the compiler places the reduction),'
    ' zerojax.value_and_grad (explicit per-layer reduce-scatters; beside a tensor axis, each'
    ' chip gathers only its tensor part), or auto: zerojax on a multi-axis mesh without a'
    " 'tensor' axis, jax otherwise",
  )
  p.add_argument(
    '--prefetch',
    action='store_true',
    help="with zerojax gradients, gather block i+1's parameters while block i computes"
    ' (zerojax.scan_layers; one more block of parameters lives at a time)',
  )
  _model_arguments(p)


def _model_arguments(p: argparse.ArgumentParser) -> None:
  """`plan`'s flags for how the presets compute attention and the loss."""
  p.add_argument(
    '--attention-chunk',
    type=_positive_int,
    default=None,
    help='presets: compute attention this many queries at a time, one chunk of scores live at'
    ' a time (memory-efficient, the same arithmetic); default: all queries at once',
  )
  p.add_argument(
    '--loss-chunk',
    type=_positive_int,
    default=None,
    help="presets: compute the head's logits and the cross-entropy this many positions at a"
    ' time, one chunk of f32 logits live at a time (the same arithmetic); default: all at once',
  )
  p.add_argument(
    '--attention',
    choices=('xla', 'flash'),
    default='xla',
    help="presets: 'xla' (plain JAX, --attention-chunk applies) or 'flash' (fused Pallas kernels"
    ' on TPU, as MaxText runs: causal blocks skipped, scores never in HBM)',
  )
  p.add_argument(
    '--lora',
    type=_positive_int,
    default=None,
    metavar='R',
    help='presets, decoder: and hf: models: train rank-R LoRA adapters (alpha 2R) on the'
    ' --lora-targets projections alone, the rest frozen (no gradient, optimizer state or master)',
  )
  p.add_argument(
    '--lora-targets',
    default='q,k,v,o,gate,up,down',
    help='with --lora: the projections with adapters',
  )
  p.add_argument(
    '--base-dtype',
    choices=('bf16', 'int8', 'nf4'),
    default=None,
    help='with --lora: how the frozen base is stored: nf4 or int8 (QLoRA: the projections'
    " quantized, gathered as stored at stage 3) or bf16; default: the parameters' dtype",
  )


def _slices_argument(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    '--slices',
    type=int,
    default=1,
    help='TPU slices of --topology joined by the data-center network (DCN); the mesh gets an'
    f' outermost {SLICE!r} axis over them, data-parallel: state split within each slice, each'
    ' gradient shard all-reduced across slices once per step',
  )


def _precision_and_offload_arguments(p: argparse.ArgumentParser) -> None:
  """`plan`'s flags for several slices, mixed precision, host offload and the JSON report."""

  _slices_argument(p)
  p.add_argument(
    '--mixed-precision',
    action='store_true',
    help='bf16 parameters and gradients, fp32 master copy in the optimizer state'
    ' (zerojax.mixed_precision); with --search, for every candidate',
  )
  p.add_argument(
    '--offload',
    default=None,
    choices=OFFLOADS[1:],
    help='host offload of the optimizer state (and the fp32 master), as zerojax.Options',
  )
  p.add_argument(
    '--update-on',
    default='device',
    choices=UPDATE_ON,
    help="where an offloaded update runs: 'device', 'host', or 'stream' (gradients written"
    ' to host memory layer by layer in the backward pass; needs --mixed-precision)',
  )
  p.add_argument(
    '--offload-params',
    action='store_true',
    help='keep the parameters in host memory too (zerojax.Options(offload_params=True)): at'
    ' stage 3 each layer comes to the device in the layer loop; needs --offload and'
    ' --update-on host or stream',
  )
  p.add_argument('--json', help='also write the report as JSON here')
  _compiler_arguments(p)


def _compiler_arguments(p: argparse.ArgumentParser) -> None:
  """`plan`'s flags for the TPU compiler's settings and the cache of compiled programs."""
  p.add_argument(
    '--scheduler-share',
    type=_share,
    default=None,
    metavar='PERCENT',
    help="the share of HBM the TPU compiler's latency-hiding scheduler plans within (compiler"
    f' option {SCHEDULER_OPTION}; pass the same to the training run); default: {LEAN_SHARE} under'
    " --remat full, else the compiler's own ('compiler'). Lower, the same program holds less"
    ' HBM, and may run slower',
  )
  p.add_argument(
    '--collective-offload',
    type=_none_or(('sparsecore',)),
    default=None,
    help="'sparsecore': run the collectives on the chip's SparseCores (v5p), asynchronous"
    " beside the TensorCores' work (the compiler options of candidates.SPARSECORE_OPTIONS;"
    ' pass the same to the training run); default none, where the compiler puts them',
  )
  p.add_argument(
    '--compiler-option',
    dest='compiler_options',
    type=_compiler_option,
    action='append',
    default=[],
    metavar='NAME=VALUE',
    help='an XLA or libtpu option to compile the step with (repeatable), as jax.jit(...,'
    ' compiler_options={NAME: VALUE}) takes it: pass the same to the training run',
  )
  p.add_argument(
    '--cache-dir',
    default=str(program_cache.default_dir()),
    help='keep what the planner reads from each compiled TPU program here, and read it back'
    ' when the same program is planned again (by a plan or a search; keyed by the lowered'
    ' program, topology, jax/jaxlib/libtpu versions, XLA flags and compiler options; default from'
    f' ${program_cache.ENV})',
  )
  p.add_argument(
    '--no-cache', action='store_true', help='compile every program again and keep none'
  )


# `--remats` (a search's default is `candidates.default_remats`).
_REMATS_HELP = (
  'what each block keeps, as --remat; default: gathers, full, minimal, none, and'
  " offload_minimal, offload_minimal_inputs where the chip's host link has figures (a --model"
  ' module:function: gathers)'
)


_SHARES_HELP = (
  'as --scheduler-share, each a candidate (e.g. compiler,70,60); default:'
  f" {LEAN_SHARE} for remat full, else the compiler's"
)


def _layout_space(s) -> None:
  """`plan --search`'s stages and mesh layouts."""
  s.add_argument('--stages', type=_csv(int), default=(1, 2, 3), help='ZeRO stages')
  s.add_argument(
    '--layouts',
    type=_csv(str),
    default=('flat', 'torus'),
    help='flat (one ZeRO axis), torus (one per torus dimension), hpz (torus, stage-3'
    ' parameters split within the last axis)',
  )
  s.add_argument(
    '--tensor-sizes',
    type=_csv(_positive_int),
    default=(1,),
    help="sizes of a tensor-parallel axis beside the flat layout's ZeRO axis (Megatron-style:"
    ' heads, MLP columns, vocabulary; gradients through jax.value_and_grad); 1: none. Each'
    ' must divide the chips of a slice',
  )


def _offload_space(s) -> None:
  """The search's host offloads; not given, a one-chip topology tries them all
  (`search.ONE_CHIP_OFFLOADS`)."""
  s.add_argument(
    '--offloads',
    type=_csv(_none_or(OFFLOADS[1:])),
    default=None,
    help='none, opt_state, opt_state+master (host memory); default none, and all three on a'
    ' one-chip topology',
  )
  s.add_argument(
    '--update-ons',
    type=_csv(str),
    default=None,
    help='device, host, stream (the update on the host, gradients sent down layer by layer);'
    ' default device, and all three on a one-chip topology',
  )
  s.add_argument(
    '--offload-params-options',
    type=_csv(_on_off),
    default=None,
    help='off, on: parameters in host memory too (needs an offload updated on the host);'
    ' default off, and both on a one-chip topology',
  )


def search_arguments(p: argparse.ArgumentParser) -> None:
  """`plan --search` and the space it searches."""
  s = p.add_argument_group(
    'plan search (--search)',
    'compile every combination of these for the topology and rank them by predicted step time',
  )
  s.add_argument('--search', action='store_true', help='search the space below instead of one plan')
  _layout_space(s)
  s.add_argument('--micro-batches', type=_csv(int), default=(1,), help='micro-batches per step')
  s.add_argument('--remats', type=_csv(str), default=None, help=_REMATS_HELP)
  s.add_argument(
    '--prefetch-options',
    type=_csv(_on_off),
    default=(False, True),
    help='on, off: scan_layers prefetch of the next layer (stage 3)',
  )
  _offload_space(s)
  s.add_argument(
    '--quantizes',
    type=_csv(_none_or(tuple(q for q in candidates.QUANTIZE if q))),
    default=(None,),
    help='ZeRO++: none, g8, g4 (gradients), w8g8, w8g4 (weights too, stage 3)',
  )
  s.add_argument(
    '--batches-per-chip', type=_csv(_positive_int), default=(1,), help='sequences per chip'
  )
  s.add_argument(
    '--slice-counts',
    type=_csv(_positive_int),
    default=(1,),
    help='TPU slices of --topology (data-parallel over the data-center network)',
  )
  s.add_argument('--scheduler-shares', type=_csv(_share), default=None, help=_SHARES_HELP)
  s.add_argument(
    '--collective-offloads',
    type=_csv(_none_or(('sparsecore',))),
    default=None,
    help="none, sparsecore (the collectives on the chip's SparseCores); default both on a chip"
    ' with SparseCores (v5p), none elsewhere',
  )
  s.add_argument(
    '--hbm-gib', type=float, default=None, help="device memory per chip; default the chip's"
  )
  s.add_argument('--max-candidates', type=int, default=64, help='refuse a larger space')
  s.add_argument('--out', default=None, help='write the table, JSON and a plot to this folder')


def estimate_parser(sub) -> argparse.ArgumentParser:

  shown = argparse.ArgumentDefaultsHelpFormatter
  e = sub.add_parser(
    'estimate', help='per-device bytes of each stage, from theory', formatter_class=shown
  )
  e.add_argument('--params', type=_count, help='parameter count, e.g. 7e9')
  e.add_argument('--model', help='or a preset name')
  e.add_argument('--devices', type=_positive_int, required=True, help='devices on the ZeRO axes')
  e.add_argument('--optimizer', default='adam', choices=OPTIMIZERS, help='optax optimizer')
  e.add_argument(
    '--mixed-precision',
    action='store_true',
    help='bf16 params and grads, fp32 master copy in the optimizer state',
  )
  e.add_argument('--offload', choices=OFFLOADS[1:], help='host offload')
  return e


def inspect_parser(sub) -> argparse.ArgumentParser:
  shown = argparse.ArgumentDefaultsHelpFormatter
  i = sub.add_parser(
    'inspect',
    help='describe a checkpoint folder: steps, stage, mesh, leaves',
    formatter_class=shown,
  )
  i.add_argument('directory')
  i.add_argument('--step', type=int, default=None, help='default: the latest committed step')
  return i


def most_slices(args) -> int:
  """The most slices the command compiles for (--slices, or the largest of --slice-counts)."""
  return max(getattr(args, 'slices', 1) or 1, *(getattr(args, 'slice_counts', None) or (1,)))


def devices_of(topology: str, slices: int = 1):
  """Devices of `slices` slices of `topology` (in slice order) and the HBM of its chips in
  GiB (None for cpu:N)."""
  try:
    devices = tpu.topology_devices(topology, slices)
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  chip = topology.split(':', 1)[0]
  return devices, None if chip == 'cpu' else roofline.HBM_GIB.get(chip)
