"""BERT-style masked-language-model pretraining of a small byte-level transformer, on the Python standard library's
own source code (it ships with Python: no download, no hub).

    python examples/pretrain_mlm.py [--steps 600] [--device cpu] [--out demo_output]

What it shows, in order: ORTTrainer with LAMB, a linear warm-up schedule and gradient accumulation; a progress bar;
periodic `eval_step` on held-out modules; `save_checkpoint`, then a second trainer resuming from that checkpoint;
`save_as_onnx`, checked against plain ONNX Runtime inference; a loss-curve PNG and a summary table. Every run writes
into a new directory `<out>/run-<timestamp>`, so nothing is overwritten.

The loss is the cross-entropy of the masked bytes. It starts near ln(257) = 5.55 (a uniform guess); a model that has
learned only how often each byte occurs gets about 3.3 on the held-out text; below that, it is reading the context.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn
from tqdm import tqdm

from orttrainer import ORTTrainer, ORTTrainerOptions, optim

# Bytes are tokens 0..255; one extra id is the [MASK] token. Windows are always full, so no [PAD] is needed.
MASK_ID, VOCAB = 256, 257
IGNORE = -100  # label of unmasked positions: cross_entropy skips them

# Held-out modules are never trained on: the eval loss measures what the model learned about Python, not these files.
TRAIN_MODULES = [
    "argparse",
    "ast",
    "calendar",
    "collections",
    "configparser",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "enum",
    "functools",
    "gettext",
    "heapq",
    "inspect",
    "ipaddress",
    "json.decoder",
    "json.encoder",
    "logging",
    "pathlib",
    "pickle",
    "pprint",
    "random",
    "shutil",
    "string",
    "subprocess",
    "tarfile",
    "threading",
    "typing",
    "unittest.case",
    "urllib.parse",
    "uuid",
    "zipfile",
]
EVAL_MODULES = ["fractions", "statistics", "textwrap"]


def stdlib_bytes(modules: list[str]) -> torch.Tensor:
    """The source files of `modules`, concatenated, as a uint8 tensor."""
    chunks = []
    for name in modules:
        with open(importlib.util.find_spec(name).origin, "rb") as f:
            chunks.append(f.read())
    return torch.frombuffer(bytearray(b"\n\n".join(chunks)), dtype=torch.uint8)


class ByteBERT(nn.Module):
    """A small BERT encoder: token + learned position embeddings, pre-norm transformer layers, a tied output head."""

    def __init__(self, d_model: int, layers: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.bias = nn.Parameter(torch.zeros(VOCAB))
        nn.init.normal_(self.embed.weight, std=0.02)  # BERT's init; N(0, 1) would make the tied logits huge

    def forward(self, tokens):
        h = self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]])
        return self.norm(h) @ self.embed.weight.t() + self.bias  # tied: predicting a byte reuses its embedding


def mlm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE)


def mask_tokens(windows: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's recipe: 15% of positions are predicted; of those 80% become [MASK], 10% a random byte, 10% stay."""
    chosen = torch.rand(windows.shape, generator=g) < 0.15
    labels = torch.where(chosen, windows, torch.full_like(windows, IGNORE))
    roll = torch.rand(windows.shape, generator=g)
    tokens = torch.where(chosen & (roll < 0.8), torch.full_like(windows, MASK_ID), windows)
    random_bytes = torch.randint(0, 256, windows.shape, generator=g)
    tokens = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_bytes, tokens)
    return tokens, labels


def sample_batch(text: torch.Tensor, batch: int, seq: int, g: torch.Generator):
    starts = torch.randint(0, len(text) - seq, (batch,), generator=g)
    windows = torch.stack([text[s : s + seq] for s in starts.tolist()]).long()
    return mask_tokens(windows, g)


def make_trainer(args, total_steps: int) -> ORTTrainer:
    model_desc = {
        "inputs": [("tokens", ["batch", "seq"]), ("labels", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])],
    }
    options = ORTTrainerOptions(
        {
            "device": {"id": args.device},  # the legacy default is "cuda"
            "batch": {"gradient_accumulation_steps": args.accumulation},
            "lr_scheduler": optim.LinearWarmupLRScheduler(total_steps=total_steps, warmup=0.1),
        }
    )
    model = ByteBERT(args.d_model, args.layers, args.heads, args.seq, args.dropout)
    # BERT's recipe: weight decay except on biases and LayerNorm weights (a parameter group, by parameter name).
    no_decay = [name for name, _ in model.named_parameters() if name.endswith("bias") or "norm" in name]
    config = optim.LambConfig([{"params": no_decay, "lambda_coef": 0.0}], lr=args.lr, lambda_coef=0.01)
    return ORTTrainer(model, model_desc, config, loss_fn=mlm_loss, options=options)


