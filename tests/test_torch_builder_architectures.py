"""Real architectures, as a new user would train them: tiny random-init transformers models (BERT, GPT-2, T5, BART,
ViT, GPT-J, CLIP, Swin, Mixtral, wav2vec2), a ResNet-style CNN with BatchNorm and an LSTM language model take one
SGD step through ORTTrainer with default options, and the weights match eager PyTorch's step. Nothing is downloaded.
`benchmarks/model_zoo.py` runs 230 such model classes (docs/engine.md §31 to §37, §40 and §42).

One step only: deep networks with BatchNorm over tiny batches are numerically chaotic over several steps (eager
float32 and float64 differ by several per cent after three). The maintained runtime has the torch builder only; on
onnxruntime-training each model also trains with the builder `auto` chooses there."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.trainer.gradient.errors import GradientBuildError
from orttrainer.trainer.runtime import has_training_build

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")  # the `examples` extra, installed on both lanes

BUILDERS = ["auto", "torch"] if has_training_build() else ["auto"]  # without the training build, auto is torch
LR = 1.0  # SGD: the change of a weight is its gradient


class TokensLoss(nn.Module):
    """A transformers model returning its own loss; model_desc's inputs are passed to forward by name."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


class PixelsLoss(TokensLoss):
    def forward(self, pixel_values, labels):
        return self.model(pixel_values=pixel_values, labels=labels).loss


class AudioLoss(TokensLoss):
    def forward(self, input_values, labels):
        return self.model(input_values=input_values, labels=labels).loss


def one_step(model: nn.Module, inputs: list[torch.Tensor], names: list[str], builder: str, loss_fn=None):
    """(trainer's loss, eager loss, trainer's and eager's gradients by name) after one SGD step with lr 1."""
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dims = [[("batch" if d == 0 else size) for d, size in enumerate(t.shape)] for t in inputs]
    desc = {"inputs": list(zip(names, dims, strict=True)), "outputs": [("loss", [], True)]}
    options = {"device": {"id": "cpu"}, "_internal_use": {"gradient_builder": builder}}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=LR), loss_fn=loss_fn, options=ORTTrainerOptions(options))
    loss = trainer.train_step(*inputs)
    state = trainer.state_dict(pytorch_format=True)
    given = len(inputs) - (1 if loss_fn else 0)
    out = reference(**dict(zip(names[:given], inputs[:given], strict=True)))
    want = loss_fn(out, inputs[-1]) if loss_fn else out
    want.backward()
    got = {n: (before[n] - state[n]) / LR for n in before}
    wanted = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in reference.named_parameters()}
    return trainer, float(loss), float(want), got, wanted


def assert_step_matches(model, inputs, names, builder, loss_fn=None, atol=2e-5, rtol=1e-3):
    trainer, loss, want, got, wanted = one_step(model, inputs, names, builder, loss_fn)
    assert loss == pytest.approx(want, rel=1e-4, abs=1e-5)
    worst = {n: float((got[n] - wanted[n]).abs().max()) for n in wanted}
    bad = {n: w for n, w in worst.items() if w > atol + rtol * float(wanted[n].abs().max())}
    assert not bad, f"gradients differ: {bad}"
    assert any(float(g.abs().max()) > 0 for g in wanted.values())  # the step moved something
    return trainer


def lm_batch(vocab: int, batch: int = 2, length: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g), torch.randint(1, vocab, (batch, length), generator=g)


# transformers -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("builder", BUILDERS)
def test_bert_masked_lm(builder):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = TokensLoss(transformers.BertForMaskedLM(config))
    trainer = assert_step_matches(model, list(lm_batch(64)), ["input_ids", "labels"], builder)
    assert trainer.eval_step(*lm_batch(64, seed=1)).isfinite()


@pytest.mark.parametrize("builder", BUILDERS)
def test_gpt2_causal_lm(builder):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = TokensLoss(transformers.GPT2LMHeadModel(config))
    ids, _ = lm_batch(64)
    assert_step_matches(model, [ids, ids.clone()], ["input_ids", "labels"], builder)


