"""Two "nodes" on this machine: two launcher processes, ``num_nodes=2``, two CPU processes each, loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NODE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {repo!r})
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader
    from tests.support.helpers import IndexedRegression, Regressor
    from lightning_simigrad import SimiGrad


    class Dump(pl.Callback):
        real = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            cb = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
            self.real.append(cb.local_samples > 0)  # False: a zero-weight padding sample

        def on_train_end(self, trainer, pl_module):
            cb = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
            micro = [m for m, real in zip(pl_module.micro_batches, self.real) if real]
            payload = dict(history=cb.history, micro=micro, world=trainer.world_size, node=trainer.node_rank)
            with open({out!r} + f"/rank{{trainer.global_rank}}.json", "w") as f:
                json.dump(payload, f)


    if __name__ == "__main__":
        pl.seed_everything(0)
        trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, num_nodes=2, max_epochs=2,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[SimiGrad(target_similarity=0.9), Dump()])
        trainer.fit(Regressor(), DataLoader(IndexedRegression(160), batch_size=4, shuffle=True))
    """
)


@pytest.mark.timeout(360)
def test_two_nodes_train_to_the_end(tmp_path: Path, master_port: int):
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT.format(repo=str(Path(__file__).resolve().parents[2]), out=str(tmp_path)))
    port = master_port  # node 0's rank 0 hosts the store there; no other socket can take it meanwhile
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_RANK", "NODE_RANK"))}
    nodes = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=env | dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["node"] for r in ranks] == [0, 0, 1, 1] and {r["world"] for r in ranks} == {4}
    assert all(r["history"] == ranks[0]["history"] for r in ranks)
    seen = [i for r in ranks for m in r["micro"] for i in m]
    assert sorted(seen) == sorted(list(range(160)) * 2)  # every sample once per epoch across both nodes
    assert sum(h["batch_size"] for h in ranks[0]["history"]) == 2 * 160
