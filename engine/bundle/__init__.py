"""Launch bundles: a plan made runnable on someone else's cluster.

Owns: export, the manifest and its checks, the GPU-type check (`archive`), reading a bundle folder or
zip without trusting it (`unpack`), and the torchrun / Slurm / Kubernetes launch files and README
(`launch_files`).

May import: everything below it, `engine.elastic` included (HSPMD annotations). Never
`engine.compare` or `engine.cli`.
"""
