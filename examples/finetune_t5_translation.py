"""Fine-tune an exported tformer T5 on English -> Spanish verse pairs with the HF ``Trainer``.

    tformer train configs/t5-tiny-translate.yaml
    tformer export runs/t5-tiny-translate --to hf hf/t5-tiny
    python examples/finetune_t5_translation.py hf/t5-tiny --out runs/t5-en-es

The pairs are the bundled King James / Reina-Valera 1909 verses (no download). Training uses the
rows before Hebrews, the held-out loss and the sample translation the rows after.
Needs ``transformers`` and ``accelerate``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

VALIDATION_START = 29946  # Hebrews 1:1 in the bundled pairs file


def read_pairs(path: str, start: int, count: int) -> dict[str, list]:
    src, tgt = [], []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= start + count:
                break
            if i >= start:
                row = json.loads(line)
                src.append(row["src"])
                tgt.append(row["tgt"])
    return {"src": src, "tgt": tgt}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", help="directory written by `tformer export ... --to hf`")
    p.add_argument("--out", default="runs/t5-translation")
    p.add_argument("--pairs", default=None, help="jsonl(.gz) with src/tgt columns (default: the bundled pairs)")
    p.add_argument("--train-pairs", type=int, default=4000)
    p.add_argument("--eval-pairs", type=int, default=200)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    if args.pairs is None:
        from tformer.data import default_pairs_path

        args.pairs = str(default_pairs_path())
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_dir)

    def encode(batch):
        # the exported tokenizer appends </s> to both sides, as T5 expects
        out = tokenizer(batch["src"], truncation=True, max_length=args.max_length)
        targets = tokenizer(text_target=batch["tgt"], truncation=True, max_length=args.max_length)
        out["labels"] = targets["input_ids"]
        return out

    train = Dataset.from_dict(read_pairs(args.pairs, 0, args.train_pairs)).shuffle(seed=args.seed)
    held_out = Dataset.from_dict(read_pairs(args.pairs, VALIDATION_START, args.eval_pairs))
    sample = held_out[0]["src"]
    train, held_out = (d.map(encode, batched=True, remove_columns=["src", "tgt"]) for d in (train, held_out))

    training_args = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        learning_rate=args.lr,
        max_steps=args.max_steps,
        warmup_steps=min(20, args.max_steps // 10),
        logging_steps=max(1, min(10, args.max_steps // 10)),
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )
    trainer.train()
    metrics = trainer.evaluate()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]

    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    model.eval()
    with torch.no_grad():
        ids = tokenizer(sample, return_tensors="pt").to(model.device)
        # An explicit cache: transformers 5.23 sizes its default one by the encoder's depth, which
        # fails when the decoder is deeper (e.g. tformer's t5-v1.1-tiny).
        out = model.generate(
            **ids,
            max_new_tokens=args.max_length,
            do_sample=False,
            past_key_values=EncoderDecoderCache(DynamicCache(), DynamicCache()),
        )
    translation = tokenizer.decode(out[0], skip_special_tokens=True)
    print(
        f"train loss {losses[0]:.4f} -> {losses[-1]:.4f}; held-out loss {metrics['eval_loss']:.4f}\n"
        f"  {sample}\n  -> {translation}"
    )
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)
    return {"losses": losses, "eval_loss": metrics["eval_loss"], "translation": translation}


if __name__ == "__main__":
    main(sys.argv[1:])
