"""The warm torchrun of the tests (warm_run.py) stands in for torchrun faithfully: the command it accepts, the
environment its ranks get, the summary its failures end with (read by `hap run` as torchrun's)."""
from __future__ import annotations

import inspect
import os
import re
import sys
import types

import pytest
from dist_harness import run_ranks
from warm_run import failure_summary, parse_command, rank_environ

from runner.torchrun import failed_rank, failed_ranks, torchrun_command


@pytest.mark.parametrize("module, argv", [("runner.launch", ["p.json", "--steps", "3", "-m", "x"]),
                                          ("runner.profile", ["--out", "c.json"])])
def test_it_reads_back_the_command_runner_torchrun_makes_and_refuses_another(module, argv):
    assert parse_command(torchrun_command(3, argv, module)) == (3, module, argv)
    other = torchrun_command(3, argv, module)
    other.insert(3, "--max-restarts=2")
    with pytest.raises(ValueError, match="not a torchrun command of runner.torchrun"):
        parse_command(other)


def test_a_rank_gets_every_variable_torchruns_agent_sets_with_rank_0_hosting_the_store():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    agent_sets = set(re.findall(r'"([A-Z_]+)":', inspect.getsource(LocalElasticAgent._start_workers)))
    assert {"RANK", "WORLD_SIZE", "MASTER_PORT"} <= agent_sets, "the agent's source changed shape"
    env = rank_environ({"PATH": "/bin", "TORCHELASTIC_USE_AGENT_STORE": "True"}, 2, 4, 29400, "run")
    assert agent_sets - {"TORCHELASTIC_USE_AGENT_STORE"} <= set(env), agent_sets - set(env)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "2", "4", "4")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["PATH"]) == ("127.0.0.1", "29400", "/bin")
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env  # no agent: rank 0's env:// store
    assert env["OMP_NUM_THREADS"] == "1"  # torchrun's default for more than one process per node
    assert rank_environ({"OMP_NUM_THREADS": "3"}, 0, 4, 1, "r")["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in rank_environ({}, 0, 1, 1, "r")


def test_its_failure_summary_is_torchruns_as_hap_run_reads_it():
    text = failure_summary("runner.launch", {3: -9, 1: 1}, [100, 101, 102, 103])
    assert text.startswith("Traceback (most recent call last)")  # held back by hap run's relay
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in text and "runner.launch FAILED" in text
    assert failed_rank(text) == (1, 1)  # the root cause: the first failure seen (the lowest rank, as torchrun)
    assert sorted(failed_ranks(text)) == [(1, 1), (3, -9)]


def _main_ran(rank: int, world_size: int, init_method: str, marker: str) -> bool:
    return os.path.exists(marker)


def test_ranks_never_rerun_the_main_file_a_streamlit_apptest_leaves_behind(tmp_path, monkeypatch):
    """AppTest leaves the page it ran as `__main__`; multiprocessing would run it again in every rank."""
    marker = tmp_path / "page-ran"
    page = tmp_path / "page.py"
    page.write_text(f"open({str(marker)!r}, 'w').close()\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(page)
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert run_ranks(_main_ran, 2, tmp_path / "ranks", str(marker)) == [False, False]
    assert not marker.exists() and sys.modules["__main__"] is main
