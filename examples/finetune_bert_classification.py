"""Fine-tune an exported tformer BERT for sequence classification with the HF ``Trainer``.

    tformer train configs/bert-tiny.yaml
    tformer export runs/bert-tiny --to hf hf/bert-tiny
    python examples/finetune_bert_classification.py hf/bert-tiny --out runs/bert-cls

The task needs no download: is a verse English or Spanish? Each verse pair of the bundled
English-Spanish Bible gives one example of each label. ``BertForSequenceClassification`` takes
the exported encoder as is and adds a freshly initialised pooler and classifier.
Needs ``transformers`` and ``accelerate``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

LABELS = ["english", "spanish"]


def language_pairs(path: str, start: int, count: int) -> dict[str, list]:
    """Rows ``start .. start+count`` of the pairs file as (text, label) examples, both languages."""
    texts, labels = [], []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= start + count:
                break
            if i >= start:
                row = json.loads(line)
                texts += [row["src"], row["tgt"]]
                labels += [0, 1]
    return {"text": texts, "label": labels}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", help="directory written by `tformer export ... --to hf`")
    p.add_argument("--out", default="runs/bert-classification")
    p.add_argument("--pairs", default=None, help="jsonl(.gz) with src/tgt columns (default: the bundled pairs)")
    p.add_argument("--train-pairs", type=int, default=2000)
    p.add_argument("--eval-pairs", type=int, default=200)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from datasets import Dataset
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    if args.pairs is None:
        from tformer.data import default_pairs_path

        args.pairs = str(default_pairs_path())
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_dir,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)},
    )

    def encode(batch):
        return tokenizer(batch["text"], truncation=True, max_length=args.max_length)

    train = Dataset.from_dict(language_pairs(args.pairs, 0, args.train_pairs)).shuffle(seed=args.seed)
    # evaluation pairs come from the end of the file (the New Testament), away from the training rows
    held_out = Dataset.from_dict(language_pairs(args.pairs, 30000, args.eval_pairs))
    train, held_out = (d.map(encode, batched=True, remove_columns=["text"]) for d in (train, held_out))

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
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    trainer.train()
    metrics = trainer.evaluate()
    prediction = trainer.predict(held_out)
    accuracy = float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    print(
        f"train loss {losses[0]:.4f} -> {losses[-1]:.4f}; held-out loss {metrics['eval_loss']:.4f}, accuracy {accuracy:.3f}"
    )
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)
    return {"losses": losses, "eval_loss": metrics["eval_loss"], "accuracy": accuracy}


if __name__ == "__main__":
    main(sys.argv[1:])
