"""HAP Workbench engine: plans SPMD training of one model on a heterogeneous cluster (HAP, EuroSys '24)."""
from .capture import load_model
from .graph import Graph, Node
