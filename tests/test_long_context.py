"""Long rows: the grouped attention path (`drafter.attention = "grouped"`, `masks.GroupedMask`)
computes what the dense mask computes — outputs and gradients, full and sliding layers, packed
documents, disabled blocks, groups forced small — without the (Q, T + Q) grid; a run trained on
it has the dense run's losses."""

from __future__ import annotations

import pytest
import torch

from dflash.model.drafter import attend
from dflash.model.masks import BlockLayout, dense_mask, grouped_mask, make_mask_mod
from tests.conftest import run_records


def _layout() -> tuple[BlockLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    N, B = 6, 4
    doc = torch.tensor([[0] * 15 + [1] * 25, [2] * 30 + [-1] * 10])  # packed; padding
    anchors = torch.tensor([[3, 8, 14, 17, 25, 33], [2, 9, 12, 20, 27, 0]])
    valid = torch.tensor([[True, True, True, True, False, True], [True, True, True, True, True, False]])
    layout = BlockLayout(anchors, valid, doc, B)
    assert layout.num_queries == N * B
    return layout, anchors, valid, doc


@pytest.mark.parametrize(("window", "causal"), [(None, False), (6, True), (6, False)], ids=["full", "sliding", "bidi"])
@pytest.mark.parametrize("budget", [1, 200, 1 << 20], ids=["one_block", "some", "one_group"])
def test_grouped_attention_equals_the_dense_mask_forward_and_backward(window, causal, budget):
    layout, anchors, valid, doc = _layout()
    R, Q, T = 2, layout.num_queries, layout.ctx_len
    g = torch.Generator().manual_seed(0)
    q = torch.randn(R, 4, Q, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(R, 2, T + Q, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(R, 2, T + Q, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dense = dense_mask(make_mask_mod(layout, window, causal), layout)
    grouped = grouped_mask(layout, anchors, valid, doc, window, causal, budget=budget)
    assert (len(grouped.groups) == 2 * 6) == (budget == 1)
    a = attend(q, k, v, dense)
    b = attend(q, k, v, grouped)
    assert torch.allclose(a, b, atol=1e-12)
    w = torch.randn(a.shape, generator=g, dtype=torch.float64)
    ga = torch.autograd.grad((a * w).sum(), (q, k, v))
    gb = torch.autograd.grad((b * w).sum(), (q, k, v))
    assert all(torch.allclose(x, y, atol=1e-12) for x, y in zip(ga, gb, strict=True))


def test_a_group_sees_only_the_context_slice_its_blocks_need():
    """The slice runs from the earliest document (or window) start to the latest anchor: far
    smaller than the row for blocks late in a long document's neighbour."""
    layout, anchors, valid, doc = _layout()
    one = grouped_mask(layout, anchors, valid, doc, None, False, budget=1)
    assert one.groups[3] == (0, 12, 16, 15, 17)  # block 3: anchor 17 in document 1 (from 15)
    assert one.groups[4] == (0, 16, 20, 0, 0)  # a disabled block: no context


@pytest.mark.parametrize("layers", ['["full_attention"]', '["sliding_attention"]'])
def test_a_run_on_the_grouped_path_has_the_dense_runs_losses(tiny_config, layers):
    common = {"eval.at_end": "false", "train.max_steps": "8", "drafter.layer_types": layers,
              "drafter.sliding_window": "16"}  # fmt: skip
    dense = run_records(tiny_config(**common, **{"run.name": '"dense"'}), timeout_s=120)
    grouped = run_records(tiny_config(**common, **{"run.name": '"grouped"', "drafter.attention": '"grouped"'}),
                          timeout_s=120)  # fmt: skip
    la = [r["loss"] for r in dense if r["event"] == "train_step"]
    lb = [r["loss"] for r in grouped if r["event"] == "train_step"]
    assert len(la) >= 4 and len(la) == len(lb)
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(la, lb, strict=True)), (la, lb)


def test_auto_on_a_cpu_takes_the_grouped_path_past_the_dense_masks_size(tiny_config, monkeypatch):
    """`drafter.attention = "auto"` on a CPU: the dense mask for batches up to `GROUPED_ABOVE`
    entries, the grouped path beyond (here every batch, the bound set to 1): the same losses."""
    import dflash.model.masks as masks
    import dflash.train.build as build

    common = {"eval.at_end": "false", "train.max_steps": "4"}
    dense = run_records(tiny_config(**common, **{"run.name": '"dense"', "drafter.attention": '"sdpa"'}), timeout_s=120)
    made: list[int] = []
    grouped_mask = masks.grouped_mask
    monkeypatch.setattr(masks, "grouped_mask", lambda *a, **k: made.append(1) or grouped_mask(*a, **k))
    monkeypatch.setattr(build, "GROUPED_ABOVE", 1)
    auto = run_records(tiny_config(**common, **{"run.name": '"auto"'}), timeout_s=120)
    la = [r["loss"] for r in dense if r["event"] == "train_step"]
    lb = [r["loss"] for r in auto if r["event"] == "train_step"]
    assert made and len(la) == len(lb) and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(la, lb, strict=True))


def test_plan_counts_the_grouped_path_for_long_rows_on_a_cpu():
    """`dflash plan --gpu cpu`: a long row on the grouped path needs a fraction of the dense
    mask's activations and scores only the keys it sees."""
    import json

    from click.testing import CliRunner

    from dflash.cli import main
    from tests.conftest import ROOT

    def plan(attention: str) -> dict:
        args = ["plan", str(ROOT / "configs" / "tiny.toml"), "--gpu", "cpu", "--json",
                "--set", f'drafter.attention="{attention}"', "--set", "data.max_seq_len=16384",
                "--set", "drafter.max_anchors=256", "--set", "drafter.block_size=16"]  # fmt: skip
        got = CliRunner().invoke(main, args)
        assert got.exit_code == 0, got.output
        return json.loads(got.output.strip().splitlines()[-1])

    dense, grouped, auto = plan("sdpa"), plan("grouped"), plan("auto")
    assert grouped["memory_gib"]["drafter"]["activations"] < dense["memory_gib"]["drafter"]["activations"] / 5
    assert grouped["drafter"]["gflop_per_batch"]["forward"] < dense["drafter"]["gflop_per_batch"]["forward"]
    assert auto["memory_gib"] == grouped["memory_gib"]  # past GROUPED_ABOVE, auto is grouped
