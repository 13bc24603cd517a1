"""Across nodes, on the real engines (issue 29), on one machine over loopback:

- a study on a real two-node Ray cluster (``ray.cluster_utils.Cluster``: a head and a second
  node, each a raylet of its own): its runs spread over both nodes; the second node is
  killed mid-study; no finished run is lost, and the rerun completes the study with every run
  recorded once and no finished run executed again;
- ``batchbound train`` under torchrun on two nodes (two agents, c10d rendezvous on a free
  port): the second node is killed mid-run (its agent and worker, as a machine that dies),
  a new agent takes its place, and the first agent's restart (``--max-restarts``) resumes
  both ranks from the checkpoint; the result is the uninterrupted run's (float64, 1e-12).

Each takes one to three minutes on two shared cores: marked ``slow`` (``make test-slow``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bad_input import FAULT
from study_processes import descendants, finish, log_entries, log_nodes, start_study
from test_study_runner_faults import SPEC

from batchbound.study.store import Store
from batchbound.train.distributed import free_port

pytestmark = [pytest.mark.slow, FAULT]


def wait_until(condition, proc: subprocess.Popen, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_ray_study_on_two_nodes_survives_losing_one(tmp_path, monkeypatch):
    ray_cluster = pytest.importorskip("ray.cluster_utils")
    spec, store, log = tmp_path / "spec.toml", tmp_path / "s.sqlite", tmp_path / "log"
    spec.write_text(SPEC.replace("max_epochs = 6", "max_epochs = 12"))
    # the Ray workers are the cluster's children: they read the simulated trainer's settings
    # from this environment, not the driver's
    monkeypatch.setenv("BATCHBOUND_SIM_LOG", str(log))
    monkeypatch.setenv("BATCHBOUND_SIM_SLEEP", "0.4")
    node_args = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    cluster = ray_cluster.Cluster(initialize_head=True,
                                  head_node_args={**node_args, "include_dashboard": False})
    try:
        second = cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray_args = ("--executor", "ray", "--address", cluster.address)
        proc = start_study(spec, store, log, sleep=0.4, jobs=2, extra=ray_args)
        wait_until(lambda: len(log_nodes(log)) == 2, proc, 300, "runs on both nodes")
        on_second = log_nodes(log)[second.node_id]
        assert len(log_nodes(log)) == 2 and on_second  # spread over the head and the second
        cluster.remove_node(second)  # its raylet and the workers on it are killed
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err.decode()  # the runs on the lost node failed
        with Store(store) as s:
            statuses = dict(s.db.execute("SELECT key, status FROM runs").fetchall())
        finished = {k for k, st in statuses.items() if st == "complete"}
        assert statuses and finished != set(statuses)  # lost ones are not marked complete
        assert {statuses[k] for k in on_second} - {"complete"}  # the killed node's run

        before = len(log_entries(log))
        finish(start_study(spec, store, log, sleep=0.4, jobs=2, extra=ray_args))
        again = [key for key, _ in log_entries(log)[before:]]
        assert not set(again) & finished  # no finished run executed again
        assert len(again) == len(set(again)) == len(statuses) - len(finished)
        with Store(store) as s:
            rows = s.db.execute("SELECT key, status FROM runs").fetchall()
            linked = s.db.execute("SELECT COUNT(*) FROM study_runs").fetchone()[0]
        assert len(rows) == len(statuses) == linked == 4  # every run recorded once
        assert {st for _, st in rows} == {"complete"}
    finally:
        cluster.shutdown()


# ------------------------------------------------------------------ torchrun, two nodes

TRAIN = ["--dataset", "digits", "--model", "fc(depth=1,params=800)", "-B", "32",
         "--dtype", "float64", "--max-iterations", "1500", "--eval-every-iterations", "500",
         "--checkpoint-every", "25", "--no-stop-at-targets", "--no-progress", "--json"]


def agent(node: int, port: int, checkpoint: Path, log: Path) -> subprocess.Popen:
    """One node's torchrun agent with one worker."""
    # LOGLEVEL: the agents' restarts show in their logs. Torch 2.13's agents share their
    # rendezvous TCPStore with the workers by default, and then a node that joins after a
    # restart waits forever for the round's MASTER_ADDR, which the surviving agent (rank 0,
    # its store already made) never writes again; without sharing, every round writes it
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "LOGLEVEL": "INFO",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "issue29", "--rdzv-conf",
               "keep_alive_interval=1,keep_alive_max_attempt=3", "--max-restarts", "3",
               "--monitor-interval", "0.5", "-m", "batchbound", "train", *TRAIN,
               "--workers", "2", "--checkpoint", str(checkpoint), "--stall-timeout", "30"]
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def summary(log: Path) -> dict:
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    assert len(lines) == 1, log.read_text()[-3000:]
    return json.loads(lines[0])


def test_torchrun_on_two_nodes_resumes_after_losing_one(tmp_path):
    port = free_port()
    checkpoint = tmp_path / "ck.pt"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node1-new.log"]
    first = agent(0, port, checkpoint, logs[0])  # hosts the rendezvous
    time.sleep(2)
    second = agent(1, port, checkpoint, logs[1])
    try:
        wait_until(checkpoint.exists, first, 300, "the first checkpoint")
        for pid in [second.pid, *descendants(second.pid)]:  # the machine dies: its agent and
            os.kill(pid, signal.SIGKILL)  # its worker (in a session of its own) at once
        second.wait(timeout=30)
        # the surviving rank names the lost one and fails; its agent restarts the group and
        # waits for a second node; the replacement joins once the dead one's keep-alive has
        # lapsed (3 s), as a new machine would
        wait_until(lambda: "will restart worker group" in logs[0].read_text(), first, 120,
                   "the restart")
        time.sleep(5)
        replacement = agent(1, port, checkpoint, logs[2])
        assert first.wait(timeout=600) == 0, logs[0].read_text()[-3000:]
        assert replacement.wait(timeout=120) == 0, logs[2].read_text()[-3000:]
    finally:
        for proc in (first, second):
            for pid in [proc.pid, *descendants(proc.pid)] if proc.poll() is None else []:
                os.kill(pid, signal.SIGKILL)
    text = "".join(log.read_text() for log in logs)
    assert "resuming from the checkpoint" in text, text[-3000:]  # the restart resumed
    resumed = summary(logs[0] if "{" in logs[0].read_text() else logs[2])
    assert resumed["status"] == "complete" and resumed["final"]["iterations"] == 1500

    # the same run without a fault, on two local ranks: the same numbers, up to the order of
    # float additions (torchrun's workers compute on more threads than local ranks)
    done = subprocess.run([sys.executable, "-m", "batchbound", "train", *TRAIN, "--workers",
                           "2"], capture_output=True, text=True, timeout=600, check=True)
    whole = json.loads(done.stdout.strip().splitlines()[-1])
    for metric in ("train_loss", "test_loss", "train_acc", "test_acc", "batch_loss"):
        assert resumed["final"][metric] == pytest.approx(whole["final"][metric], rel=1e-12)
