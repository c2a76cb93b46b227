"""The resumable sampler: order = f(seed, epoch, position); resume at any world size; collate."""

import itertools

import numpy as np
import pytest
import torch

from tformer.data import Collator, DataError, PackedCausalLM, ResumableSampler, TokenizedCorpus, collate


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def global_order(num_samples, seed, n, consumed=0):
    return take(ResumableSampler(num_samples, seed=seed, consumed=consumed), n)


def test_each_epoch_is_a_seeded_permutation():
    keys = global_order(10, seed=1, n=30)
    epochs = [keys[e * 10 : (e + 1) * 10] for e in range(3)]
    for e, chunk in enumerate(epochs):
        assert sorted(k - e * 10 for k in chunk) == list(range(10))  # key = epoch * N + index
    assert [k % 10 for k in epochs[0]] != [k % 10 for k in epochs[1]]
    assert global_order(10, seed=1, n=30) == keys
    assert global_order(10, seed=2, n=30) != keys
    assert take(ResumableSampler(5, shuffle=False), 7) == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_interleave_the_one_rank_order(world_size):
    n = 25  # 2.5 epochs of 10 (3 ranks: uneven split of each epoch)
    full = global_order(10, seed=0, n=n * world_size)
    per_rank = [take(ResumableSampler(10, seed=0, rank=r, world_size=world_size), n) for r in range(world_size)]
    interleaved = [k for step in zip(*per_rank) for k in step]
    assert interleaved == full


