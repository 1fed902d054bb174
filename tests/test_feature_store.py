"""The feature store on disk: packed shards, a flat memory-mapped index, reads by token-id
key, crash-safe writes, the earlier format refused and rewritten."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash.data.samples import Sample, collate
from dflash.errors import DataError
from dflash.features.files import (
    INDEX,
    Entry,
    FeatureMeta,
    FeatureStore,
    build_index,
    read_folder,
    read_part,
    upgrade_folder,
    write_part,
)
from tests.conftest import popen_cli

META = FeatureMeta("tiny", "float32", [1, 2], 6, True)


def _entry(ids: list[int], seed: int) -> Entry:
    g = torch.Generator().manual_seed(seed)
    n = len(ids)
    return Entry(torch.tensor(ids), torch.randn(n, 6, generator=g).bfloat16(), torch.tensor(ids) + 100)


def _store(folder: Path, max_len: int = 0, teacher_topk: int = 1, meta: FeatureMeta = META) -> FeatureStore:
    warn: list[str] = []
    store = FeatureStore([folder], meta, teacher_topk, max_len, warn)
    assert not warn, warn
    return store


def test_parts_round_trip_and_batches_read_by_key(tmp_path: Path) -> None:
    """Entries written as packed shards come back whole (read_folder) and, by key, into any
    batch layout: features, top-1 labels; a batch with one unknown document is a miss."""
    a, b, c = _entry([5, 6, 7], 0), _entry([8, 9], 1), _entry([1, 2, 3, 4], 2)
    write_part(tmp_path, 0, [a, b], META)
    write_part(tmp_path, 1, [c], META)
    back = [e for _, e in read_folder(tmp_path)]
    assert [e.ids.tolist() for e in back] == [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    assert torch.equal(back[2].features, c.features) and torch.equal(back[1].next, b.next)

    store = _store(tmp_path)
    assert store.entries == 3 and (tmp_path / INDEX).is_file()
    docs = [Sample(10, c.ids, torch.ones(4, dtype=torch.bool)), Sample(11, a.ids, torch.ones(3, dtype=torch.bool))]
    batch = collate([[docs[0], docs[1]]], 0, 0)  # one packed row
    hit = store.read(batch, torch.float32)
    assert hit is not None and hit[1] is not None
    feats, (_, labels) = hit
    assert torch.equal(feats[0, :4], c.features.float()) and torch.equal(feats[0, 4:7], a.features.float())
    assert labels[0, :7, 0].tolist() == [101, 102, 103, 104, 105, 106, 107]
    unknown = Sample(12, torch.tensor([9, 9]), torch.ones(2, dtype=torch.bool))
    assert store.read(collate([docs[0], unknown], 1, 0), torch.float32) is None
    assert (store.stats()["hits"], store.stats()["misses"]) == (1, 1)
    assert store.covered([*docs, unknown]) == 2


def test_a_truncated_sample_is_served_by_a_stored_prefix(tmp_path: Path) -> None:
    """A sample cut at data.max_seq_len is the prefix of a stored entry: the index built for
    that length finds it; built for another length, it is rebuilt."""
    long = _entry(list(range(1, 11)), 3)
    write_part(tmp_path, 0, [long], META)
    cut = Sample(0, long.ids[:6], torch.ones(6, dtype=torch.bool))
    assert _store(tmp_path, max_len=8).covered([cut]) == 0
    store = _store(tmp_path, max_len=6)
    hit = store.read(collate([cut], 0, 0), torch.float32)
    assert hit is not None and torch.equal(hit[0][0], long.features[:6].float())


def test_the_index_follows_the_folder_and_is_rebuilt_when_stale(tmp_path: Path) -> None:
    """A part appended after the index was written is found (the index lists its parts and is
    rebuilt when they change); the same keys in two parts: the earlier part serves."""
    write_part(tmp_path, 0, [_entry([1, 2], 0)], META)
    assert _store(tmp_path).entries == 1
    write_part(tmp_path, 1, [_entry([3, 4], 1), _entry([1, 2], 2)], META)
    store = _store(tmp_path)
    assert store.entries == 3
    found = store.find(torch.tensor([1, 2]))
    assert found is not None and store.indexes[0].part[found[1]] == 0
    ix = build_index(tmp_path, 0, write=False)
    assert ix.hi.tolist() == sorted(ix.hi.tolist()) and len(ix.hi) == 3


def test_another_target_layout_and_sampled_parts_are_left_out_with_a_reason(tmp_path: Path) -> None:
    write_part(tmp_path, 0, [_entry([1, 2], 0)], META)
    sampled = FeatureMeta("tiny", "float32", [1, 2], 6, False)
    write_part(tmp_path, 1, [Entry(torch.tensor([3, 4]), torch.zeros(2, 6), None)], sampled)
    warn: list[str] = []
    FeatureStore([tmp_path], FeatureMeta("tiny", "float32", [0], 3, True), 0, 0, warn)
    assert len(warn) == 1 and "layer_ids" in warn[0]
    warn = []
    store = FeatureStore([tmp_path], META, 1, 0, warn)
    assert store.entries == 1 and "sampled" in warn[0] and "part-00001" in warn[0]
    assert _store(tmp_path, teacher_topk=0).entries == 2  # data labels: features alone serve


def test_a_kill_while_a_part_is_written_leaves_the_store_readable(tmp_path: Path) -> None:
    """kill -9 in the middle of writing a large part: the parts before it still serve, the
    half-written one is invisible (a temporary name), and writing it again completes the store."""
    child = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from tests.test_feature_store import META, _entry
        from dflash.features.files import Entry, write_part
        folder = __import__("pathlib").Path({str(tmp_path)!r})
        write_part(folder, 0, [_entry([1, 2, 3], 0)], META)
        print("ready", flush=True)
        big = torch.zeros(8_000_000, 6).bfloat16()
        while True:
            write_part(folder, 1, [Entry(torch.arange(8_000_000), big, torch.arange(8_000_000))], META)
    """)
    proc = popen_cli([sys.executable, "-c", child], stdout=subprocess.PIPE)  # forked from the tests' server
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(p.name.startswith(".part-00001") for p in tmp_path.iterdir()):
            time.sleep(0.01)  # until the big part is being written
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    store = _store(tmp_path)  # readable: part 0 serves, part 1 is whole or absent
    assert store.find(torch.tensor([1, 2, 3])) is not None
    write_part(tmp_path, 1, [_entry([7, 8], 4)], META)
    assert _store(tmp_path).find(torch.tensor([7, 8])) is not None


