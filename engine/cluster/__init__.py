"""The cluster: devices, machines and links, and what they cost to talk over.

Owns: the cluster spec, its validation and fingerprint, fitted collective costs (`spec`), and
hierarchical collectives priced per link level (`hierarchy`).

May import: `engine.errors`, `engine.limits`. Nothing of the model, the theory or the planners.
"""
