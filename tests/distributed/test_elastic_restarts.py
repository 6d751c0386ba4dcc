"""Devices that follow the batch, through real TorchElastic restarts (two torchrun agents on loopback, gloo on CPU).

``tests/support/fault_worker.py --elastic 2`` runs under ``torchrun --nnodes=1:2`` with
``SimiGrad(elastic=Elastic(max_accumulation=2, max_nodes=2, on_request="continue"))``: micro-batches of at most 6
samples, at most 2 a rank, so once the batch passes 12 samples one rank wants a second node. The test plays the
cluster manager:

1. node 0 starts alone (world 1); when its batch outgrows it, SimiGrad writes the request beside its checkpoints;
2. the test reads it and starts node 1: TorchElastic stops node 0's worker with SIGTERM (SimiGrad saves where it
   stopped) and starts both at world 2, which resume with ``ckpt_path="last"``;
3. once world 2 has trained a few steps, the test kills node 1 (its launcher and worker, SIGKILL): node 0's worker
   fails on its next collective, torchrun restarts it at world 1 from the latest checkpoint, and the fit finishes.

Over the steps the run kept (each group's steps up to where the next group resumed): every sample of every epoch once,
the steps numbered without gap, the steps after the last checkpoint that the third group trained again equal to the
second group's (batch sizes, samples), and no step that finished before the SIGTERM trained again.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from lightning_simigrad import Elastic, ResizeRequest
from tests.distributed.test_fault_tolerance import (
    LAUNCH_TIMEOUT,
    WORKER,
    environment,
    kill_all,
    listening,
    process_tree,
    torchrun,
    wait_for,
)

N, EPOCHS = 203, 6  # fault_worker's samples; epochs enough for every phase
CHECKPOINT_EVERY = 4  # fault_worker's --every: a checkpoint when 4, 8, ... steps are done


def groups(out: Path) -> list[dict]:
    """Every group of processes (one start), in the order they started: its world, the steps it resumed from, and
    each step's rows from all its ranks."""
    by_leader: dict[int, list[list[dict]]] = defaultdict(list)
    for path in sorted(out.glob("log.rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert rows[0]["event"] == "start"
        by_leader[rows[0]["leader"]].append(rows)
    found = []
    for processes in by_leader.values():
        start = processes[0][0]
        assert len(processes) == start["world"]  # every rank of the group logged
        steps: dict[int, list[dict]] = defaultdict(list)
        for rows in processes:
            for row in rows[1:]:
                if row["event"] == "step":
                    steps[row["step"]].append(row)
        found.append(dict(world=start["world"], resumed=start["resumed_steps"], steps=steps))
    # by the steps each resumed from; the last group may resume from the second's own checkpoint (world 2 then
    # wrote none), and it comes after
    return sorted(found, key=lambda g: (g["resumed"], g["world"] == 1 and g["resumed"] > 0))


def whole(rows: list[dict], world: int) -> dict | None:
    """A step every rank of the group finished, with the samples of all of them (None: some rank did not log it)."""
    if len(rows) != world:
        return None
    assert len({(r["batch_size"], r["similarity"]) for r in rows}) == 1  # the ranks agree on the step's decision
    return {
        "batch_size": rows[0]["batch_size"],
        "epoch": rows[0]["epoch"],
        "samples": sorted(i for r in rows for i in r["samples"]),
    }


@pytest.mark.slow
@pytest.mark.timeout(4 * LAUNCH_TIMEOUT)
def test_the_run_asks_for_a_node_grows_onto_it_survives_its_loss_and_loses_nothing(tmp_path, master_port, reserve_port):
    port = master_port  # the rendezvous, hosted by node 0's torchrun
    launcher = ["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d", "--rdzv-id=elastic"]
    launcher += ["--rdzv-conf=last_call_timeout=2", "--monitor-interval=1"]
    worker = [str(WORKER), "--out", str(tmp_path), "--elastic", "2", "--step-sleep", "0.05", "--epochs", str(EPOCHS)]
    worker += ["--every", str(CHECKPOINT_EVERY)]
    worker += ["--master-port", str(reserve_port())]  # the workers' group store, on rank 0, in every group

    def node(name: str) -> subprocess.Popen:
        command = torchrun(*launcher, f"--rdzv-endpoint=127.0.0.1:{port}", *worker)
        log = (tmp_path / f"{name}.out").open("w")
        return subprocess.Popen(
            command, env=environment(tmp_path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    request_path = tmp_path / "checkpoints" / Elastic.REQUEST
    nodes = [node("node0")]
    try:
        wait_for(lambda: listening(port), "node 0 to host the rendezvous", *nodes)
        wait_for(request_path.exists, "the request for a second node", *nodes)
        request = ResizeRequest.read(request_path)
        assert (request.nodes, request.world_size, request.current_world_size) == (2, 2, 1)
        nodes.append(node("node1"))

        def trained_at_two(steps: int) -> bool:
            """World 2 trained ``steps`` steps, the last of them the first after a checkpoint: node 1 is lost a step
            or two later, before the next checkpoint, so the last group trains those steps again (lost right after
            a checkpoint, as a kill after a fixed count of steps can be, there would be nothing to replay)."""
            for g in groups(tmp_path):
                done = sorted(s for s, rows in g["steps"].items() if len(rows) == 2)
                if g["world"] == 2 and len(done) >= steps and done[-1] % CHECKPOINT_EVERY == 0:
                    return True
            return False

        wait_for(lambda: trained_at_two(6), "world 2 to train 6 steps, the last one after a checkpoint", *nodes)
        kill_all(process_tree(nodes[1].pid))  # node 1 lost: its launcher and its worker, at once
        nodes[1].wait()
        code = nodes[0].wait(LAUNCH_TIMEOUT + 60)
    finally:
        for n in nodes:
            kill_all(process_tree(n.pid) if n.poll() is None else [])
    assert code == 0, (tmp_path / "node0.out").read_text()[-5000:]

    found = groups(tmp_path)
    assert [g["world"] for g in found] == [1, 2, 1]  # alone, grown onto the second node, alone again
    first, grown, alone = found
    # SIGTERM: the group at world 2 resumed right after the last step world 1 finished (nothing finished was lost,
    # nothing trained twice), from the checkpoint SimiGrad wrote when TorchElastic stopped the worker
    assert grown["resumed"] == max(first["steps"]) + 1 > request.step
    # node 1 lost: the last group resumed from a checkpoint world 2 wrote, and trained its later steps again alike
    assert grown["resumed"] <= alone["resumed"] <= max(grown["steps"])
    again = [s for s in alone["steps"] if s <= max(grown["steps"]) and len(grown["steps"][s]) == 2]
    assert again, "the last group trained some of world 2's steps again"
    for s in again:
        before, after = whole(grown["steps"][s], 2), whole(alone["steps"][s], 1)
        assert after == before, f"step {s}: the steps after the checkpoint are replayed exactly"

    # the steps the run kept: each group's until the next group resumed
    kept = []
    bounds = [g["resumed"] for g in found[1:]] + [None]
    for group, end in zip(found, bounds):
        for s in sorted(group["steps"]):
            if end is None or s < end:
                step = whole(group["steps"][s], group["world"])
                assert step is not None, f"step {s} of a group that continued past it was not logged by every rank"
                kept.append((s, step))
    assert [s for s, _ in kept] == list(range(len(kept)))
    for epoch in range(EPOCHS):
        fed = [i for _, step in kept if step["epoch"] == epoch for i in step["samples"]]
        assert sorted(fed) == list(range(N)), f"epoch {epoch}: every sample exactly once across the changes"
