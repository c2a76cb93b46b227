"""tformer's data pipeline: tokenizers, loading, token caches, objectives and sampling.

    tok = train_tokenizer("bpe", default_corpus_path(), 8000, "runs/tok")     # or load_tokenizer
    check_vocab(tok, model_vocab_size)
    corpus = tokenize_corpus(default_corpus_path(), tok, "runs/cache", split="train")
    ds = PackedCausalLM(corpus, seq_len=1024, eos_id=special_tokens(tok).eos_id)
    sampler = ResumableSampler(len(ds), seed=0, rank=rank, world_size=world_size, block=8)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler,
                                         collate_fn=Collator(pad_id=special_tokens(tok).pad_id))

Every bad input raises ``DataError`` with a one-line message naming what is wrong and the fix.
`datasets` is imported only when text must be read, so a cached start stays fast.
"""

from .cache import TokenizedCorpus, tokenize_corpus, tokenize_pairs
from .causal import PackedCausalLM
from .corpus import default_corpus_path, default_pairs_path, split_rows
from .errors import DataError, check_seq_len
from .loading import load_text_dataset
from .mlm import MLMDataset
from .mlm_pack import MLMDocuments, PackedMLM
from .sampler import Collator, ResumableSampler, TokenBudgetSampler, collate
from .mixture import MixtureDataset, MixtureSampler, MixtureSchedule
from .seq2seq import PackedSeq2Seq, Seq2SeqPairs
from .span import SpanCorruptionDataset, t5_lengths
from .tokenizer import (
    SpecialTokens,
    check_vocab,
    hf_tokenizer,
    load_tokenizer,
    special_tokens,
    tokenizer_main,
    train_tokenizer,
)

__all__ = [
    "DataError",
    "check_seq_len",
    "check_vocab",
    "train_tokenizer",
    "load_tokenizer",
    "special_tokens",
    "SpecialTokens",
    "hf_tokenizer",
    "tokenizer_main",
    "default_corpus_path",
    "default_pairs_path",
    "split_rows",
    "load_text_dataset",
    "TokenizedCorpus",
    "tokenize_corpus",
    "tokenize_pairs",
    "PackedCausalLM",
    "MLMDataset",
    "MLMDocuments",
    "PackedMLM",
    "SpanCorruptionDataset",
    "t5_lengths",
    "Seq2SeqPairs",
    "PackedSeq2Seq",
    "MixtureDataset",
    "MixtureSampler",
    "MixtureSchedule",
    "ResumableSampler",
    "TokenBudgetSampler",
    "Collator",
    "collate",
]
