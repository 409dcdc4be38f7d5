"""The model: the graph IR and everything that makes one.

Owns: the graph IR (`graph`), capture from a `torch.nn.Module` with `torch.export` (`capture`),
model sources (zoo names, model files, `hf:` classes, graph JSON; `source`), the built-in zoo
(`zoo/`), reference implementations of every captured operator (`ops`) and exact dropout masks
per shard (`dropout`).

May import: `engine.errors`, `engine.limits`, `engine.timeline`, and `engine.theory.einsum` (equation
parsing). Nothing of the cluster, the plan kinds or the planners.
"""
