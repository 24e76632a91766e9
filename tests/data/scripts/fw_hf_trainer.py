"""A Hugging Face Trainer script written the usual way (CPU, gloo, under torchrun): a tiny model built from a
config (``--model bert``: a sequence classifier; ``--model gpt2``: a causal LM), synthetic tokens, nothing
downloaded; ``TrainingArguments`` with evaluation and ``save_steps`` (the Trainer's ``model.safetensors``),
then ``--resume``: a second ``train(resume_from_checkpoint=...)`` in the same process, or ``--pretrained``:
``save_model`` and a new model ``from_pretrained`` that directory, trained on. Final parameter digests.

transformers is a test extra of distdebug, never a runtime dependency: tests skip this script where it is missing.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from _disk import corrupt_safetensors  # noqa: E402

from recipes._common import base_parser, finish, param_digest, write_digest  # noqa: E402


class Tokens(Dataset):
    """Synthetic token sequences; for the classifier, a label that depends on the tokens."""

    def __init__(self, n: int, causal: bool, seed: int, pad: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 96, (n, 16), generator=g)
        self.causal = causal
        # --pad: each sequence's own length, the rest padding (mask 0, labels -100): ranks' token counts differ
        self.lengths = torch.randint(2, 17, (n,), generator=g) if pad else torch.full((n,), 16)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids, n = self.ids[i], int(self.lengths[i])
        mask = (torch.arange(16) < n).long()
        label = ids.masked_fill(mask == 0, -100) if self.causal else (ids[:4].sum() % 2).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": label}


def build(kind: str):
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    return BertForSequenceClassification(BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=32, num_labels=2))


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--model", choices=["bert", "gpt2"], default="bert")
    p.add_argument("--resume", action="store_true", help="train half, then resume from the saved checkpoint")
    p.add_argument("--pad", action="store_true", help="gpt2: sequences of random lengths, padded (labels -100)")
    p.add_argument("--pretrained", action="store_true",
                   help="train half, save_model, then from_pretrained the saved directory and train on")
    p.add_argument("--corrupt-on-disk", action="store_true",
                   help="with --resume or --pretrained: change one byte of one tensor in the saved model.safetensors")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    where = [tempfile.mkdtemp(prefix="fw_hf_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    half = args.steps // 2

    def training_args(max_steps: int) -> TrainingArguments:
        return TrainingArguments(output_dir=where[0], max_steps=max_steps, per_device_train_batch_size=args.batch_size,
                                 per_device_eval_batch_size=16, learning_rate=args.lr / 50, eval_strategy="steps",
                                 eval_steps=5, save_steps=half, logging_steps=5, report_to=[], seed=args.seed,
                                 use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)

    causal = args.model == "gpt2"
    train, val = Tokens(512, causal, 1, args.pad), Tokens(64, causal, 2, args.pad)
    model = build(args.model)
    trainer = Trainer(model=model, args=training_args(half if args.resume or args.pretrained else args.steps),
                      train_dataset=train, eval_dataset=val)
    out = trainer.train()
    if args.pretrained:  # save_pretrained, then a fresh model from that directory trains on
        saved = os.path.join(where[0], "pretrained")
        trainer.save_model(saved)
        dist.barrier()
        if args.corrupt_on_disk and dist.get_rank() == 0:
            print(f"corrupted on disk: {corrupt_safetensors(os.path.join(saved, 'model.safetensors'))}", flush=True)
        dist.barrier()
        model = type(model).from_pretrained(saved)
        trainer = Trainer(model=model, args=training_args(args.steps - half), train_dataset=train, eval_dataset=val)
        out = trainer.train()
    if args.resume:
        if args.corrupt_on_disk and dist.get_rank() == 0:
            changed = corrupt_safetensors(os.path.join(where[0], f"checkpoint-{half}", "model.safetensors"))
            print(f"corrupted on disk: {changed}", flush=True)
        dist.barrier()
        model = build(args.model)
        trainer = Trainer(model=model, args=training_args(args.steps), train_dataset=train, eval_dataset=val)
        out = trainer.train(resume_from_checkpoint=os.path.join(where[0], f"checkpoint-{half}"))
    write_digest(args.digest_out, param_digest(model.named_parameters()), out.training_loss)
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(where[0], ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()
