"""Elasticity (Hetu): moving a running plan to a changed cluster.

Owns: re-planning on a changed cluster (`replan`), the resharding table between two plans'
layouts (`reshard`), a plan on virtual devices expanded to one rank per GPU (`per_gpu`),
and a plan written as HSPMD annotations (`annotations`).

May import: everything below it: the ground floor, `engine.model`, `engine.cluster`,
`engine.theory`, `engine.spmd`, `engine.pipeline` and `engine.planner`. Never `engine.bundle`,
`engine.compare` or `engine.cli`.
"""