@pytest.mark.slow
@pytest.mark.parametrize("builder", BUILDERS)
def test_t5_conditional_generation(builder):
    """transformers' T5 shifts its labels with an in-place write (`x[..., 0] = start`): the issue-23 case whose
    graph ONNX Runtime refused ("Unsqueeze ... Unexpected axis value")."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = TokensLoss(transformers.T5ForConditionalGeneration(config))
    ids, labels = lm_batch(64)
    labels = labels[:, :5].contiguous()  # T5's loss views the labels
    trainer = assert_step_matches(model, [ids, labels], ["input_ids", "labels"], builder)
    assert trainer.eval_step(ids, labels).isfinite()


@pytest.mark.parametrize("builder", BUILDERS)
def test_bart_conditional_generation_in_training_mode(builder):
    """BART (like mBART, Marian, Pegasus, Whisper and OPT) runs LayerDrop in training mode: before every layer
    `if torch.rand([]) < self.layerdrop`, a branch on a random draw, with layerdrop 0 by default."""
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = TokensLoss(transformers.BartForConditionalGeneration(config))
    assert model.training and config.encoder_layerdrop == config.decoder_layerdrop == 0.0
    trainer = assert_step_matches(model, list(lm_batch(64)), ["input_ids", "labels"], builder)
    assert trainer.eval_step(*lm_batch(64, seed=1)).isfinite()


@pytest.mark.parametrize("builder", BUILDERS)
def test_vit_image_classification(builder):
    """ViT's patch embedding is a strided convolution (issue 23: it failed on convolution_backward)."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = PixelsLoss(transformers.ViTForImageClassification(config))
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 5, (2,), generator=g)
    assert_step_matches(model, [images, labels], ["pixel_values", "labels"], builder)


def gptj_case():
    config = transformers.GPTJConfig(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0
    )
    ids, _ = lm_batch(64)
    return TokensLoss(transformers.GPTJForCausalLM(config)), [ids, ids.clone()], ["input_ids", "labels"]


def clip_case():
    config = transformers.CLIPConfig(
        text_config={
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "max_position_embeddings": 16,
        },
        vision_config={
            "image_size": 16,
            "patch_size": 4,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
        },
        projection_dim=16,
    )
    g = torch.Generator().manual_seed(0)
    model = transformers.CLIPModel(config)
    inputs = [torch.randint(2, 64, (2, 8), generator=g), torch.randn(2, 3, 16, 16, generator=g)]

    class ContrastiveLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, pixel_values):
            return self.model(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss

    return ContrastiveLoss(), inputs, ["input_ids", "pixel_values"]


def swin_case():
    config = transformers.SwinConfig(
        image_size=16,
        patch_size=2,
        embed_dim=8,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=2,
        num_labels=3,
        drop_path_rate=0.0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(2, 3, 16, 16, generator=g), torch.tensor([0, 2])
    return PixelsLoss(transformers.SwinForImageClassification(config)), [images, labels], ["pixel_values", "labels"]


def mixtral_config():
    return transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def mixtral_case():
    model = transformers.MixtralForCausalLM._from_config(mixtral_config(), experts_implementation="batched_mm")
    ids, _ = lm_batch(64)
    return TokensLoss(model), [ids, ids.clone()], ["input_ids", "labels"]


def test_mixtral_with_its_default_grouped_experts_trains_like_pytorch(caplog):
    """transformers' default experts ('grouped_mm') group the tokens by expert, in shapes the routing decides: the
    traces compute them as 'batched_mm' (the same values in static shapes), and the model keeps its own
    implementation."""
    import logging

    torch.manual_seed(0)
    inner = transformers.MixtralForCausalLM(mixtral_config())
    assert inner.get_experts_implementation() == {"": "grouped_mm"}
    ids, _ = lm_batch(64)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer = assert_step_matches(TokensLoss(inner), [ids, ids.clone()], ["input_ids", "labels"], "torch")
        assert trainer.eval_step(ids, ids.clone()).isfinite()
    assert "'batched_mm'" in caplog.text and "does not cover" not in caplog.text and "is exported" not in caplog.text
    assert inner.get_experts_implementation() == {"": "grouped_mm"}


@pytest.mark.parametrize(
    "case", [gptj_case, clip_case, swin_case, mixtral_case], ids=["gptj", "clip", "swin", "mixtral"]
)
def test_models_that_needed_torch_onnx_train_on_the_direct_translation(case, caplog):
    """GPT-J's rotary embedding (the backward of `x[..., ::2]`: a slice_scatter with a step), CLIP's pooled token
    (`argmax` of int32 ids), Swin's pooler (adaptive pooling's `as_strided`) and Mixtral's router (`topk`) each sent
    the whole graph to torch.onnx; now they train like PyTorch without it, and evaluate from a traced graph."""
    import logging

    torch.manual_seed(0)
    model, inputs, names = case()
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer = assert_step_matches(model, inputs, names, "torch")
        assert trainer.eval_step(*inputs).isfinite()
    assert "does not cover" not in caplog.text and "is exported" not in caplog.text


def wav2vec2_config():
    return transformers.Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(4, 2),
        conv_kernel=(8, 4),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        num_labels=3,
        hidden_dropout=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        mask_feature_prob=0.0,
    )


def audio_batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 400, generator=g), torch.randint(0, 3, (2,), generator=g)]


