"""Launch bundles: a plan made runnable on someone else's cluster.

Owns: export, the manifest and its checks, safe archive reading, the GPU-type check (`archive`),
and the torchrun / Slurm / Kubernetes launch files and README (`launch_files`).

May import: everything below it, `engine.elastic` included (HSPMD annotations). Never
`engine.compare` or `engine.cli`.
"""
