"""The planner: what a run will cost, answered before it is launched.

It uses the library (`zerojax._src`) and nothing in the library uses it. One module per job:

- `presets`, `flash`: the decoders it plans (GPT-2 and LLaMA-2 shapes, any decoder shape) and
  their attention, chunked or as TPU Pallas kernels.
- `tpu`: TPU topologies, their devices (compiled for with no TPU attached), the local TPU.
- `estimate`: per-device bytes of each stage from theory, before anything compiles.
- `candidates`: a configuration to try (stage, layout, micro-batches, remat, prefetch,
  offload, ZeRO++, batch per chip, slices) and the space a search tries.
- `lowering`: a candidate's mesh, options, abstract train state and step, traced and
  lowered (`Lowered`).
- `program_cache`: its compiled program, or the record of it compiled before.
- `search`: one candidate through the pipeline, lowered, compiled and priced (`evaluate`,
  `Priced`); `plan` is a search of one, a search ranks many.
- `hlo`: the compiled program's optimized HLO read once (`hlo.Program`), and the one
  traversal of it (`Program.walk`) that every analysis below is written as.
- `collectives`, `host_link`, `arrays`: the collectives a step runs, the bytes crossing the
  host link, the largest arrays it makes.
- `cost`: the kernels' time and matmul FLOPs of a `hlo.Program`.
- `roofline`: the chips' published figures and the step-time model (`StepCost` -> seconds).
- `report`: a compiled step's memory and collectives beside the ZeRO floor (`step_report`).
- `search_report`: a search's ranked table, JSON, plot and the winner's lines.
- `display`: what it draws in a terminal (the only module that imports rich).
- `flags`: the command line's flags and their checks.
- `plan_report`: a single plan's printed report and JSON.
- `cli`: the commands, `python -m zerojax plan / estimate / inspect`.
"""