def test_a_malformed_part_is_named_and_left_out(tmp_path: Path) -> None:
    write_part(tmp_path, 0, [_entry([1, 2], 0)], META)
    part = write_part(tmp_path, 1, [_entry([3, 4], 1)], META)
    part.write_bytes(part.read_bytes()[:-7])  # cut short
    warn: list[str] = []
    store = FeatureStore([tmp_path], META, 1, 0, warn)
    assert store.entries == 1 and "part-00001.safetensors" in warn[0] and "truncated" in warn[0]
    with pytest.raises(ValueError, match=r"part-00001.safetensors: .*truncated"):
        read_part(part)


def _old_part(folder: Path, index: int, entries: list[Entry], meta: FeatureMeta) -> Path:
    """A part in the earlier one-triple-per-sample format (dflash-features/1)."""
    import json
    from dataclasses import asdict

    tensors = {}
    for j, e in enumerate(entries):
        tensors[f"{j}.ids"] = e.ids.to(torch.int32)
        tensors[f"{j}.features"] = e.features
        if e.next is not None:
            tensors[f"{j}.next"] = e.next.to(torch.int32)
    folder.mkdir(exist_ok=True)
    path = folder / f"part-{index:05d}.safetensors"
    save_file(tensors, str(path), metadata={"format": "dflash-features/1", "meta": json.dumps(asdict(meta))})
    return path


def test_the_earlier_format_is_refused_then_rewritten(tmp_path: Path) -> None:
    """A folder of the earlier format is one line naming `dflash features CONFIG --upgrade`;
    `upgrade_folder` rewrites it part by part and the store serves the same features."""
    a, b = _entry([1, 2, 3], 0), _entry([4, 5], 1)
    _old_part(tmp_path, 0, [a, b], META)
    with pytest.raises(DataError, match=r"part-00000.safetensors: .*earlier.*dflash features CONFIG --upgrade"):
        FeatureStore([tmp_path], META, 1, 0, [])
    assert upgrade_folder(tmp_path) == 1 and upgrade_folder(tmp_path) == 0
    store = _store(tmp_path)
    hit = store.read(collate([Sample(0, b.ids, torch.ones(2, dtype=torch.bool))], 0, 0), torch.float32)
    assert hit is not None and torch.equal(hit[0][0], b.features.float())


def test_a_sample_stored_twice_is_served_by_the_copy_that_fits_the_run(tmp_path: Path) -> None:
    """The same ids in a part of another target layout and in one of this run's: the index
    holds both, and the run is served by its own (not hidden by the earlier, unusable copy)."""
    other = FeatureMeta("tiny", "float32", [1], 3, True)
    write_part(tmp_path, 0, [Entry(torch.tensor([1, 2]), torch.zeros(2, 3), torch.tensor([5, 6]))], other)
    mine = _entry([1, 2], 7)
    write_part(tmp_path, 1, [mine], META)
    warn: list[str] = []
    store = FeatureStore([tmp_path], META, 1, 0, warn)
    assert store.entries == 1 and len(warn) == 1
    hit = store.read(collate([Sample(0, mine.ids, torch.ones(2, dtype=torch.bool))], 0, 0), torch.float32)
    assert hit is not None and torch.equal(hit[0][0], mine.features.float())
