"""Execution of plans over torch.distributed (issue 3; DESIGN "Runner").

Modules, in the order a run uses them:

- `cli`: `hap run PLAN.json ...`, starts torchrun on this machine unless already launched;
- `launch`: the per-rank entry under torchrun (`python -m runner.launch`): checks, process group,
  training loop, metrics, verify;
- `program`: the plan's program for one rank as a readable `torch.fx.GraphModule`;
- `collectives`: all-reduce, all-gather (padded / grouped), reduce-scatter, all-to-all, slice and
  replicate as autograd Functions whose backward is the exact dual, and the hierarchical
  all-reduce, all-gather and reduce-scatter over machine and peer sub-groups;
- `api`: the library API, `runner.parallelize(plan) -> ParallelModel`, for your own training loop;
  `pipeline_api`: its `PipelineModel` for pipeline plans; `global_batch`: the batch check both share;
- `loop`: `hap run`'s training step over that API (accumulation, schedule, clipping) and evaluation;
- `optim`: the optimiser settings (AdamW, weight decay on matrices, LR schedules, clipping, accumulation);
- `batches`, `data`, `prepare`: where global batches come from (a token dataset, the model file's
  `batches(step)`, or drawn), the Parquet/Arrow token reader, and `hap data prepare`;
- `weights`: pretrained weights in, safetensors out (`--init-from`, `--save-model`);
- `train`: parameter slices from the seeded (or pretrained) single-device model, and the
  single-device reference;
- `overlap`: the plan's gradient buckets, all-reduced from gradient hooks during backward (`ddp`);
- `duplex`: two half-batch streams per rank on two threads and two process groups (`duplex`);
- `timing`: measured timeline per instruction, emulated device speed and emulated link;
- `verify`: the comparison with single-device training;
- `run_report`: the metrics file, the progress line and evaluation records of `hap run`;
- `pipeline`, `stage_program`, `pipeline_run`: pipeline plans (stages, schedules, sends between stages),
  and `hap run`'s rank entry for them;
- `data`: token datasets (`--data`: Parquet / Arrow IPC read on demand) and the seeded order of global batches;
- `prepare`: `hap data prepare`, text packed into those token files.
"""


def __getattr__(name: str):
    """`runner.parallelize` without importing torch.distributed for every `runner.*` import."""
    if name in ("parallelize", "ParallelModel", "PipelineModel"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
