"""Document-masked packing: a packed row computes what its documents (pairs) compute alone, to fp32
rounding: a packed row and a lone document are tensors of other shapes, summed in other orders, so
the packed row may lie rounding.FACTOR times as far from the documents alone as those lie from the
same computation in float64 (tests/rounding.py). Where nothing but the path changes, the check is
exact."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from rounding import assert_within, float64_throughout, yardstick

from tformer.models import build_model
from tformer.nn import DocumentMask, positions_from_doc_ids

DOCS = [5, 7, 3]  # document lengths packed into row 0; row 1 holds 6 + 4 and padding
ROW1 = [6, 4]
S = 16


def _ids(lengths, total=S):
    ids = sum(([d] * n for d, n in enumerate(lengths)), [])
    return ids + [-1] * (total - len(ids))


def _rows(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.tensor([_ids(DOCS), _ids(ROW1)])
    tokens = torch.randint(3, vocab, doc_ids.shape, generator=g)
    return tokens.masked_fill(doc_ids < 0, 0), doc_ids


def _spans(doc_ids_row):
    row = doc_ids_row.tolist()
    return [(row.index(d), len(row) - row[::-1].index(d)) for d in sorted(set(row) - {-1})]


def _model(name, **kw):
    torch.manual_seed(0)
    return build_model(name, **kw).float().eval()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_rounding_close(model, alone, packed, packed_grads, what=""):
    """``packed`` (outputs by name) and ``packed_grads`` within rounding.FACTOR yardsticks of what
    ``alone(model)`` computes (the same names; it backpropagates into the model's gradients): how
    far ``alone`` in fp32 lies from ``alone`` in float64."""
    model.zero_grad()
    want = {k: v.detach() for k, v in alone(model).items()}
    want_grads = _grads(model)
    model64 = copy.deepcopy(model).double()
    model64.zero_grad()
    with float64_throughout():
        exact = {k: v.detach() for k, v in alone(model64).items()}
    exact_grads = _grads(model64)
    grad_scale = max(g.abs().max().item() for g in want_grads.values())
    got = {k: v.detach() for k, v in packed.items()}
    ratios = []
    for g, w, e, scale in ((got, want, exact, 0.0), (packed_grads, want_grads, exact_grads, grad_scale)):
        yard = yardstick(w, e, scale)
        ratios.append((assert_within(g, w, yard, scale, what), yard))
    (out, out_yard), (grad, grad_yard) = ratios
    print(f"{what}: outputs {out:.2f} yardsticks ({out_yard:.1e}), gradients {grad:.2f} ({grad_yard:.1e})")


def _assert_packed_equals_alone(model, tokens, doc_ids, **packed_inputs):
    """The packed rows' logits at every real position, and the gradients of a random weighting of
    them, equal those of each document run alone."""
    weight = torch.randn(*tokens.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(1)) / 64
    real = (doc_ids >= 0)[..., None]
    logits = model(tokens, doc_ids=doc_ids, **packed_inputs).logits
    (logits * weight * real).sum().backward()
    packed_grads = _grads(model)
    spans = [(b, a, e) for b in range(2) for a, e in _spans(doc_ids[b])]

    def alone(m):
        out = {}
        for b, a, e in spans:
            out[b, a] = m(tokens[b : b + 1, a:e]).logits
            (out[b, a] * weight[b : b + 1, a:e]).sum().backward()
        return out

    packed = {(b, a): logits[b : b + 1, a:e] for b, a, e in spans}
    _assert_rounding_close(model, alone, packed, packed_grads, model.config.family)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_decoder_packed_equals_documents_alone(preset):
    model = _model(preset)
    tokens, doc_ids = _rows(model.config.vocab_size)
    _assert_packed_equals_alone(model, tokens, doc_ids)


def test_encoder_packed_equals_documents_alone():
    model = _model("bert-tiny")
    tokens, doc_ids = _rows(model.config.vocab_size)
    _assert_packed_equals_alone(model, tokens, doc_ids, attention_mask=(doc_ids >= 0).long())


def _pairs(vocab, start_id):
    """Two rows of packed (source, target) pairs: sources 4+6 | 5, targets 3+5 | 7."""
    g = torch.Generator().manual_seed(2)
    src_ids = torch.tensor([_ids([4, 6], 12), _ids([5], 12)])
    tgt_ids = torch.tensor([_ids([3, 5], 9), _ids([7], 9)])
    src = torch.randint(3, vocab, src_ids.shape, generator=g).masked_fill(src_ids < 0, 0)
    labels = torch.randint(3, vocab, tgt_ids.shape, generator=g).masked_fill(tgt_ids < 0, -100)
    dec_in = torch.zeros_like(labels)
    for b in range(2):
        for a, e in _spans(tgt_ids[b]):
            dec_in[b, a] = start_id
            dec_in[b, a + 1 : e] = labels[b, a : e - 1]
    return src, src_ids, labels, dec_in, tgt_ids


@pytest.mark.parametrize("preset", ["t5-tiny", "transformer-tiny"])
def test_encdec_packed_pairs_equal_pairs_alone(preset):
    model = _model(preset)
    cfg = model.config
    src, src_ids, labels, dec_in, tgt_ids = _pairs(cfg.vocab_size, cfg.decoder_start_token_id)
    weight = torch.randn(*labels.shape, cfg.vocab_size, generator=torch.Generator().manual_seed(1)) / 64
    out = model(
        src,
        attention_mask=(src_ids >= 0).long(),
        decoder_input_ids=dec_in,
        labels=labels,
        doc_ids=src_ids,
        decoder_doc_ids=tgt_ids,
    )
    (out.logits * weight * (tgt_ids >= 0)[..., None]).sum().backward()
    packed_grads = _grads(model)
    pairs = [(b, *s, *t) for b in range(2) for s, t in zip(_spans(src_ids[b]), _spans(tgt_ids[b]))]

    def alone(m):
        logits = {}
        for b, sa, se, ta, te in pairs:
            logits[b, ta] = m(src[b : b + 1, sa:se], decoder_input_ids=dec_in[b : b + 1, ta:te]).logits
            (logits[b, ta] * weight[b : b + 1, ta:te]).sum().backward()
        return logits

    packed = {(b, ta): out.logits[b : b + 1, ta:te] for b, _, _, ta, te in pairs}
    _assert_rounding_close(model, alone, packed, packed_grads, preset)


def _run(model, family, tokens, doc_ids):
    if family == "encdec":
        src, src_ids, labels, dec_in, tgt_ids = tokens
        return model(
            src, attention_mask=(src_ids >= 0).long(), decoder_input_ids=dec_in, doc_ids=src_ids, decoder_doc_ids=tgt_ids
        ).logits
    return model(tokens, doc_ids=doc_ids).logits


@pytest.mark.parametrize("preset", ["gpt2-tiny", "bert-tiny", "t5-tiny"])
def test_changing_document_one_leaves_document_two_alone(preset):
    model = _model(preset)
    family = model.config.family
    if family == "encdec":
        inputs = _pairs(model.config.vocab_size, 0)
        changed = list(inputs)
        changed[0] = inputs[0].clone()
        changed[0][0, 1] += 1  # a source token of pair 0
        changed[3] = inputs[3].clone()
        changed[3][0, 2] += 1  # a target input of pair 0
        later = inputs[4][0] == 1
        a, b = _run(model, family, inputs, None), _run(model, family, changed, None)
    else:
        tokens, doc_ids = _rows(model.config.vocab_size)
        changed = tokens.clone()
        changed[0, 2] += 1  # document 0
        later = doc_ids[0] >= 1
        a, b = _run(model, family, tokens, doc_ids), _run(model, family, changed, doc_ids)
    assert not torch.equal(a[0, ~later], b[0, ~later])  # the change is visible in its own document
    torch.testing.assert_close(a[0, later], b[0, later], atol=0, rtol=0)


@pytest.mark.parametrize("preset", ["llama-tiny", "bert-tiny", "t5-tiny"])
def test_mask_path_equals_math_reference(preset):
    fast = _model(preset)
    ref = _model(preset, attn_impl="math")
    ref.load_state_dict(fast.state_dict())
    family = fast.config.family
    inputs = _pairs(fast.config.vocab_size, 0) if family == "encdec" else _rows(fast.config.vocab_size)
    args = (inputs, None) if family == "encdec" else inputs
    got = _run(fast, family, *args).detach()
    want = _run(ref, family, *args).detach()
    with float64_throughout():
        exact = _run(copy.deepcopy(ref).double(), family, *args).detach()
    scale = want.abs().max().item()
    yard = yardstick({"logits": want}, {"logits": exact}, scale)
    ratio = assert_within({"logits": got}, {"logits": want}, yard, scale, preset)
    print(f"{preset}: {ratio:.2f} yardsticks")


def test_unmasked_causal_path_is_unchanged():
    """Without doc_ids the decoder takes SDPA's is_causal fast path; a row of one document gives the
    same logits bit for bit."""
    model = _model("gpt2-tiny")
    tokens, _ = _rows(model.config.vocab_size)
    one_doc = torch.zeros_like(tokens)
    torch.testing.assert_close(model(tokens).logits, model(tokens, doc_ids=one_doc).logits, atol=0, rtol=0)


def test_positions_restart_per_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    assert positions_from_doc_ids(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [True, False])
def test_flex_mask_mod_matches_boolean_mask(causal):
    """The CUDA path's mask_mod, evaluated by FlexAttention's own dense helper on CPU, is the mask
    the CPU path applies; and eager flex_attention (forward) with its block mask equals SDPA to
    float rounding (other kernels)."""
    from torch.nn.attention.flex_attention import create_mask

    from tformer.nn.flex import flex_attend

    q_ids = torch.tensor([_ids(DOCS), _ids(ROW1)])
    k_ids = torch.tensor([_ids([4, 6, 3]), _ids([2, 2])]) if not causal else q_ids
    dm = DocumentMask(q_ids, k_ids, flex=False)
    dense = create_mask(dm.mask_mod(causal), 2, 1, S, S, device="cpu")
    assert torch.equal(dense, dm.allowed(causal))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, S, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 4, S, S, generator=g)
    flex = flex_attend(q, k, v, scale=0.5, causal=causal, doc_mask=DocumentMask(q_ids, k_ids), bias=bias)
    add = torch.zeros(2, 1, S, S).masked_fill(~dm.allowed(causal), torch.finfo(torch.float32).min) + bias
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=0.5)
    real = (q_ids >= 0)[:, None, :, None]
    torch.testing.assert_close(flex * real, sdpa * real, atol=1e-5, rtol=0)


# -- the data side: packed rows carry what the masks need --------------------------------------


def test_packed_pairs_hold_every_pair_once_within_the_limits():
    import numpy as np
    from tformer.data import Collator, PackedSeq2Seq, Seq2SeqPairs, TokenizedCorpus

    rng = np.random.default_rng(0)
    src = [rng.integers(3, 90, rng.integers(1, 30)).tolist() for _ in range(300)]
    tgt = [rng.integers(3, 90, rng.integers(1, 20)).tolist() for _ in range(300)]
    pairs = Seq2SeqPairs(
        TokenizedCorpus.from_docs(src), TokenizedCorpus.from_docs(tgt), 1, max_source_length=40, max_target_length=32
    )
    packed = PackedSeq2Seq(pairs, start_id=0, seed=0)
    assert len(packed) < len(pairs) / 2  # several pairs per row
    seen = []
    for r in range(len(packed)):
        row = packed[r]
        assert len(row["input_ids"]) <= 40 and len(row["labels"]) <= 32
        for d in range(row["doc_ids"].max() + 1):
            s, t = row["input_ids"][row["doc_ids"] == d], row["labels"][row["decoder_doc_ids"] == d]
            dec = row["decoder_input_ids"][row["decoder_doc_ids"] == d]
            assert dec[0] == 0 and (dec[1:] == t[:-1]).all()  # each target behind its own start
            seen.append((tuple(s), tuple(t)))
    assert sorted(seen) == sorted((tuple(pairs[i]["input_ids"]), tuple(pairs[i]["labels"])) for i in range(len(pairs)))
    batch = Collator(pad_id=0)([packed[0], packed[1]])
    assert (batch["doc_ids"][batch["attention_mask"] == 0] == -1).all()


def test_mlm_document_ids_follow_the_corpus_documents():
    import gzip

    import datasets

    from tformer.data import MLMDataset, TokenizedCorpus, default_corpus_path, train_tokenizer

    with gzip.open(default_corpus_path(), "rt") as f:
        lines = [next(f).rstrip("\n") for _ in range(300)]
    tok = train_tokenizer("wordpiece", datasets.Dataset.from_dict({"text": lines}), 800)
    corpus = TokenizedCorpus.from_docs(tok.encode(t, add_special_tokens=False).ids for t in lines)
    ds = MLMDataset(corpus, tok, 64, pairs=False, document_mask=True)
    s = ds[3]
    a = 3 * ds.chunk
    doc = np.searchsorted(np.asarray(corpus.offsets), np.arange(a, a + ds.chunk), side="right") - 1
    assert (s["doc_ids"][1:-1] == doc - doc[0]).all() and s["doc_ids"][0] == 0
    assert (s["position_ids"] == positions_from_doc_ids(torch.from_numpy(s["doc_ids"])[None])[0].numpy()).all()
    with pytest.raises(Exception, match="single-segment layout"):
        MLMDataset(corpus, tok, 64, pairs=True, document_mask=True)


@pytest.mark.parametrize("recipe", ["gpt2-tiny", "bert-tiny", "t5-tiny-translate"])
def test_the_trainer_feeds_packed_documents_to_every_family(recipe, tmp_path, monkeypatch):
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer
    from train_helpers import CONFIGS, metrics, small_overrides

    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    extra = ["data.tokenizer_max_rows=2000", "data.target_len=64"] if "t5" in recipe else []
    cfg = load_config(
        CONFIGS / f"{recipe}.yaml",
        small_overrides(
            recipe,
            tmp_path / "run",
            "data.document_mask=true",
            "max_steps=2",
            "eval_every=2",
            "save_every=0",
            "eval_batches=1",
            "micro_batch_size=4",
            *extra,
        ),
    )
    t = Trainer(cfg)
    batch = next(t._batches())
    # an encoder's packed rows have no padding: their all-ones mask is left out (data.make_collator)
    unpadded = {"attention_mask"} if t.model_cfg.family == "encoder" else set()
    assert "doc_ids" in t.data.model_inputs and set(t.data.model_inputs) - unpadded <= set(batch)
    assert (batch["doc_ids"].amax(dim=1) >= 1).any()  # rows really hold several documents
    t.fit()
    last = metrics(tmp_path / "run")[-1]
    assert np.isfinite(last["loss"]) and np.isfinite(last["val_loss"])


@pytest.mark.timeout(900)
def test_packed_documents_under_sequence_and_pipeline_parallelism_equal_one_process(cache, tmp_path_factory):
    """A decoder's packed documents at tp=2 + SP (the ids whole on every rank, the activations
    split; 63 positions, so SP pads the ids, the document ids and the positions alike) and through a
    2-stage pipeline (every stage takes the ids with its micro-batch, pipeline.MODEL_KWARGS) within
    test_mesh's layout bound of one process. Measured on a 2-core AVX512 Xeon (2026-11-28): SP 1.06
    yardsticks on the losses and 2.87 on the parameters, PP 0 and 1.14; SP without the document ids
    and positions padded with the ids (before models.padding did) a shape error; the stages without
    the ids (planted, ModernBERT's packed MLM) 44 and 6.5e4 yardsticks."""
    import test_mesh

    layouts = [
        ("llama-docs", ["parallel.tp=2", "parallel.sp=true"], 1),
        ("llama-docs", ["parallel.pp=2", "parallel.pp_schedule=gpipe", "grad_accum=2"], 2),
    ]
    test_mesh.assert_layouts_equal_one_process(
        "llama-docs", ("llama-tiny", ["data.document_mask=true", "data.seq_len=63"]), layouts, tmp_path_factory, cache
    )


def test_padding_for_sp_pads_the_document_ids_and_positions_with_the_ids():
    """``pad_sequences`` (SP's multiple of tp) grows every per-position field alike: ids with the
    pad id, a packed row's document ids with -1 (nobody attends to them), positions with 0, labels
    with -100; an encoder-decoder's target fields with its labels."""
    from tformer.models.padding import pad_sequences

    row = torch.tensor([[5, 6, 7]])
    dec = {"input_ids": row, "labels": row, "doc_ids": torch.tensor([[0, 0, 1]]), "position_ids": torch.tensor([[0, 1, 0]])}
    got = pad_sequences(dec, 2, 9, "decoder")
    assert got["input_ids"].tolist() == [[5, 6, 7, 9]] and got["labels"].tolist() == [[5, 6, 7, -100]]
    assert got["doc_ids"].tolist() == [[0, 0, 1, -1]] and got["position_ids"].tolist() == [[0, 1, 0, 0]]
    pairs = {
        "input_ids": row,
        "doc_ids": torch.tensor([[0, 0, 1]]),
        "labels": torch.tensor([[4, 4, 4, 4, 4]]),
        "decoder_input_ids": torch.tensor([[0, 4, 4, 0, 4]]),
        "decoder_doc_ids": torch.tensor([[0, 0, 0, 1, 1]]),
    }
    got = pad_sequences(pairs, 2, 9, "encdec")
    assert got["doc_ids"].tolist() == [[0, 0, 1, -1]] and got["attention_mask"].tolist() == [[1, 1, 1, 0]]
    assert got["labels"].shape[1] == got["decoder_input_ids"].shape[1] == got["decoder_doc_ids"].shape[1] == 6
    assert got["decoder_doc_ids"][0, -1] == -1 and got["decoder_input_ids"][0, -1] == 9
