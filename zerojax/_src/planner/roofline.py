"""The step-time model of the planner: per-chip constants and how they combine.

`CHIPS` holds each TPU generation's published figures, with their sources;
`calibrate_cpu` measures the faked CPU devices' instead. `predict` turns what
one chip runs in a compiled step into seconds (docs/design.md, "The step-time
model"):

- kernels (`cost.program_cost`): each fusion at the TPU compiler's own estimate
  of its cycles (its model of the MXU rate for that matmul's shape, and of the
  vector and HBM work of the fusion), at the chip's clock; a kernel without an
  estimate at its roofline (FLOPs at peak, bytes at HBM bandwidth);
  rematerialised work is in the program, so it is counted as it runs;
- collectives at one torus axis's ICI bandwidth, and those between slices at the
  chip's data-center network (DCN) bandwidth, each less the share the compiler
  overlaps with compute;
- host transfers at the host link's bandwidth, less their overlapped share.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

GiB = 2**30
# HBM per chip, in GiB, of every TPU generation a topology can name (the roofline constants
# below exist for v5e, v5p and v6e only).
HBM_GIB = {'v2': 8, 'v3': 16, 'v4': 32, 'v5e': 16, 'v5litepod': 16, 'v5p': 95, 'v6e': 32}


@dataclasses.dataclass(frozen=True)
class Chip:
  """Roofline constants of one accelerator generation (per chip).

  Attributes:
    name: the topology prefix, e.g. 'v5e'.
    peak_flops: dense bf16 FLOP/s.
    hbm_bytes: HBM capacity.
    hbm_bandwidth: HBM bytes/s.
    ici_bandwidth: bidirectional inter-chip bytes/s, all ports together.
    torus_dims: dimensions of the torus; a collective over one mesh axis is
      taken to use that axis's ports: `ici_bandwidth / torus_dims`.
    host_bytes_per_chip: host DRAM divided by the chips of a host.
    host_link_bandwidth: host <-> chip bytes/s (assumed, see `source`).
    source: where the figures come from.
    collective_latency: seconds each collective costs beyond its bytes (measured
      on `cpu:N`; not modelled for TPUs, 0).
    tensorcores: TensorCores per chip (0 for a CPU device).
    mxus: matrix units per TensorCore.
    mxu_dim: each matrix unit multiplies `mxu_dim` x `mxu_dim` tiles per cycle.
    dcn_bandwidth: data-center network bytes/s per chip, each way, between slices
      (0 where none is published: such a chip is not planned over several slices).
    sparse_cores: SparseCores per chip (0 where the chip has none): the TPU compiler can run
      collectives on them, beside the TensorCores' work (`candidates.SPARSECORE_OPTIONS`).
  """

  name: str
  peak_flops: float
  hbm_bytes: int
  hbm_bandwidth: float
  ici_bandwidth: float
  torus_dims: int
  host_bytes_per_chip: int
  host_link_bandwidth: float
  source: str
  collective_latency: float = 0.0
  tensorcores: int = 0
  mxus: int = 0
  mxu_dim: int = 0
  dcn_bandwidth: float = 0.0
  sparse_cores: int = 0

  @property
  def axis_bandwidth(self) -> float:
    return self.ici_bandwidth / self.torus_dims

  @property
  def clock_hz(self) -> float | None:
    """The clock the compiler's cycle estimates run at: the published peak divided by
    what the matrix units do in a cycle (2 FLOPs per multiply-add); None off TPU."""
    per_cycle = 2 * self.tensorcores * self.mxus * self.mxu_dim**2
    return self.peak_flops / per_cycle if per_cycle else None


# Figures from Google Cloud's TPU documentation pages (docs.cloud.google.com/tpu/docs/v5e,
# /v5p-training, /v6e). The host link is not published per chip: PCIe Gen4 x16 (32 GB/s) is
# assumed for v5e and v5p, Gen5 x16 (64 GB/s, the v6e page names Gen5) for v6e. Matrix units:
# v5e one TensorCore of four 128x128 MXUs (1.50 GHz at 197 TFLOP/s); v5p two TensorCores per
# chip (its topology table: 8 cores on 4 chips), four MXUs each, 128x128 as v5e's (1.75 GHz);
# v6e one TensorCore of two 256x256 MXUs (3.50 GHz). Data-center network (DCN) per chip: v5e
# 2 x 100 Gbps NICs per 8-chip host (its page's table; 6.4 Tbps per 256-chip pod agrees), 25 Gbps
# = 3.125 GB/s a chip; v5p 50 Gbps a chip (its page's "DCN bandwidth per chip"), 6.25 GB/s; v6e's
# page gives none. SparseCores: v5p 4 a chip (its page's "Number of SparseCores per chip"); the
# v5e and v6e pages give none, so no collective is offloaded to them there.
# The host memory of a one-chip VM, where it differs from the chip's share of a host's
# (`Chip.host_bytes_per_chip`): v5e's page lists ct5lp-hightpu-1t (Colab's v5e-1) with 48 GB
# of RAM in its table of VM types. v6e's page gives DRAM per 8-chip host only, so a v6e:1x1
# plan keeps that share (192 GiB), not a published figure for its one-chip VM.
ONE_CHIP_VM_HOST_BYTES = {'v5e': 48 * 10**9}


def prices_host_link(chip: Chip | None) -> bool:
  """Whether `chip` has the host-link figures (bandwidth and host memory per chip) that price
  moving activations to host memory and back."""
  return chip is not None and bool(chip.host_link_bandwidth and chip.host_bytes_per_chip)


CHIPS = {
  'v5e': Chip(
    'v5e',
    197e12,
    HBM_GIB['v5e'] * GiB,
    819e9,
    400e9,
    2,
    512 * GiB // 8,
    32e9,
    'v5e page: 197 TFLOP/s bf16, 16 GB HBM at 819 GB/s, 400 GB/s ICI (4 ports, 2-D'
    ' torus), 512 GiB DRAM per 8-chip host, 1 TensorCore x 4 MXUs (128x128); host link'
    ' PCIe Gen4 x16 assumed; DCN 2 x 100 Gbps NICs per 8-chip host',
    tensorcores=1,
    mxus=4,
    mxu_dim=128,
    dcn_bandwidth=25e9 / 8,
  ),
  'v5p': Chip(
    'v5p',
    459e12,
    HBM_GIB['v5p'] * GiB,
    2765e9,
    1200e9,
    3,
    448 * 10**9 // 4,
    32e9,
    'v5p page: 459 TFLOP/s bf16, 95 GiB HBM at 2765 GB/s, 1200 GB/s ICI (3-D torus),'
    ' 448 GB RAM per 4-chip VM, 2 TensorCores x 4 MXUs (128x128 assumed, as v5e); host link'
    ' PCIe Gen4 x16 assumed; DCN 50 Gbps per chip',
    tensorcores=2,
    mxus=4,
    mxu_dim=128,
    dcn_bandwidth=50e9 / 8,
    sparse_cores=4,
  ),
  'v6e': Chip(
    'v6e',
    918e12,
    HBM_GIB['v6e'] * GiB,
    1638e9,
    800e9,
    2,
    1536 * GiB // 8,
    64e9,
    'v6e page: 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s, 800 GB/s ICI (4 ports, 2-D'
    ' torus), 1536 GiB DRAM per 8-chip host, 1 TensorCore x 2 MXUs (256x256), PCIe Gen5'
    ' (x16 assumed)',
    tensorcores=1,
    mxus=2,
    mxu_dim=256,
  ),
}


@dataclasses.dataclass(frozen=True)
class StepCost:
  """What the step-time model reads of one compiled program (a search's `Result` carries the
  same figures).

  Attributes:
    flops: matmul FLOPs per chip.
    kernel_seconds: the program's kernels, one after another (`cost.program_cost`).
    ring_bytes: ring-equivalent bytes per chip of every collective, ICI and DCN.
    overlapped_bytes: of those, the bytes the compiler overlaps with compute.
    dcn_bytes: of `ring_bytes`, those between slices.
    dcn_overlapped_bytes: of those, the overlapped ones.
    collective_count: collectives per step.
    dcn_windows: per DCN transfer, (bytes, kernel seconds in flight, runs per step), or None.
  """

  flops: float
  kernel_seconds: float
  ring_bytes: float
  overlapped_bytes: float
  dcn_bytes: float = 0.0
  dcn_overlapped_bytes: float = 0.0
  collective_count: int = 0
  dcn_windows: tuple | None = None

  @classmethod
  def of(cls, collectives: Any, work: Any) -> StepCost:
    """From a program's `CollectiveStats` and its `cost.ProgramCost`."""
    return cls(
      flops=work.matmul_flops,
      kernel_seconds=work.kernel_seconds,
      ring_bytes=collectives.total_ring_bytes,
      overlapped_bytes=sum(collectives.overlapped_ring_bytes.values()),
      dcn_bytes=collectives.total_dcn_bytes,
      dcn_overlapped_bytes=sum(collectives.dcn_overlapped_ring_bytes.values()),
      collective_count=sum(collectives.counts.values()),
      dcn_windows=work.dcn_windows,
    )


