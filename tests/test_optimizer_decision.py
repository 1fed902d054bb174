"""The optimizer stage's decision for one step (`dflash/stages/optimizer.py`: `decide`,
`Decision.stops`), as a table: whether the step updates, and whether the run stops after it."""

from __future__ import annotations

import pytest

from dflash.runtime.distributed import Agreement
from dflash.stages.optimizer import Decision, decide


def agreed(any_data: bool, all_complete: bool, stop: bool) -> Agreement:
    return Agreement(any_data, all_complete, stop, [0])


# (has data here, at max steps, the ranks' agreement or None alone) -> (go, stop_all)
TABLE = [
    # alone: update with data, never past the step limit
    (True, False, None, True, False),
    (False, False, None, False, False),
    (True, True, None, False, False),  # resumed at the end
    # several ranks: any rank's data is a step for all (a rank without contributes zeros)
    (True, False, agreed(True, True, False), True, False),
    (False, False, agreed(True, True, False), True, False),
    (False, False, agreed(False, True, False), False, False),  # every rank is done
    # a stop asked on some rank: all stop after this step, which runs only when complete
    (True, False, agreed(True, True, True), True, True),
    (True, False, agreed(True, False, True), False, True),  # partial data would differ from the uninterrupted run
    (False, False, agreed(False, True, True), False, True),
]


@pytest.mark.parametrize(("has_data", "at_max", "agreement", "go", "stop_all"), TABLE)
def test_decide(has_data, at_max, agreement, go, stop_all):
    assert decide(has_data, at_max, agreement) == Decision(go, stop_all)


# (decision, asked here, alone, plan ended) -> stops after this step
STOPS = [
    (Decision(True), False, True, False, False),
    (Decision(True), True, True, False, True),  # asked here, alone: after this step
    (Decision(True), True, False, False, False),  # with other ranks, a stop goes through the agreement
    (Decision(True, stop_all=True), False, False, False, True),
    (Decision(True), False, True, True, True),  # max steps or the time budget
    (Decision(False), False, True, False, True),  # nothing to update: the data is done
]


@pytest.mark.parametrize(("decision", "asked", "alone", "ended", "stops"), STOPS)
def test_stops(decision, asked, alone, ended, stops):
    assert decision.stops(asked, alone, ended) is stops
