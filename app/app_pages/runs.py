"""Runs: loss and eval-loss curves, learning rate, grad norm and throughput of `hap run --metrics` files, and
the measured step time beside the session plan's predicted one."""
import streamlit as st

from app import runs
from app import services
from engine.views import charts

st.title("Runs")
st.markdown("Upload the metrics of a training run (`hap run PLAN --metrics FILE`), or of several runs to compare "
            "them. Loss is the step's global loss (rank 0's record); evaluation loss appears where the run "
            "evaluated (`--eval-data PATH --eval-every N`). Older files without a learning rate, gradient norm "
            "or evaluations load too.")
uploads = st.file_uploader("Runner metrics (JSON lines)", type=["jsonl", "json", "txt"], accept_multiple_files=True,
                           key="runs.metrics")
if not uploads:
    st.info("No metrics yet: upload the file `hap run PLAN --metrics FILE` wrote.")
    st.stop()
loaded = []
for name, upload in zip(runs.unique_names([u.name for u in uploads]), uploads):
    try:
        loaded.append(runs.load_run(name, upload.getvalue().decode("utf-8", errors="replace")))
    except runs.MetricsError as e:
        st.error(str(e))
if not loaded:
    st.stop()
for note in runs.run_notes(loaded):
    st.warning(note)

st.dataframe(runs.summary_rows(loaded), hide_index=True, column_config={
    **{k: st.column_config.NumberColumn(k.replace("_", " "), format="%.4f") for k in runs.LOSS_COLUMNS},
    "eval_drop_%": st.column_config.NumberColumn("eval-loss drop", format="%.1f%%"),
    "tokens_per_s": st.column_config.NumberColumn("mean tokens/s", format="%.0f"),
    "step_ms": st.column_config.NumberColumn("mean step (ms)", format="%.2f"),
    "mfu_%": st.column_config.NumberColumn("MFU", format="%.1f%%")})
st.caption("Means are over the steps after the first (it pays allocation and warm-up), at the run's final world size.")
names = [r.name for r in loaded]
st.altair_chart(charts.loss_chart(runs.loss_rows(loaded), names), width="stretch")
for column, (field, title, axis) in zip(st.columns(3), runs.SERIES_CHARTS):
    if runs.recorded(loaded, field):
        column.altair_chart(charts.step_series_chart(runs.field_rows(loaded, field), names, title, axis), width="stretch")
    else:
        column.caption(f"**{title}**: not recorded in these metrics.")

st.subheader("Step time against the plan")
graph, cluster, plan = services.current()
if plan is None:
    st.info("No plan in this session: plan one on the Search page to draw its predicted step time beside these.")
elif not (status := services.current_status()).current:
    st.info(f"{status.message} Plan again to draw its predicted step time beside these runs.")
    plan = None
comparable = []
for run in loaded if plan is not None else []:
    if problem := runs.world_mismatch(run, plan.world_size):
        st.warning(problem)
    else:
        comparable.append(run)
accum = 1
if any(r.grad_accum is None for r in comparable):
    accum = st.number_input("Microsteps per step (`--grad-accum`)", min_value=1, value=1, key="runs.grad_accum",
                            help="A plan's iteration is one microstep; a step of K microsteps is predicted to take K of them.")
comparisons = [runs.compare_to_plan(r, plan.predicted_time_s, accum) for r in comparable]
predicted = [{"run": c.run, "predicted_ms": c.predicted_s * 1e3} for c in comparisons]
st.altair_chart(charts.step_time_chart(runs.field_rows(loaded, "step_time_s", 1e3), names, predicted), width="stretch")
if comparisons:
    st.dataframe(runs.comparison_rows(comparisons), hide_index=True)
