"""Execution of plans over torch.distributed (see issue: runner)."""
