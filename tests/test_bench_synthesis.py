"""bench/synthesis.py's case selection: `--gpt-only` keeps exactly the 8-device GPT depths asked for."""
from __future__ import annotations

from conftest import load_bench


def _bench():
    return load_bench("synthesis")


def test_gpt_only_keeps_the_8_device_gpt_depths_and_nothing_else():
    bench = _bench()
    cases = bench.selected_cases([24, 48], gpt_only=True)
    assert [(c.get("layers"), c.get("model"), c["cluster"]) for c in cases] == [(24, None, bench.MACHINES),
                                                                                (48, None, bench.MACHINES)]


def test_default_selection_also_runs_the_64_device_vision_and_language_cases():
    bench = _bench()
    cases = bench.selected_cases([24])
    assert (12, bench.TESTBED_64) in [(c.get("layers"), c["cluster"]) for c in cases]
    models = {c.get("model") for c in cases}
    assert set(bench.VISION) <= models and set(bench.LANGUAGE) <= models
    vision = bench.selected_cases([24], vision_only=True)
    assert vision and {c["model"] for c in vision} == set(bench.VISION)