@pytest.mark.parametrize("builder", BUILDERS)
def test_wav2vec2_convolutional_front_end(builder):
    """wav2vec2's feature encoder (strided Conv1d with GroupNorm) and its grouped positional convolution, handed
    over in eval mode, as a model without dropout trains (train mode: the next tests)."""
    torch.manual_seed(0)
    model = AudioLoss(transformers.Wav2Vec2ForSequenceClassification(wav2vec2_config())).eval()
    assert_step_matches(model, audio_batch(), ["input_values", "labels"], builder)


def test_wav2vec2_in_train_mode_trains_without_layer_drop():
    """In train mode wav2vec2's LayerDrop branches on `torch.rand([]) < layerdrop` before every layer; with
    layerdrop 0 every draw keeps the layer, and the trace records that."""
    torch.manual_seed(0)
    model = AudioLoss(transformers.Wav2Vec2ForSequenceClassification(wav2vec2_config()))
    assert model.training
    assert_step_matches(model, audio_batch(), ["input_values", "labels"], "torch")


def test_wav2vec2_in_train_mode_with_layer_drop_names_its_python_branch():
    """With a layerdrop between 0 and 1 the branch differs from step to step, which one training graph cannot
    hold: the error names the line, the comparison and what to do."""
    torch.manual_seed(0)
    config = wav2vec2_config()
    config.layerdrop = 0.1
    model = AudioLoss(transformers.Wav2Vec2ForSequenceClassification(config))
    with pytest.raises(GradientBuildError, match=r"modeling_wav2vec2\.py:\d+ \(`if not skip_the_layer") as raised:
        one_step(model, audio_batch(), ["input_values", "labels"], "torch")
    assert "torch.rand(...) < 0.1" in str(raised.value) and "layerdrop" in str(raised.value)


# hand-written models ------------------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    """ResNet-18's shape in miniature: stem convolution, BatchNorm, max pooling, basic blocks with strided
    downsampling shortcuts, global average pooling, a linear classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 5, 2, 2, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.layers = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2), BasicBlock(16, 32, 2))
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = self.layers(self.pool(self.stem(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


@pytest.mark.parametrize("builder", BUILDERS)
def test_resnet_with_batch_norm(builder):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    assert_step_matches(TinyResNet(), [images, labels], ["x", "labels"], builder, F.cross_entropy, atol=1e-4)


class LSTMLanguageModel(nn.Module):
    """PyTorch's word-language-model example in miniature: embedding, a 2-layer LSTM, a tied decoder."""

    def __init__(self, vocab: int = 50, size: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, size)
        self.lstm = nn.LSTM(size, size, num_layers=2, batch_first=True)
        self.decoder = nn.Linear(size, vocab)
        self.decoder.weight = self.embed.weight

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.decoder(out)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.slow
@pytest.mark.parametrize("builder", BUILDERS)
def test_lstm_language_model(builder):
    torch.manual_seed(0)
    tokens, targets = lm_batch(50, batch=2, length=5)
    trainer = assert_step_matches(LSTMLanguageModel(), [tokens, targets], ["tokens", "targets"], builder, lm_loss)
    assert trainer.eval_step(tokens, targets).isfinite()


class LSTMOnFeatures(nn.Module):
    """An LSTM reading the data directly (its input requires no grad): PyTorch's decomposition then picks the
    oneDNN kernel (mkldnn_rnn_layer), which has no ONNX translation, unless oneDNN is off while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, bidirectional=True, proj_size=4, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


@pytest.mark.slow
def test_lstm_on_the_data_bidirectional_with_projections():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(3, 4, 6, generator=g), torch.randint(0, 3, (3,), generator=g)
    trainer, loss, want, got, wanted = one_step(
        LSTMOnFeatures(), [x, labels], ["x", "labels"], "torch", F.cross_entropy
    )
    assert loss == pytest.approx(want, rel=1e-4)
    for name, grad in wanted.items():
        torch.testing.assert_close(got[name], grad, atol=2e-5, rtol=1e-3)


class ScalarModel(nn.Module):
    """A 0-d parameter read with a 0-d input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return (torch.tanh(x * self.scale) ** 2).sum()


def test_a_0d_parameter_and_input_train():
    """numpy's ascontiguousarray makes 0-d arrays 1-d: the state was fed as shape [1] and the loss came back [1]."""
    trainer, loss, want, got, wanted = one_step(ScalarModel(), [torch.tensor(0.7)], ["x"], "torch")
    assert trainer.train_step(torch.tensor(0.3)).shape == ()
    assert loss == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(got["scale"], wanted["scale"], atol=1e-6, rtol=1e-5)
