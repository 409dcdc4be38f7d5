"""The background theory T (HAP §4.2): properties, Hoare triples, and per-family operator rules.

Owns: the property forms (Full, Shard(d), Partial), the rule registry and the integer rounding of
uneven shards (`core`), the collectives' triples (`collectives`), one module per operator family
(pointwise, matmul, einsum, reduction, view, norm, embedding, attention, conv, pool, moe,
random_ops, fft, ...), the checker that runs every rule on simulated shards (`check`), and the table of
the Core ATen operator set (`op_table`). Importing this package registers every family module's
rules in the registry of `core`.

May import: the ground floor and `engine.model` (the graph IR the rules read, the reference ops the
checker runs). Nothing of the cluster, the cost model or the planners.
"""
from engine.theory import (attention, batchnorm, conv, einsum, embedding, fft, index,  # noqa: F401; (registers rules)
                           loss, matmul, moe, norm, opaque, pointwise, pool, random_ops, reduction, shape, shift,
                           stage, view)
from engine.theory.collectives import COLLECTIVES, Collective, collectives_from
from engine.theory.core import (FULL, PARTIAL, Form, OpRule, form_long, form_str, leaf_forms, missing_rules, op_rules,
                                parse_form, registered_ops)

__all__ = ["FULL", "PARTIAL", "Form", "OpRule", "form_long", "form_str", "leaf_forms", "missing_rules", "op_rules",
           "parse_form", "registered_ops", "COLLECTIVES", "Collective", "collectives_from"]