@pytest.mark.parametrize("before,after,consumed", [(2, 1, 14), (1, 2, 14), (2, 3, 8), (3, 2, 9), (2, 2, 18)])
def test_resume_reproduces_the_rest_at_any_world_size(before, after, consumed):
    """Consume on ``before`` ranks (across an epoch boundary at 10), resume on ``after`` ranks."""
    full = global_order(10, seed=4, n=60)
    ranks = [ResumableSampler(10, seed=4, rank=r, world_size=before) for r in range(before)]
    iters = [iter(s) for s in ranks]
    for _ in range(consumed // before):
        for it in iters:
            next(it)
    states = [s.state_dict() for s in ranks]
    assert all(st["consumed"] == consumed for st in states)  # every rank agrees on the global count
    resumed = []
    for r in range(after):
        s = ResumableSampler(10, seed=4, rank=r, world_size=after)
        s.load_state_dict(states[0])
        resumed.append(take(s, (60 - consumed) // after))
    rest = [k for step in zip(*resumed) for k in step]
    assert rest == full[consumed : consumed + len(rest)]


@pytest.mark.parametrize("world_size,block", [(2, 3), (3, 2), (2, 4)])
def test_ranks_take_whole_micro_batches_of_the_one_rank_order(world_size, block):
    """With ``block`` = the micro-batch size, rank r's micro-batch j is micro-batch j W + r of one
    process accumulating W times as many: what a loss that is not linear in its micro-batch (MoE
    balancing) needs to be the same at every world size. Across epochs, and with a length."""
    full = global_order(10, seed=0, n=12 * world_size * block)
    micro = [full[i : i + block] for i in range(0, len(full), block)]
    for r in range(world_size):
        keys = take(ResumableSampler(10, seed=0, rank=r, world_size=world_size, block=block), 12 * block)
        assert [keys[i : i + block] for i in range(0, len(keys), block)] == micro[r::world_size]
        s = ResumableSampler(10, seed=0, rank=r, world_size=world_size, block=block, num_epochs=2, consumed=3)
        length = len(s)
        keys = list(s)
        assert length == len(keys) and all(3 <= full.index(k) < 20 for k in keys)


@pytest.mark.parametrize("before,after,block,steps", [(2, 1, 2, 3), (1, 2, 2, 2), (2, 4, 3, 1), (3, 2, 2, 5)])
def test_resume_in_blocks_reproduces_the_rest_at_any_world_size(before, after, block, steps):
    """``steps`` steps of one round of blocks on ``before`` ranks (across the epoch boundary at 10), then
    the rest on ``after`` ranks from the checkpointed count: the same global order, micro-batch by
    micro-batch."""
    full = global_order(10, seed=4, n=80)
    ranks = [ResumableSampler(10, seed=4, rank=r, world_size=before, block=block) for r in range(before)]
    iters = [iter(s) for s in ranks]
    for _ in range(steps * block):
        for it in iters:
            next(it)
    consumed = steps * before * block
    assert all(s.state_dict()["consumed"] == consumed for s in ranks)
    resumed = [
        take(ResumableSampler(10, seed=4, rank=r, world_size=after, block=block, consumed=consumed), 4 * block)
        for r in range(after)
    ]
    rounds = [k for j in range(4) for keys in resumed for k in keys[j * block : (j + 1) * block]]
    assert rounds == full[consumed : consumed + len(rounds)]


def test_epoch_continues_from_consumed():
    s = ResumableSampler(10, seed=0, consumed=23)
    assert s.epoch == 2
    assert take(s, 3) == global_order(10, seed=0, n=26)[23:]
    assert s.consumed == 26


def test_state_refuses_other_data_or_seed():
    s = ResumableSampler(10, seed=0)
    with pytest.raises(DataError, match="the checkpoint's sampler has num_samples=12 but this run has 10"):
        s.load_state_dict({"consumed": 4, "num_samples": 12, "seed": 0, "shuffle": True})
    with pytest.raises(DataError, match="seed=3"):
        s.load_state_dict({"consumed": 4, "num_samples": 10, "seed": 3, "shuffle": True})
    with pytest.raises(DataError, match="rank 2 is outside world_size 2"):
        ResumableSampler(10, rank=2, world_size=2)


def test_finite_epochs_and_length():
    s = ResumableSampler(10, seed=0, rank=1, world_size=3, num_epochs=1)
    keys = list(s)
    assert len(keys) == 3 and keys == global_order(10, 0, 10)[1::3]
    assert len(ResumableSampler(10, rank=0, world_size=3, num_epochs=1)) == 4
    with pytest.raises(TypeError):
        len(ResumableSampler(10))


def test_dataloader_resume_is_exact():
    docs = [list(range(1, 1 + k % 13)) for k in range(200)]
    ds = PackedCausalLM(TokenizedCorpus.from_docs(docs), 16, eos_id=0)

    def batches(consumed, n):
        sampler = ResumableSampler(len(ds), seed=9, consumed=consumed)
        loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=Collator(0))
        out = [b["input_ids"] for b in itertools.islice(loader, n)]
        return out, sampler.state_dict()

    straight, _ = batches(0, 6)
    first, state = batches(0, 2)
    assert state["consumed"] == 8  # a DataLoader without workers pulls exactly what it uses
    rest, _ = batches(state["consumed"], 4)
    assert all(torch.equal(a, b) for a, b in zip(first + rest, straight))


def test_collate_pads_each_field():
    samples = [
        {"input_ids": np.array([5, 6, 7]), "labels": np.array([6, 7, 8]), "doc_ids": np.array([0, 0, 1])},
        {"input_ids": np.array([9]), "labels": np.array([1]), "doc_ids": np.array([0])},
    ]
    b = collate(samples, pad_id=3)
    assert b["input_ids"].dtype == torch.long
    assert b["input_ids"].tolist() == [[5, 6, 7], [9, 3, 3]]
    assert b["labels"].tolist() == [[6, 7, 8], [1, -100, -100]]
    assert b["doc_ids"].tolist() == [[0, 0, 1], [0, -1, -1]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    seq2seq = Collator(pad_id=0, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3, 4, 5], "attention_mask": [1] * 5, "labels": [7, 1]}]
    )
    assert seq2seq["input_ids"].shape == (1, 8) and seq2seq["labels"].tolist() == [[7, 1, -100, -100]]


def test_an_unpadded_batch_can_go_without_its_all_ones_mask():
    """``drop_full_mask``: a batch without one pad position leaves ``attention_mask`` out (an all-ones
    mask changes no score but rules out the flash kernel); a batch with padding keeps it, and so
    does every batch without the setting."""
    full = [{"input_ids": np.array([5, 6, 7])}, {"input_ids": np.array([8, 9, 10])}]
    ragged = [{"input_ids": np.array([5, 6, 7])}, {"input_ids": np.array([8])}]
    assert "attention_mask" not in Collator(0, drop_full_mask=True)(full)
    assert Collator(0, drop_full_mask=True)(ragged)["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert Collator(0, drop_full_mask=True, pad_to_multiple_of=4)(full)["attention_mask"].tolist() == [[1, 1, 1, 0]] * 2
    assert Collator(0)(full)["attention_mask"].tolist() == [[1, 1, 1]] * 2
