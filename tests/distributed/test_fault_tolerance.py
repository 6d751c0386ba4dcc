"""Nothing lost when a process or a node dies: real kills under torchrun, gloo on CPU, resuming from ``"last"``.

Each scenario launches ``tests/support/fault_worker.py`` (2 ranks, 203 samples, 2 epochs, a checkpoint every 4
optimizer steps, the batch growing every step), injects one fault in the first attempt, lets torchrun restart the
group and reads back what every attempt of every rank trained. A step is *committed* when a later attempt resumed from a
checkpoint that includes it, or when it belongs to the attempt that finished. Over the committed steps:

- every sample of every epoch is trained exactly once;
- the steps are numbered without gap, and batch sizes, samples, samples seen and LR factors are those of an
  uninterrupted run of the same script (the resumed attempt continues the checkpoint's batch-size history), its
  similarities too, to rounding;
- the final weights are bitwise those of the uninterrupted run.

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a restarted gloo group otherwise meets the previous
attempt's addresses), ``--max-restarts=1`` (the one restart the fault calls for: the assertions expect exactly two
attempts, so a further one would fail the test anyway) and inside ``timeout``, with ``TMPDIR`` in the test's own
folder (a checkpoint file killed half-written stays behind as a temporary file); see the README's "Fault
tolerance". The workers' group store and the two nodes' rendezvous are on ports reserved for the test
(``benchmarks/_ports.py``): torchrun would give the workers a port it bound and released.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from benchmarks._ports import reserved_port

WORKER = Path(__file__).resolve().parents[1] / "support" / "fault_worker.py"
N = 203  # fault_worker.N
EPOCHS = 2
LAUNCH_TIMEOUT = 600  # seconds, for one torchrun launch (the machine may be busy)

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_RANK", "NODE_RANK", "MASTER_"))} | {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    "OMP_NUM_THREADS": "1",
}


def torchrun(*launcher: str) -> list[str]:
    return ["timeout", str(LAUNCH_TIMEOUT), sys.executable, "-m", "torch.distributed.run", *launcher]


def environment(out: Path) -> dict[str, str]:
    """The launch's environment: temporary files (fsspec writes checkpoints through one) go into ``out``."""
    return ENV | {"TMPDIR": str(out)}


def launch_one_node(out: Path, *faults: str) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    launcher = ["--nnodes=1", "--nproc-per-node=2", "--max-restarts=1", "--rdzv-backend=c10d"]
    with reserved_port() as port:  # the rendezvous: torchrun binds port 0 itself and keeps it
        worker = [str(WORKER), "--out", str(out), "--master-port", str(port), *faults]
        command = torchrun(*launcher, "--rdzv-endpoint=127.0.0.1:0", *worker)
        done = subprocess.run(
            command, env=environment(out), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT + 60
        )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    return done


