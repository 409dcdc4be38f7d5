"""Pipeline planning (HAPT): layers in stages on device groups, microbatches through them.

Owns: cut points and each stage's own graph (`stages`), the schedules as task lists
(`schedule`), sub-clusters and stage prices (`stage_cost`), the partition DP (`partition`),
HAP's plan inside every stage (`stage_plan`), and the pipeline plan and its JSON format (`plan`).

May import: the ground floor, `engine.model`, `engine.cluster`, `engine.theory` and
`engine.spmd` (a stage is planned by the SPMD loop). Never the planner or anything above it.
"""
