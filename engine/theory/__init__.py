"""The background theory T (HAP §4.2): properties, Hoare triples, and per-family operator rules.

Importing this package registers every family module's rules in the registry of `core`.
"""
from . import (attention, batchnorm, conv, einsum, embedding, index, loss, matmul, moe, norm, opaque,  # noqa: F401
               pointwise, pool, reduction, shape, shift, stage, view)  # (registers rules)
from .core import FULL, PARTIAL, Form, OpRule, form_long, form_str, leaf_forms, missing_rules, op_rules, parse_form, registered_ops
from .collectives import COLLECTIVES, Collective, collectives_from

__all__ = ["FULL", "PARTIAL", "Form", "OpRule", "form_long", "form_str", "leaf_forms", "missing_rules", "op_rules",
           "parse_form", "registered_ops", "COLLECTIVES", "Collective", "collectives_from"]
