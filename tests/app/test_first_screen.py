"""The first screen explains itself (issue 30, item 5): what the workbench is, the three steps, why the plan's
ratios look as they do; the default cluster exports as it is; the paper's testbed is one click away."""
from __future__ import annotations

from ui_helpers import app, cpu_cluster, no_exception, open_page, tiny_plan  # noqa: F401 (fixtures)

from app import services
from app.services import Keys
from engine.compare import ratio_reason


def test_first_screen_says_what_the_workbench_is_the_three_steps_and_why_the_ratios(app, tiny_plan, cpu_cluster):
    at = open_page(app, "plan")
    no_exception(at)
    text = [m.value for m in at.markdown]
    assert text[0].startswith("The **HAP workbench** plans the training of one model on a cluster of unlike GPUs.")
    links = [link.proto.label for link in at.get("page_link")]
    assert [label.split(":")[0] for label in links] == ["1. Model", "2. Cluster", "3. Search"]
    why = ratio_reason(tiny_plan, cpu_cluster).sentence()
    assert f"**Why these ratios.** {why}" in text


def test_default_cluster_is_one_device_per_gpu_so_its_plans_export_as_they_are(cpu_cluster):
    """The AppTest fixtures plan on the default cluster, so the export tests (test_current_plan, test_export_page)
    build its plans' bundles as they are; `hap run BUNDLE --steps 1 --verify` of the default model's plan on it
    passes on 4 CPU ranks (about 2 minutes: run by hand, not in the suite)."""
    default = services.sample_cluster(services.DEFAULT_CLUSTER)
    assert default == cpu_cluster and all(d.num_gpus == 1 for d in default.devices)


def test_the_paper_testbed_is_one_click_away(app, tiny_plan):
    at = open_page(app, "plan")
    at.button(key="plan.testbed").click().run()
    no_exception(at)
    plan, cluster = at.session_state[Keys.PLAN], at.session_state[Keys.CLUSTER]
    assert cluster.name == plan.cluster_name == "hap_paper_testbed_machines"
    assert plan.options == tiny_plan.options and not at.warning
    assert not [b for b in at.button if b.key == "plan.testbed"]  # already there
    assert "hap_paper_testbed_machines (8 devices)" in at.sidebar.caption[1].value
