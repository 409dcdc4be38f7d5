"""Typed errors of the engine: each message names the bad field or cause and how to fix it."""


class HapError(Exception):
    """Base class of every error the engine raises for a user to act on."""


class ClusterError(HapError, ValueError):
    """A cluster description is malformed or physically impossible."""


class ModelError(HapError, ValueError):
    """A model cannot be loaded, captured or recognised (unknown zoo name or knob, bad graph JSON)."""


class UnsupportedOpError(ModelError):
    """The captured graph holds operators with no sharding rule."""


class ParameterWriteError(ModelError):
    """The model's forward writes a parameter's values in place (a weight clip inside forward): an update of the
    state outside autograd and the optimizer, which a captured program cannot hold."""


class BuildError(ModelError):
    """A model class does not build from its config (transformers' own check failed, or a size is unset)."""


class MissingInputError(ModelError):
    """The model's forward refuses the batch for an input the batch does not make (a draft model's forward takes
    its main model's states)."""


class PlanError(HapError, ValueError):
    """A plan file is malformed or does not match the model/cluster it is used with."""


class InfeasibleError(HapError):
    """No distributed program fits the cluster (e.g. it runs out of device memory)."""


class BundleError(HapError, ValueError):
    """A launch bundle cannot be made (the plan does not fit the runner) or is invalid (changed, unsafe)."""