def read_log(out: Path) -> list[dict]:
    """One entry per process (an attempt of a rank): its start row, step rows, and whether it finished."""
    runs = []
    for path in sorted(out.glob("log.rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert rows[0]["event"] == "start"
        rank = int(path.name.split(".")[1].removeprefix("rank"))
        steps = [r for r in rows if r["event"] == "step"]
        runs.append(dict(rank=rank, start=rows[0], steps=steps, done=rows[-1]["event"] == "done"))
    return runs


def committed_steps(runs: list[dict], world: int = 2) -> list[dict]:
    """The steps a checkpoint or the end of the fit kept, each with the samples of all ranks."""
    by_generation = defaultdict(list)  # the steps an attempt resumed from tell its processes apart
    for run in runs:
        by_generation[run["start"]["resumed_steps"]].append(run)
    starts = sorted(by_generation)
    steps = []
    for start, end in zip(starts, starts[1:] + [None]):
        ranks = by_generation[start]
        assert sorted(r["rank"] for r in ranks) == list(range(world))  # one process per rank per attempt
        kept = [[s for s in r["steps"] if end is None or s["step"] < end] for r in ranks]
        for per_rank in zip(*kept, strict=True):
            assert len({s["step"] for s in per_rank}) == 1  # the ranks agree on the step ...
            assert len({(s["batch_size"], s["similarity"]) for s in per_rank}) == 1  # ... and on its decision
            row = {k: v for k, v in per_rank[0].items() if k not in ("samples", "event")}
            steps.append(row | {"samples": sorted(i for s in per_rank for i in s["samples"])})
    return steps


def final_weights(out: Path) -> dict:
    (path,) = out.glob("final.pid*.pt")  # only the attempt that finished the fit saves them
    return torch.load(path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[list[dict], dict]:
    out = tmp_path_factory.mktemp("uninterrupted")
    launch_one_node(out)
    runs = read_log(out)
    assert len(runs) == 2 and all(r["done"] for r in runs)
    return committed_steps(runs), final_weights(out)


def assert_nothing_lost(out: Path, uninterrupted: tuple[list[dict], dict], resumed_from: int) -> list[dict]:
    reference, reference_weights = uninterrupted
    runs = read_log(out)
    steps = committed_steps(runs)
    first = [r for r in runs if r["start"]["resumed_steps"] == 0]
    # the first attempt trained past the checkpoint it was later resumed from: that work was lost and redone
    assert max(s["step"] for r in first for s in r["steps"]) >= resumed_from
    assert sorted({r["start"]["resumed_steps"] for r in runs}) == [0, resumed_from]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    for epoch in range(EPOCHS):
        fed = [i for s in steps if s["epoch"] == epoch for i in s["samples"]]
        assert sorted(fed) == list(range(N)), f"epoch {epoch}: every sample exactly once"
    # the batch-size history continues from the checkpoint's, and equals the uninterrupted run's. Similarities
    # agree to rounding: DDP regroups its gradient buckets after a process's first backward, which changes the
    # order the measurement adds its per-bucket sums in (the gradients themselves are unaffected)
    assert [{**s, "similarity": None} for s in steps] == [{**s, "similarity": None} for s in reference]
    assert [s["similarity"] for s in steps] == pytest.approx([s["similarity"] for s in reference], rel=1e-12)
    weights = final_weights(out)
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)
    return runs


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)
def test_a_rank_killed_mid_window_is_restarted_by_torchrun_and_loses_nothing(tmp_path, uninterrupted):
    launch_one_node(tmp_path, "--kill-at", "10")  # SIGKILL rank 1 in the middle of window 10
    assert (tmp_path / "kill.fired").exists()
    runs = assert_nothing_lost(tmp_path, uninterrupted, resumed_from=8)  # the checkpoint after step 8
    assert {r["start"]["restart"] for r in runs if r["start"]["resumed_steps"] == 8} == {1}  # torchrun's restart


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)
def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path, uninterrupted):
    # rank 0 (the one that writes checkpoints) dies halfway through writing its 6th checkpoint file: last.ckpt after
    # step 12 (step=12.ckpt is whole)
    launch_one_node(tmp_path, "--crash-writing", "6")
    assert (tmp_path / "crash.fired").exists()
    assert_nothing_lost(tmp_path, uninterrupted, resumed_from=8)  # the last.ckpt that was whole: after step 8
    reference, _ = uninterrupted
    for path in (tmp_path / "checkpoints").glob("*.ckpt"):  # every checkpoint file loads, with its step's state
        checkpoint = torch.load(path, weights_only=False)
        state = checkpoint["callbacks"]["SimiGrad"]
        counts = state["counts"]
        assert counts["steps"] == checkpoint["global_step"]
        assert counts["samples_seen"] == reference[counts["steps"] - 1]["samples_seen"]


def wait_for(condition, what: str, *nodes: subprocess.Popen) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not condition():
        assert all(n.poll() is None for n in nodes), f"a node exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
        except OSError:
            continue  # exited meanwhile
        children[int(rest.rsplit(") ", 1)[1].split()[1])].append(int(pid))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children[pid]
    return tree


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signal.SIGKILL)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(4 * LAUNCH_TIMEOUT)
def test_a_node_killed_with_its_launcher_is_replaced_and_loses_nothing(
    tmp_path, uninterrupted, master_port, reserve_port
):
    """Two "nodes" on loopback, one rank each: node 1 (its torchrun and its worker) is SIGKILLed while its rank
    is in the middle of window 10; a new node 1 joins the rendezvous, node 0's torchrun restarts its worker."""
    port = master_port  # the rendezvous, hosted by node 0's torchrun
    launcher = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-id=fault"]
    worker = [str(WORKER), "--out", str(tmp_path), "--devices", "1", "--nodes", "2", "--hang-at", "10"]
    worker += ["--master-port", str(reserve_port())]  # the workers' group store, on rank 0, in every attempt

    def node(name: str) -> subprocess.Popen:
        command = torchrun(*launcher, f"--rdzv-endpoint=127.0.0.1:{port}", *worker)
        log = (tmp_path / f"{name}.out").open("w")
        # a session of its own: the node is the launcher and its worker, killed together
        env = environment(tmp_path)
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    nodes = [node("node0")]
    try:
        wait_for(lambda: listening(port), "node 0 to host the rendezvous", *nodes)  # node 0 hosts the store
        nodes.append(node("node1"))
        wait_for((tmp_path / "hanging").exists, "rank 1 to reach window 10", *nodes)
        node1 = process_tree(nodes[1].pid)  # timeout, torchrun and the worker: the whole node, at once
        assert int((tmp_path / "hanging").read_text()) in node1
        kill_all(node1)
        nodes[1].wait()
        nodes.append(node("node1-replacement"))
        codes = [nodes[0].wait(LAUNCH_TIMEOUT + 60), nodes[2].wait(LAUNCH_TIMEOUT + 60)]
    finally:
        for n in nodes:
            kill_all(process_tree(n.pid) if n.poll() is None else [])
    logs = [(tmp_path / f"{name}.out").read_text()[-3000:] for name in ("node0", "node1-replacement")]
    assert codes == [0, 0], "\n".join(logs)
    assert_nothing_lost(tmp_path, uninterrupted, resumed_from=8)