def evaluate(trainer: ORTTrainer, eval_batches) -> float:
    return sum(trainer.eval_step(tokens, labels)[0].item() for tokens, labels in eval_batches) / len(eval_batches)


def frequency_baseline(train_text: torch.Tensor, eval_batches) -> float:
    """The held-out loss of a model that knows only how often each byte occurs in the training text: a model whose
    loss goes below this uses the context around the mask."""
    log_p = torch.log((torch.bincount(train_text.long(), minlength=256) + 1).double())  # +1: unseen bytes
    log_p -= torch.logsumexp(log_p, 0)
    losses = [-log_p[labels[labels != IGNORE]].mean().item() for _, labels in eval_batches]
    return sum(losses) / len(losses)


def train(trainer, args, text, eval_batches, first: int, last: int, g, history, desc: str) -> dict:
    """Optimizer steps `first+1 .. last` (each of `args.accumulation` micro-steps), with a progress bar."""
    micro, timed_samples, timed_s, first_step_s, samples_s = 0, 0, 0.0, None, float("nan")
    bar = tqdm(range(first, last), desc=desc, unit="step", mininterval=1.0, disable=args.quiet)
    for step in bar:
        for _ in range(args.accumulation):
            start = time.perf_counter()  # throughput counts making the batch too: it is part of training
            tokens, labels = sample_batch(text, args.batch, args.seq, g)
            loss, _ = trainer.train_step(tokens, labels)
            loss = loss.item()
            elapsed = time.perf_counter() - start
            micro += 1
            if first_step_s is None:
                first_step_s = elapsed  # export + compile + session creation + the first run
            elif micro > 5:  # steady state: after the first few runs have warmed ONNX Runtime's allocator up
                timed_samples, timed_s = timed_samples + args.batch, timed_s + elapsed
            history["train"].append((step + 1, loss))
        samples_s = timed_samples / timed_s if timed_s else float("nan")
        bar.set_postfix(loss=f"{loss:.3f}", samples_s=f"{samples_s:.0f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == last:
            history["eval"].append((step + 1, evaluate(trainer, eval_batches)))
            bar.write(f"step {step + 1:5d}  train loss {loss:.3f}  held-out loss {history['eval'][-1][1]:.3f}")
    return {"first_step_s": first_step_s, "samples_s": samples_s}


def inference_model(path: str) -> onnx.ModelProto:
    """The file `save_as_onnx` writes is the trainer's forward graph, made to be trained again: its Dropout nodes run in
    training mode. For inference we switch them off, as `eval_step` does."""
    model = onnx.load(path)
    for node in model.graph.node:
        if node.op_type == "Dropout":
            node.CopyFrom(onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
    return model


def check_onnx(path: str, trainer: ORTTrainer, tokens, labels) -> float:
    """Plain ONNX Runtime on the saved model must give the trainer's eval outputs. Returns the largest difference."""
    session_options = ort.SessionOptions()
    session_options.log_severity_level = 3  # quiet: the switched-off dropouts leave unused constants behind
    session = ort.InferenceSession(
        inference_model(path).SerializeToString(), session_options, providers=["CPUExecutionProvider"]
    )
    loss, logits = session.run(["loss", "logits"], {"tokens": tokens.numpy(), "labels": labels.numpy()})
    eval_loss, eval_logits = trainer.eval_step(tokens, labels)
    diff = max(abs(float(loss) - eval_loss.item()), float(np.abs(logits - eval_logits.cpu().numpy()).max()))
    if diff > 1e-4:
        raise AssertionError(f"ONNX Runtime inference differs from eval_step by {diff}")
    return diff


def plot(history: dict, resume_step: int, baseline: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps, losses = zip(*history["train"], strict=False)
    window = max(1, len(losses) // 50)  # a moving average: single micro-batch losses are noisy
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (micro-batch)")
    ax.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"train (mean of {window})")
    ax.plot(*zip(*history["eval"], strict=False), "o-", color="tab:orange", label="held-out modules")
    ax.axvline(resume_step, color="gray", linestyle="--", label="checkpoint / resume")
    ax.axhline(baseline, color="tab:green", linestyle=":", label="held-out, byte frequencies alone")
    ax.set(
        xlabel="optimizer step", ylabel="masked-byte cross-entropy", title="orttrainer: byte-level MLM on stdlib source"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps in all (both runs)")
    parser.add_argument("--resume-at", type=float, default=0.5, help="fraction of --steps before the checkpoint")
    parser.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda' (onnxruntime-training's CUDA build)")
    parser.add_argument("--out", default="demo_output")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    run_dir = os.path.join(args.out, time.strftime("run-%Y%m%d-%H%M%S"))
    os.makedirs(run_dir)  # fails rather than mixing two runs' files (save_checkpoint never overwrites either)
    torch.manual_seed(0)
    train_text, eval_text = stdlib_bytes(TRAIN_MODULES), stdlib_bytes(EVAL_MODULES)
    print(
        f"text: {len(train_text) / 1e6:.2f} MB of stdlib source to train on, {len(eval_text) / 1e3:.0f} kB held out "
        f"({', '.join(EVAL_MODULES)}); run directory {run_dir}"
    )
    eval_g = torch.Generator().manual_seed(1234)  # the same held-out batches every time: comparable eval losses
    eval_batches = [sample_batch(eval_text, args.batch, args.seq, eval_g) for _ in range(args.eval_batches)]
    history = {"train": [], "eval": []}
    resume_step = max(1, int(args.steps * args.resume_at))

    # Run 1: train, then checkpoint.
    g = torch.Generator().manual_seed(0)
    trainer = make_trainer(args, args.steps)
    run1 = train(trainer, args, train_text, eval_batches, 0, resume_step, g, history, "run 1")
    checkpoint = os.path.join(run_dir, f"step{resume_step}.ortcp")
    trainer.save_checkpoint(checkpoint, user_dict={"data_rng": g.get_state()})
    saved_eval = history["eval"][-1][1]
    del trainer

    # Run 2: a new process would do exactly this: a fresh model, then load_checkpoint before the first step.
    start = time.perf_counter()
    trainer = make_trainer(args, args.steps)
    g = torch.Generator()
    g.set_state(trainer.load_checkpoint(checkpoint)["data_rng"])  # the data stream continues too
    resumed_eval = evaluate(trainer, eval_batches)  # the session (export, compile) is created here, state loaded
    resume_s = time.perf_counter() - start
    print(
        f"resumed from {checkpoint}: optimizer step {trainer.optimization_step}, held-out loss {resumed_eval:.4f} "
        f"(at save: {saved_eval:.4f})"
    )
    if trainer.optimization_step != resume_step or not math.isclose(resumed_eval, saved_eval, rel_tol=1e-5):
        raise AssertionError("the resumed trainer does not continue from the checkpoint")
    run2 = train(trainer, args, train_text, eval_batches, resume_step, args.steps, g, history, "run 2")

    onnx_path = os.path.join(run_dir, "byte_bert.onnx")
    trainer.save_as_onnx(onnx_path)
    diff = check_onnx(onnx_path, trainer, *eval_batches[0])
    print(f"ONNX check: onnxruntime.InferenceSession on {onnx_path} matches eval_step (max difference {diff:.1e})")
    baseline = frequency_baseline(train_text, eval_batches)
    png = os.path.join(run_dir, "loss.png")
    plot(history, resume_step, baseline, png)

    first_loss = sum(loss for _, loss in history["train"][:10]) / min(10, len(history["train"]))
    last_loss = sum(loss for _, loss in history["train"][-10:]) / min(10, len(history["train"]))
    summary = {
        "optimizer steps": f"{trainer.optimization_step} (run 1: {resume_step}, run 2: {args.steps - resume_step})",
        "samples per step": f"{args.batch} x {args.accumulation} accumulated",
        "time to first step (export, compile, run)": f"{run1['first_step_s']:.1f} s",
        "time to resume (new trainer, load, first eval)": f"{resume_s:.1f} s",
        "steady samples/s": f"{run1['samples_s']:.0f} (resumed run: {run2['samples_s']:.0f})",
        "train loss (mean of 10 micro-batches)": f"{first_loss:.3f} -> {last_loss:.3f}",
        "held-out loss": f"{history['eval'][0][1]:.3f} (step {history['eval'][0][0]}) -> {history['eval'][-1][1]:.3f} "
        f"(byte frequencies alone: {baseline:.3f})",
        "checkpoint": checkpoint,
        "ONNX model (checked)": onnx_path,
        "loss curve": png,
    }
    print("\n| | |\n|---|---|")
    for key, value in summary.items():
        print(f"| {key} | {value} |")
    return {
        "history": history,
        "summary": summary,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "onnx_diff": diff,
        "run_dir": run_dir,
    }


if __name__ == "__main__":
    main()
