"""SPMD planning (HAP): the program Q, the ratios B and the loop between them.

Owns: the distributed program's instructions (`program`), A* program synthesis over the
theory's Hoare triples (`synthesis`, HAP §4), the stage cost and memory model (`cost`, §3.2) with
what autograd keeps for backward (`saved`), gradient-bucket and duplex overlap (`overlap`,
`halves`), the LP for the ratios (`balance`, §5), segments with their own ratios (`segments`,
§5.2), integer shard sizes (`sizes`, §5.1), the data-parallel seeds (`baselines`), the Q<->B
iteration (`iteration`, §3.1) with auto's overlap modes searched side by side (`side_by_side`), the plan format (`plan`) and its validator (`validate`), and model
FLOPs, the compute bound and MFU of a plan of either kind (`utilisation`).

May import: the ground floor (`engine.errors`, `engine.limits`, `engine.timeline`,
`engine.options`), `engine.model`, `engine.cluster`, `engine.theory`. Never `engine.pipeline`,
the planner, or anything above it.
"""
