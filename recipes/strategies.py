"""Lightning strategies the recipes name in ``conf/trainer``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with every process in the data-parallel dimension: plain FSDP2.

    ``ModelParallelStrategy(data_parallel_size="auto")`` means one data-parallel group per node (the devices of a
    node then form the tensor-parallel dimension); the recipes shard data only, over every device of every node,
    whatever ``trainer.devices`` and ``trainer.num_nodes`` resolve to. The LightningModule applies ``fully_shard``
    in ``configure_model`` over ``device_mesh["data_parallel"]``.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(data_parallel_size="auto", **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes // int(self._tensor_parallel_size)
        super().setup_environment()
