"""Hugging Face `transformers` BertForPreTraining, trained by ORTTrainer: masked-LM plus next-sentence prediction.

    python examples/bert_pretraining.py [--steps 100]

The BERT is tiny and built from a local `BertConfig` (no hub, no download); its vocabulary is the 256 bytes plus
BERT's special tokens, and its text is the source code of a few standard-library modules. Sentence pairs are two
text segments: half the time the second one follows the first (label 0), half the time it comes from elsewhere
(label 1). At the end the trained weights go back into the PyTorch model, which must give the trainer's eval loss.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
import warnings

import torch
from transformers import BertConfig, BertForPreTraining

from orttrainer import ORTTrainer, ORTTrainerOptions, optim

# Export-time notices that do not apply here: the tracer fixes transformers' shape checks for these inputs (every
# row full length, no causal mask), [PAD] never occurs (so its embedding row gets no gradient in PyTorch either), and
# the index operands are never negative.
warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
warnings.filterwarnings("ignore", message=".*embedding with padding_idx.*")
warnings.filterwarnings("ignore", message=".*aten::index operator of advanced indexing.*")

PAD, CLS, SEP, MASK = 256, 257, 258, 259  # the bytes are 0..255
VOCAB = 260
MODULES = ["argparse", "collections", "dataclasses", "functools", "inspect", "pathlib", "textwrap", "typing"]


def stdlib_bytes() -> torch.Tensor:
    chunks = []
    for name in MODULES:
        with open(importlib.util.find_spec(name).origin, "rb") as f:
            chunks.append(f.read())
    return torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8).long()


def make_batch(text: torch.Tensor, batch: int, half: int, g: torch.Generator) -> list[torch.Tensor]:
    """`[CLS] a [SEP] b [SEP]` with 15% of the bytes masked (BERT's 80/10/10 recipe) and the next-sentence label."""
    starts = torch.randint(0, len(text) - 2 * half, (batch,), generator=g)
    is_random = torch.rand(batch, generator=g) < 0.5
    elsewhere = torch.randint(0, len(text) - half, (batch,), generator=g)
    rows = []
    for start, random_b, other in zip(starts.tolist(), is_random.tolist(), elsewhere.tolist(), strict=False):
        a = text[start : start + half]
        b = text[other : other + half] if random_b else text[start + half : start + 2 * half]
        rows.append(torch.cat([torch.tensor([CLS]), a, torch.tensor([SEP]), b, torch.tensor([SEP])]))
    ids = torch.stack(rows)
    token_type_ids = torch.zeros_like(ids)
    token_type_ids[:, half + 2 :] = 1  # segment b and its [SEP]
    chosen = (torch.rand(ids.shape, generator=g) < 0.15) & (ids < 256)  # special tokens are never predicted
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=g)
    ids = torch.where(chosen & (roll < 0.8), torch.full_like(ids, MASK), ids)
    ids = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), torch.randint(0, 256, ids.shape, generator=g), ids)
    return [ids, token_type_ids, torch.ones_like(ids), labels, is_random.long()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--half", type=int, default=31, help="bytes per segment (sequence = 2 * half + 3)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=2 * args.half + 3,
        pad_token_id=PAD,
        return_dict=False,
    )  # a tuple (loss, mlm logits, nsp logits): what ORTTrainer returns
    model = BertForPreTraining(config)
    # The inputs reach BertForPreTraining.forward by these names; with `labels` and `next_sentence_label` the model
    # computes BERT's loss (masked LM + next sentence) itself, so no loss_fn is needed.
    model_desc = {
        "inputs": [
            ("input_ids", ["batch", "seq"]),
            ("token_type_ids", ["batch", "seq"]),
            ("attention_mask", ["batch", "seq"]),
            ("labels", ["batch", "seq"]),
            ("next_sentence_label", ["batch"]),
        ],
        "outputs": [
            ("loss", [], True),
            ("prediction_logits", ["batch", "seq", VOCAB]),
            ("seq_relationship_logits", ["batch", 2]),
        ],
    }
    options = ORTTrainerOptions(
        {
            "device": {"id": args.device},
            "lr_scheduler": optim.LinearWarmupLRScheduler(total_steps=args.steps, warmup=0.1),
        }
    )
    trainer = ORTTrainer(model, model_desc, optim.LambConfig(lr=1e-2), options=options)

    text, g = stdlib_bytes(), torch.Generator().manual_seed(0)
    held_out = make_batch(text, 64, args.half, torch.Generator().manual_seed(1))
    start, losses = time.perf_counter(), []
    for step in range(args.steps):
        loss, _, _ = trainer.train_step(*make_batch(text, args.batch, args.half, g))
        losses.append(loss.item())
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.3f}")
    eval_loss = trainer.eval_step(*held_out)[0].item()
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s; held-out loss {eval_loss:.3f}")

    # Back to PyTorch: the trained weights load into the original module, which computes the same loss.
    model.load_state_dict(trainer.state_dict(pytorch_format=True))
    model.eval()
    with torch.no_grad():
        torch_loss = model(**{name: x for (name, _), x in zip(model_desc["inputs"], held_out, strict=False)})[0].item()
    print(f"PyTorch with the trained weights: held-out loss {torch_loss:.3f}")
    return {"losses": losses, "eval_loss": eval_loss, "torch_loss": torch_loss}


if __name__ == "__main__":
    main()
