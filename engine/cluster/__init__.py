"""The cluster: devices, machines and links, and what they cost to talk over.

Owns: the cluster spec, its validation and fingerprint, fitted collective costs (`spec`),
hierarchical collectives priced per link level (`hierarchy`), and the per-GPU view of a
cluster of virtual devices (`per_gpu`).

May import: `engine.errors`, `engine.limits`. Nothing of the model, the theory or the planners.
"""