def check_dcn(chip: Chip) -> None:
  """Refuses a step across slices on a chip whose data-center network is not published.

  Raises:
    ValueError: naming the chip and the chips that have the figure.
  """
  if not chip.dcn_bandwidth:
    raise ValueError(
      f'{chip.name} has no published data-center network bandwidth, so a step across'
      ' slices cannot be timed; plan one slice, or a chip whose page gives it (v5e, v5p).'
    )


@dataclasses.dataclass(frozen=True)
class Prediction:
  """One step's predicted seconds, by part (`predict`); not measured."""

  compute: float  # the kernels, one after another
  collectives: float  # every collective at its bandwidth (ICI and DCN), hidden or not
  exposed: float  # the collectives' time not hidden under compute
  dcn: float  # of `collectives`, those between slices
  dcn_exposed: float  # of `exposed`, those between slices
  host: float  # the host link's transfers at its bandwidth
  host_exposed: float  # of `host`, not hidden under compute
  step: float  # the whole step


def predict(
  chip: Chip, r: Any, host_transfer_bytes: float, host_overlap: float = 0.0
) -> Prediction:
  """Predicted seconds per step: compute, collectives (exposed part), host transfers.

  compute = the kernels' time (`r.kernel_seconds`, from `cost.program_cost`: the
  compiler's estimate of each kernel, or its roofline), or where a result has
  none, its matmul FLOPs at peak; collectives = ring bytes / one axis's ICI
  bandwidth (plus a latency per collective where one is known), of which the
  overlapped share hides under compute; host = bytes moved over the host link /
  its bandwidth (assumed, see `Chip.source`), of which the share `host_overlap`
  (asynchronous transfers with compute scheduled before their end, as
  `count_host_transfers` finds them) hides under compute likewise. `r` is a `StepCost`, or a
  search `Result` (which has its fields).
  """
  compute = getattr(r, 'kernel_seconds', 0.0) or r.flops / chip.peak_flops
  dcn_bytes = getattr(r, 'dcn_bytes', 0.0)
  dcn_hidden = getattr(r, 'dcn_overlapped_bytes', 0.0)
  ici_bytes, ici_hidden = r.ring_bytes - dcn_bytes, r.overlapped_bytes - dcn_hidden
  if dcn_bytes:
    check_dcn(chip)
  ici = ici_bytes / chip.axis_bandwidth + r.collective_count * chip.collective_latency
  dcn = dcn_bytes / chip.dcn_bandwidth if dcn_bytes else 0.0
  ici_share = ici_hidden / ici_bytes if ici_bytes else 0.0
  dcn_hidden = dcn * (dcn_hidden / dcn_bytes if dcn_bytes else 0.0)
  windows = getattr(r, 'dcn_windows', None)
  if windows is not None:
    # Each transfer between slices hides at most under the kernels scheduled while it is in
    # flight; its time is its share of the DCN time, by the bytes it sends.
    sent = sum(b * n for b, _, n in windows)
    per_byte = dcn / sent if sent else 0.0
    dcn_hidden = min(dcn_hidden, sum(n * min(b * per_byte, w) for b, w, n in windows))
  exposed = ici * (1 - ici_share) + dcn - dcn_hidden
  host = host_transfer_bytes / chip.host_link_bandwidth
  host_exposed = host * (1 - host_overlap)
  hidden = ici * ici_share + dcn_hidden + host * host_overlap
  step = max(compute, hidden) + exposed + host_exposed
  return Prediction(
    compute=compute,
    collectives=ici + dcn,
    exposed=exposed,
    dcn=dcn,
    dcn_exposed=dcn - dcn_hidden,
    host=host,
    host_exposed=host_exposed,
    step=step,
  )


