"""Tests of engine.theory: every sharding rule checked numerically on simulated devices."""
