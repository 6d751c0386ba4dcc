"""The world size a batch wants: bounds, whole nodes, the batch a measurement needs on every rank, hysteresis, the
trigger's patience, and the request's file."""

from __future__ import annotations

import json
import math

import pytest

from lightning_simigrad.core.world import Elastic, ResizeRequest, ResizeTrigger, WorldRule, WorldWanted


@pytest.mark.parametrize("devices", [1, 2, 8])
@pytest.mark.parametrize("max_accumulation", [1, 3, 16])
def test_the_wanted_world_is_the_fewest_whole_nodes_that_keep_to_max_accumulation(devices, max_accumulation):
    rule = WorldRule(max_accumulation, devices_per_node=devices, max_nodes=None, min_samples_per_rank=1)
    for batch in (1, 7, 64, 1000, 12_345):
        for micro in (1, 4, 32):
            world = rule.world(batch, micro)
            assert world % devices == 0
            micro_batches = math.ceil(batch / micro)
            assert math.ceil(micro_batches / world) <= max_accumulation  # enough ranks ...
            fewer = world - devices
            assert fewer == 0 or math.ceil(micro_batches / fewer) > max_accumulation  # ... and no more


def test_bounds_hold_and_a_world_never_outgrows_what_the_batch_can_feed():
    rule = WorldRule(max_accumulation=1, devices_per_node=4, min_nodes=2, max_nodes=5, min_samples_per_rank=2)
    assert rule.nodes(batch=1, micro_batch=1) == 2  # min_nodes
    assert rule.nodes(batch=10_000, micro_batch=1) == 5  # max_nodes
    # 24 micro-batches of 1 want 24 ranks, but 24 samples feed only 12 ranks with 2 each: 3 nodes of 4
    assert rule.nodes(batch=24, micro_batch=1) == 3
    with pytest.raises(ValueError, match="`max_nodes` = 1 with `min_nodes` = 2"):
        WorldRule(1, min_nodes=2, max_nodes=1)
    with pytest.raises(ValueError, match="`max_accumulation` = 0"):
        WorldRule(0)
    with pytest.raises(ValueError, match="`batch` = 0"):
        rule.nodes(0, 1)


def test_the_wanted_size_grows_at_once_and_shrinks_only_below_shrink_at():
    rule = WorldRule(max_accumulation=1, min_samples_per_rank=1)
    wanted = WorldWanted(rule, nodes=1, shrink_at=0.5)
    # a batch hovering at the boundary between 3 and 4 nodes settles at 4 and stays
    assert [wanted.update(b, 1) for b in (3, 4, 3, 4, 3, 3)] == [3, 4, 4, 4, 4, 4]
    assert wanted.update(2, 1) == 2  # 2 <= 0.5 x 4: follows down
    no_hysteresis = WorldWanted(rule, nodes=1, shrink_at=1.0)
    assert [no_hysteresis.update(b, 1) for b in (3, 4, 3)] == [3, 4, 3]
    with pytest.raises(ValueError, match="`shrink_at` = 0"):
        WorldWanted(WorldRule(1), shrink_at=0)


def test_the_trigger_needs_the_factor_for_patience_steps_in_a_row():
    trigger = ResizeTrigger(resize_factor=2.0, patience=2)
    # 3 and 5 lie within a factor 2 of 4; 8 and 2 do not (either way counts), twice in a row, and on
    assert [trigger.update(w, current=4) for w in (3, 5, 8, 2, 8, 3, 8, 8)] == [0, 0, 0, 1, 1, 0, 0, 1]
    assert ResizeTrigger(resize_factor=1.0, patience=1).update(5, current=4)  # any change
    assert not ResizeTrigger(resize_factor=1.0, patience=1).update(4, current=4)
    with pytest.raises(ValueError, match="`resize_factor` = 0.5"):
        ResizeTrigger(resize_factor=0.5)
    with pytest.raises(ValueError, match="`patience` = 0"):
        ResizeTrigger(patience=0)


def test_elastic_checks_its_arguments_naming_them():
    with pytest.raises(ValueError, match="`on_request` = 'restart'"):
        Elastic(4, on_request="restart")
    with pytest.raises(ValueError, match="`resize_factor` = 0.9"):
        Elastic(4, resize_factor=0.9)
    with pytest.raises(ValueError, match="`devices_per_node` = 0"):
        Elastic(4, devices_per_node=0)
    Elastic(4, on_request=print)  # a function of the request


def test_a_request_is_written_whole_and_read_back(tmp_path):
    request = ResizeRequest(4, 32, 8, "/ckpt/last-simigrad.ckpt", 120, 9000, 4096, 1, 8, "why")
    path = tmp_path / Elastic.REQUEST
    request.write(path)
    assert ResizeRequest.read(path) == request
    assert json.loads(path.read_text())["world_size"] == 32
    assert [p.name for p in tmp_path.iterdir()] == [Elastic.REQUEST]  # no partial file left
