"""Export: the plan, the cluster it was made for and their launch bundle, as one matching set, with the
bundle digest to pass along and the commands that run this plan."""
import streamlit as st

from app import services

st.title("Export")
graph, cluster, plan = services.current_plan("export")
out = services.export_set(services.plan_key(plan), cluster.fingerprint(), plan, cluster)
if out.note:
    st.info(out.note)
if out.plan is None:
    st.download_button("Download the per-GPU cluster.json", services.cluster_json(out.cluster),
                       file_name="cluster.json", mime="application/json", key="export.per_gpu_cluster")
    if st.button("Use the per-GPU cluster", key="export.use_per_gpu"):
        services.set_cluster(out.cluster, f"{cluster.name}, one device per GPU")
    st.stop()
plan, cluster = out.plan, out.cluster
pipeline = plan.parallelism == "pipeline"
st.markdown(f"plan.json, cluster.json and the launch bundle are one set: the plan was made for cluster "
            f"**{cluster.name}** ({plan.world_size} ranks, one per device). The plan {plan.device_use.line()}.")
st.download_button("Download plan.json (pipeline)" if pipeline else "Download plan.json", services.plan_json(plan),
                   file_name="plan.json", mime="application/json", type="primary", key="export.plan")
st.download_button("Download cluster.json", services.cluster_json(cluster), file_name="cluster.json",
                   mime="application/json", key="export.cluster")
bundle, message, digest = services.bundle_zip(services.plan_json(plan), services.cluster_json(cluster),
                                              services.model_file_of(plan))
if bundle is None:
    st.error(f"The launch bundle could not be built. {message}")
    st.stop()
st.download_button("Download launch bundle (zip)", bundle, file_name="hap_bundle.zip", mime="application/zip",
                   key="export.bundle")
st.markdown("**Bundle digest** (the sha256 of its manifest.json, which holds the sha256 of every other file). "
            "Send it apart from the bundle, e.g. in chat while the zip goes by mail, so whoever runs it can check "
            "that it is this bundle and no other:")
st.code(f"sha256:{digest}\n\nhap bundle check hap_bundle.zip --digest {digest}\n"
        f"hap run hap_bundle.zip --digest {digest} --steps 5 --verify", language="bash")
st.subheader("Run it")
machines = sorted({d.machine for d in cluster.devices})
if len(machines) > 1:
    st.markdown(f"Across its {len(machines)} machines: unzip the bundle on each machine and, in its folder, start "
                f"that machine's node (NODE_RANK 0 to {len(machines) - 1}, in the order the bundle's README lists "
                "the machines):")
    st.code(f"bash launch_node.sh NODE_RANK --digest {digest} --steps 100", language="bash")
if pipeline:
    st.markdown(f"On one machine, {plan.world_size} processes, one per device (NCCL on the GPUs where CUDA is present, "
                "else gloo on the CPU):")
    st.code("hap run plan.json --steps 5 --verify\n"
            "hap run hap_bundle.zip --steps 5 --verify  # the same through the launch bundle", language="bash")
    st.stop()
st.markdown(f"On one machine with {plan.world_size} processes, one per device (gloo on CPU, NCCL on GPUs):")
st.code(f"hap run plan.json --steps 5 --verify\n"
        f"torchrun --standalone --nproc-per-node={plan.world_size} -m runner.launch plan.json --steps 100 "
        f"--timing --metrics metrics.jsonl", language="bash")
st.markdown("Then upload `metrics.jsonl` on the Timeline page to see the measured timeline beside the predicted one.")
