"""The GPT example on several processes: JAX's distributed runtime, one mesh over all of them.

Every process runs this same script; `zerojax.distributed.initialize` joins them
(`jax.distributed.initialize` underneath; gloo collectives on CPU), the mesh
spans every process's devices, each process loads only its rows of each batch,
and checkpoints are written by all processes together. Two processes with four
faked CPU devices each, on one machine (loopback only):

  python examples/multiprocess.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 &
  python examples/multiprocess.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1

One process with eight devices, the same run without the distributed runtime:

  python examples/multiprocess.py --local-devices 8

On a TPU pod, run it on every host with no flags: JAX finds the coordinator.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def parse(argv):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  parser.add_argument('--coordinator', help='HOST:PORT of process 0 (omit on TPU pods)')
  parser.add_argument('--num-processes', type=int, help='how many processes take part')
  parser.add_argument('--process-id', type=int, help="this process's index, 0..N-1")
  parser.add_argument(
    '--local-devices', type=int, default=4, help='CPU only: faked devices per process'
  )
  parser.add_argument('--timeout', type=int, default=120, help='start-up deadline, seconds')
  parser.add_argument('--stage', type=int, default=3, choices=(0, 1, 2, 3), help='ZeRO stage')
  parser.add_argument('--steps', type=int, default=50, help='training steps')
  parser.add_argument('--d-model', type=int, default=64, help='model width')
  parser.add_argument('--layers', type=int, default=2, help='transformer blocks')
  parser.add_argument('--batch', type=int, default=16, help='global batch, all processes')
  parser.add_argument(
    '--optimizer',
    default='adamw',
    choices=('adamw', 'sgd'),
    help='sgd (with momentum) for comparing runs: Adam turns summation-order noise in'
    ' near-zero gradients into full-size steps',
  )
  parser.add_argument('--checkpoint-dir', help='save here and resume from the latest checkpoint')
  parser.add_argument('--save-every', type=int, default=5, help='steps between checkpoints')
  parser.add_argument(
    '--save-on-preemption',
    action='store_true',
    help='on SIGTERM to any process, every process saves the same next step (JAX preemption'
    ' service) and exits with code 143',
  )
  parser.add_argument(
    '--micro-batches', type=int, default=1, help='micro-batches per device (resumes keep the size)'
  )
  parser.add_argument('--dropout', type=float, default=0.0, help='dropout rate')
  parser.add_argument(
    '--slices',
    type=int,
    default=1,
    help="data-parallel groups (TPU slices) in an outer 'slice' mesh axis: ZeRO within each,"
    " each gradient shard all-reduced across them (zero_stage(..., replica_axis='slice'))",
  )
  parser.add_argument('--losses', help="append each step's loss to this JSONL file (process 0)")
  parser.add_argument('--export', help='write the final parameters to this .npz (process 0)')
  parser.add_argument(
    '--export-state', help='write the final params and optimizer state to this .npz (process 0)'
  )
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  on_cpu = os.environ.setdefault('JAX_PLATFORMS', 'cpu') == 'cpu'

  import jax

  import zerojax

  distributed = args.coordinator is not None or args.num_processes not in (None, 1)
  if distributed:
    zerojax.distributed.initialize(
      args.coordinator,
      args.num_processes,
      args.process_id,
      local_device_count=args.local_devices if on_cpu else None,
      timeout_s=args.timeout,
    )
  elif on_cpu:
    jax.config.update('jax_num_cpu_devices', args.local_devices)

  import gpt
  import optax
  from common import make_mesh, report

  if jax.process_index() == 0:
    print(
      f'{jax.process_count()} process(es) x {jax.local_device_count()} device(s):'
      f' one mesh of {jax.device_count()}; this is process {jax.process_index()}'
    )
  cfg = gpt.Config(
    d_model=args.d_model, n_layers=args.layers, batch=args.batch, dropout=args.dropout
  )
  out = gpt.run(
    stage=args.stage,
    steps=args.steps,
    cfg=cfg,
    checkpoint_dir=args.checkpoint_dir,
    save_every=args.save_every,
    save_on_preemption=args.save_on_preemption,
    micro_batches=args.micro_batches,
    losses_file=args.losses,
    log_every=1,
    tx=optax.sgd(0.1, momentum=0.9) if args.optimizer == 'sgd' else None,
    mesh=make_mesh(args.slices),
    **({'replica_axis': 'slice'} if args.slices > 1 else {}),
  )
  report(out, 'gpt')
  step = zerojax.inspect.step_report(out['compiled'], plan=out['plan'])
  if jax.process_index() == 0:
    print(step)
  if args.export:
    path = zerojax.checkpoint.export_params(out['state'].params, args.export)
    if jax.process_index() == 0:
      print(f'wrote {path}')
  if args.export_state:
    state = out['state']
    zerojax.checkpoint.export_params(
      {'params': state.params, 'opt_state': state.opt_state}, args.export_state
    )
  return 0


if __name__ == '__main__':
  sys.exit(main())
