"""`eqx-train inspect DIR`'s listing: a header whose metrics are not all numbers
(written by another tool or a later version) is listed, not a crash."""

from __future__ import annotations

import json
from types import SimpleNamespace

from eqx_train._cli_listing import listing_lines
from eqx_train.checkpoints import engine


def _entry(step):
    return SimpleNamespace(path=f"/d/checkpoint_{step}.safetensors", sharded=False, text=str(step))


def test_a_checkpoint_whose_metrics_are_not_all_numbers_is_listed_and_ranked_by_the_numbers():
    metrics = {
        "/d/checkpoint_1.safetensors": {"loss": 0.5, "tag": "warmup", "acc": None},
        "/d/checkpoint_2.safetensors": {"loss": 0.25, "tags": ["a"]},
    }

    def metadata_at(path):
        return {engine.METRICS_KEY: json.dumps(metrics[path])}

    lines = listing_lines([_entry(1), _entry(2)], metadata_at, "loss", "min")
    assert (
        lines[0]
        == "  step 1          file     checkpoint_1.safetensors  loss=0.5 tag='warmup' acc=None"
    )
    assert lines[1] == "* step 2          file     checkpoint_2.safetensors  loss=0.25 tags=['a']"
    assert lines[2] == "* best by 'loss' (min): step 2"