def host_transfer_bytes(c: Any, host_bytes: int, param_bytes: int) -> float:
  """Bytes crossing the host link per step and chip for an offload, by formula: what the
  search falls back on where the compiled program carries no memory spaces (XLA:CPU).

  Streamed to the device for the update (`update_on='device'`): the offloaded
  state comes down and goes back up. Updated on the host (or streamed):
  gradient shards go down and the new parameters or updates come up (the
  parameters' size each way). None (no candidate: a program compiled elsewhere): 0.
  """
  if c is None or c.offload in (None, 'none'):
    return 0.0
  return 2.0 * (host_bytes if c.update_on == 'device' else param_bytes)


def calibrate_cpu(num_devices: int, size: int = 1024, repeats: int = 5) -> Chip:
  """Roofline constants of this machine's faked devices, measured: a matmul's FLOP/s and a
  copy's bytes/s on the whole machine, divided among the `num_devices` that share it."""
  x = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda a: a @ a)
  copy = jax.jit(lambda a: a + 1.0)

  def best(fn):
    fn(x).block_until_ready()
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      fn(x).block_until_ready()
      times.append(time.perf_counter() - start)
    return min(times)

  flops = 2 * size**3 / best(matmul)
  bandwidth = 2 * x.nbytes / best(copy)
  # One small all-reduce over every device: what a collective costs beyond its bytes.
  mesh = jax.make_mesh((num_devices,), ('d',), devices=jax.devices()[:num_devices])
  one = jax.device_put(jnp.ones((num_devices,)), jax.sharding.NamedSharding(mesh, jax.P('d')))
  psum = jax.jit(
    jax.shard_map(
      lambda v: jax.lax.psum(v, 'd'), mesh=mesh, in_specs=jax.P('d'), out_specs=jax.P('d')
    )
  )
  latency = best(lambda _: psum(one))
  return Chip(
    'cpu',
    flops / num_devices,
    0,
    bandwidth / num_devices,
    bandwidth / num_devices,
    1,
    0,
    bandwidth / num_devices,
    f'measured here: {flops / 1e9:.1f} GFLOP/s (f32 matmul {size}^2), {bandwidth / 1e9:.1f} GB/s'
    f' (elementwise), {latency * 1e6:.0f} us per all-reduce; shared by {num_devices} faked devices',
    collective_latency=latency,
    # Slices stood in for on one machine: what crosses between them moves as any copy does.
    dcn_bandwidth=bandwidth / num_devices,
  )
