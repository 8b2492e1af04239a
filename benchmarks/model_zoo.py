"""Model classes of transformers through ORTTrainer's gradient builders: tiny configs, random init, nothing downloaded.

    python benchmarks/model_zoo.py [--models llama bart ...] [--jobs 2] [--builder torch|auto|ort]

`--builder` is the `_internal_use.gradient_builder` option (default `torch`; `auto` is each runtime's default, which
on onnxruntime-training chooses the `ort` builder for most models: the `builder` column says which one built it; its
training graph's route is then "TorchScript export"). The float dropout attributes that transformers passes to
`F.dropout` are zeroed too.
Each model runs in a fresh process with the compile cache off: one SGD step (lr 1) in training mode, dropout off,
against eager PyTorch's gradients (and float64 autograd's: `_gradients_differ`), then an eval step. Reported per
model: whether it trains and matches, the route of its training graph (`direct`: the direct ONNX
translation; else the op that sent it to torch.onnx), whether its eval graph was traced or exported, and the time
of the first `train_step` (construction excluded). Prints a table and writes benchmarks/results/model_zoo.json.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

V, H, L, NH, FF = 99, 32, 2, 4, 64  # vocabulary, width, layers, heads, feed-forward width
SIZES = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=FF)
SEQ2SEQ = dict(
    vocab_size=V,
    d_model=H,
    encoder_layers=L,
    decoder_layers=L,
    encoder_attention_heads=NH,
    decoder_attention_heads=NH,
    encoder_ffn_dim=FF,
    decoder_ffn_dim=FF,
    max_position_embeddings=64,
)
SWIN = dict(
    image_size=16,
    patch_size=2,
    embed_dim=8,
    depths=[1, 1],
    num_heads=[2, 2],
    window_size=2,
    num_labels=3,
    drop_path_rate=0.0,
)
HIERARCHICAL = dict(  # SegFormer's and PVTv2's stages
    num_encoder_blocks=2,
    depths=[1, 1],
    sr_ratios=[2, 1],
    hidden_sizes=[8, 16],
    num_attention_heads=[1, 2],
    patch_sizes=[3, 3],
    strides=[2, 2],
    mlp_ratios=[2, 2],
    num_labels=3,
    drop_path_rate=0.0,
)
SERIES = dict(  # time series: two channels, 32 steps in patches of 8, 8 steps predicted
    num_input_channels=2, context_length=32, patch_length=8, patch_stride=8, d_model=16, prediction_length=8
)
FORECAST = dict(  # forecasting with time features: 8 steps of context (and 2 lags) predict 4
    prediction_length=4,
    context_length=8,
    lags_sequence=[1, 2],
    num_time_features=2,
    d_model=16,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=16,
    decoder_ffn_dim=16,
    encoder_layerdrop=0.0,
    decoder_layerdrop=0.0,
)
T5 = dict(
    vocab_size=V, d_model=H, d_kv=8, d_ff=FF, num_layers=L, num_heads=NH, decoder_start_token_id=0, pad_token_id=0
)
IMAGE = SIZES | dict(image_size=16, patch_size=4, num_labels=3)
VIDEO = IMAGE | dict(num_frames=4)


def _lm(**extra: Any) -> dict[str, Any]:
    return SIZES | dict(vocab_size=V, max_position_embeddings=64, pad_token_id=0) | extra


MLA = dict(  # DeepSeek-V3's multi-head latent attention and experts, as its followers name them
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
)
LINEAR_ATTENTION = dict(  # Qwen3-Next's gated delta rule; the linear attention's cache is for generation only
    num_key_value_heads=2,
    head_dim=8,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    use_cache=False,
)
LINEAR_ATTENTION_EXPERTS = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)


SPEECH = _lm(  # wav2vec2-style models: a convolutional front end, no time masking
    conv_dim=(8, 8),
    conv_stride=(4, 4),
    conv_kernel=(8, 4),
    num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=2,
    mask_time_prob=0.0,
)
AUDIO = SPEECH | dict(layerdrop=0.0, num_labels=3)  # classifiers, LayerDrop off


# name -> (config class, its keyword arguments, model class, input kind)
MODELS: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "llama": ("LlamaConfig", _lm(num_key_value_heads=2), "LlamaForCausalLM", "tokens"),
    "mistral": ("MistralConfig", _lm(num_key_value_heads=2), "MistralForCausalLM", "tokens"),
    "mixtral": (
        "MixtralConfig",
        _lm(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "MixtralForCausalLM",
        "tokens",
    ),
    "qwen2": ("Qwen2Config", _lm(num_key_value_heads=2), "Qwen2ForCausalLM", "tokens"),
    "phi": ("PhiConfig", _lm(), "PhiForCausalLM", "tokens"),
    "phi3": ("Phi3Config", _lm(num_key_value_heads=2), "Phi3ForCausalLM", "tokens"),
    "gemma": ("GemmaConfig", _lm(num_key_value_heads=2, head_dim=8), "GemmaForCausalLM", "tokens"),
    "gemma2": ("Gemma2Config", _lm(num_key_value_heads=2, head_dim=8), "Gemma2ForCausalLM", "tokens"),
    "gpt_neox": ("GPTNeoXConfig", _lm(), "GPTNeoXForCausalLM", "tokens"),
    "opt": (
        "OPTConfig",
        dict(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            ffn_dim=FF,
            max_position_embeddings=64,
            word_embed_proj_dim=H,
        ),
        "OPTForCausalLM",
        "tokens",
    ),
    "bloom": ("BloomConfig", dict(vocab_size=V, hidden_size=H, n_layer=L, n_head=NH), "BloomForCausalLM", "tokens"),
    "falcon": (
        "FalconConfig",
        dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH),
        "FalconForCausalLM",
        "tokens",
    ),
    "gptj": (
        "GPTJConfig",
        dict(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=64, rotary_dim=4),
        "GPTJForCausalLM",
        "tokens",
    ),
    "codegen": (
        "CodeGenConfig",
        dict(
            vocab_size=V,
            n_embd=H,
            n_layer=L,
            n_head=NH,
            n_positions=64,
            n_ctx=64,
            rotary_dim=4,
        ),
        "CodeGenForCausalLM",
        "tokens",
    ),
    "gpt_neo": (
        "GPTNeoConfig",
        dict(
            vocab_size=V,
            hidden_size=H,
            num_layers=L,
            num_heads=NH,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=64,
            window_size=4,
        ),
        "GPTNeoForCausalLM",
        "tokens",
    ),
    "distilbert": (
        "DistilBertConfig",
        dict(
            vocab_size=V,
            dim=H,
            n_layers=L,
            n_heads=NH,
            hidden_dim=FF,
            max_position_embeddings=64,
        ),
        "DistilBertForMaskedLM",
        "tokens",
    ),
    "roberta": ("RobertaConfig", _lm(pad_token_id=1), "RobertaForMaskedLM", "tokens"),
    "albert": ("AlbertConfig", _lm(embedding_size=16), "AlbertForMaskedLM", "tokens"),
    "electra": ("ElectraConfig", _lm(embedding_size=16), "ElectraForMaskedLM", "tokens"),
    "deberta": (
        "DebertaConfig",
        _lm(relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16),
        "DebertaForMaskedLM",
        "tokens",
    ),
    "deberta_v2": (
        "DebertaV2Config",
        _lm(relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16),
        "DebertaV2ForMaskedLM",
        "tokens",
    ),
    "xlm_roberta": ("XLMRobertaConfig", _lm(pad_token_id=1), "XLMRobertaForMaskedLM", "tokens"),
    "mpnet": ("MPNetConfig", _lm(pad_token_id=1), "MPNetForMaskedLM", "tokens"),
    "funnel": (
        "FunnelConfig",
        dict(
            vocab_size=V,
            d_model=H,
            n_head=NH,
            d_head=8,
            d_inner=FF,
            block_sizes=[1, 1],
            num_decoder_layers=1,
        ),
        "FunnelForMaskedLM",
        "tokens",
    ),
    "xlnet": (
        "XLNetConfig",
        dict(vocab_size=V, d_model=H, n_layer=L, n_head=NH, d_inner=FF),
        "XLNetLMHeadModel",
        "tokens",
    ),
    "longformer": (
        "LongformerConfig",
        _lm(max_position_embeddings=80, attention_window=4, pad_token_id=1),
        "LongformerForMaskedLM",
        "tokens",
    ),
    "big_bird": ("BigBirdConfig", _lm(attention_type="original_full"), "BigBirdForMaskedLM", "tokens"),
    "squeezebert": ("SqueezeBertConfig", _lm(embedding_size=H), "SqueezeBertForMaskedLM", "tokens"),
    "layoutlm": ("LayoutLMConfig", _lm(), "LayoutLMForMaskedLM", "tokens"),
    "bart": ("BartConfig", SEQ2SEQ, "BartForConditionalGeneration", "tokens"),
    "mbart": ("MBartConfig", SEQ2SEQ, "MBartForConditionalGeneration", "tokens"),
    "pegasus": ("PegasusConfig", SEQ2SEQ, "PegasusForConditionalGeneration", "tokens"),
    "marian": ("MarianConfig", SEQ2SEQ | dict(decoder_start_token_id=0, pad_token_id=0), "MarianMTModel", "tokens"),
    "whisper": (
        "WhisperConfig",
        SEQ2SEQ
        | dict(
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=32,
            decoder_start_token_id=1,
            pad_token_id=0,
        ),
        "WhisperForConditionalGeneration",
        "features",
    ),
    "vit": ("ViTConfig", IMAGE, "ViTForImageClassification", "pixels"),
    "deit": ("DeiTConfig", IMAGE, "DeiTForImageClassification", "pixels"),
    "beit": (
        "BeitConfig",
        IMAGE | dict(use_relative_position_bias=True, drop_path_rate=0.0),
        "BeitForImageClassification",
        "pixels",
    ),
    "swin": (
        "SwinConfig",
        SWIN,
        "SwinForImageClassification",
        "pixels",
    ),
    "convnext": (
        "ConvNextConfig",
        dict(
            hidden_sizes=[8, 16],
            depths=[1, 1],
            num_stages=2,
            num_labels=3,
            drop_path_rate=0.0,
        ),
        "ConvNextForImageClassification",
        "pixels",
    ),
    "resnet": (
        "ResNetConfig",
        dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3),
        "ResNetForImageClassification",
        "pixels",
    ),
    "regnet": (
        "RegNetConfig",
        dict(
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            groups_width=4,
            num_labels=3,
        ),
        "RegNetForImageClassification",
        "pixels",
    ),
    "mobilenet_v2": (
        "MobileNetV2Config",
        dict(image_size=32, depth_multiplier=0.25, num_labels=3),
        "MobileNetV2ForImageClassification",
        "pixels32",
    ),
    "efficientnet": (
        "EfficientNetConfig",
        dict(
            image_size=32,
            width_coefficient=0.1,
            depth_coefficient=0.1,
            hidden_dim=128,
            num_labels=3,
            drop_connect_rate=0.0,
        ),
        "EfficientNetForImageClassification",
        "pixels32",
    ),
    "poolformer": (
        "PoolFormerConfig",
        dict(
            image_size=16,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            num_labels=3,
            num_encoder_blocks=2,
            patch_sizes=[3, 3],
            strides=[2, 2],
            padding=[1, 1],
            pool_size=3,
        ),
        "PoolFormerForImageClassification",
        "pixels",
    ),
    "segformer": (
        "SegformerConfig",
        HIERARCHICAL,
        "SegformerForImageClassification",
        "pixels",
    ),
    "mobilevit": (
        "MobileViTConfig",
        dict(
            image_size=32,
            hidden_sizes=[16, 16, 16],
            neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
            num_labels=3,
        ),
        "MobileViTForImageClassification",
        "pixels32",
    ),
    "hubert": (
        "HubertConfig",
        SPEECH,  # its defaults: LayerDrop 0.1 is refused, the error naming the line (wav2vec2_ctc: LayerDrop off)
        "HubertForCTC",
        "audio",
    ),
    "clip": (
        "CLIPConfig",
        dict(
            text_config=dict(
                vocab_size=V,
                hidden_size=H,
                num_hidden_layers=L,
                num_attention_heads=NH,
                intermediate_size=FF,
                max_position_embeddings=16,
            ),
            vision_config={k: v for k, v in IMAGE.items() if k != "num_labels"},
            projection_dim=16,
        ),
        "CLIPModel",
        "clip",
    ),
    "t5": ("T5Config", T5, "T5ForConditionalGeneration", "tokens"),
    "mt5": ("MT5Config", T5, "MT5ForConditionalGeneration", "tokens"),
    "umt5": ("UMT5Config", T5, "UMT5ForConditionalGeneration", "tokens"),
    "longt5": (
        "LongT5Config",
        T5 | dict(encoder_attention_type="transient-global", local_radius=2, global_block_size=4),
        "LongT5ForConditionalGeneration",
        "tokens_masked",  # without an attention_mask it fails under torch.compile's flags, eagerly too
    ),
    "switch_transformers": (
        "SwitchTransformersConfig",
        T5 | dict(num_experts=4, expert_capacity=8, router_jitter_noise=0.0),
        "SwitchTransformersForConditionalGeneration",
        "tokens",
    ),
    "m2m100": (  # its default LayerDrop (0.05) cannot be traced: the error says to set it to 0
        "M2M100Config",
        SEQ2SEQ | dict(encoder_layerdrop=0.0, decoder_layerdrop=0.0),
        "M2M100ForConditionalGeneration",
        "tokens",
    ),
    "blenderbot": ("BlenderbotConfig", SEQ2SEQ, "BlenderbotForConditionalGeneration", "tokens"),
    "blenderbot_small": ("BlenderbotSmallConfig", SEQ2SEQ, "BlenderbotSmallForConditionalGeneration", "tokens"),
    "led": (
        "LEDConfig",
        {k: v for k, v in SEQ2SEQ.items() if k != "max_position_embeddings"}
        | dict(attention_window=4, max_encoder_position_embeddings=64, max_decoder_position_embeddings=64),
        "LEDForConditionalGeneration",
        "tokens",
    ),
    "prophetnet": (
        "ProphetNetConfig",
        dict(
            vocab_size=V,
            hidden_size=H,
            encoder_ffn_dim=FF,
            decoder_ffn_dim=FF,
            num_encoder_layers=L,
            num_decoder_layers=L,
            num_encoder_attention_heads=NH,
            num_decoder_attention_heads=NH,
            ngram=2,
            num_buckets=8,
            relative_max_distance=16,
            max_position_embeddings=64,
        ),
        "ProphetNetForConditionalGeneration",
        "tokens",
    ),
    "gpt2": (
        "GPT2Config",
        dict(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=64),
        "GPT2LMHeadModel",
        "tokens",
    ),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        dict(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=64, multi_query=True),
        "GPTBigCodeForCausalLM",
        "tokens",
    ),
    "xglm": (
        "XGLMConfig",
        dict(vocab_size=V, d_model=H, num_layers=L, attention_heads=NH, ffn_dim=FF, max_position_embeddings=64),
        "XGLMForCausalLM",
        "tokens",
    ),
    "biogpt": ("BioGptConfig", _lm(), "BioGptForCausalLM", "tokens"),
    "qwen3": ("Qwen3Config", _lm(num_key_value_heads=2, head_dim=8), "Qwen3ForCausalLM", "tokens"),
    "olmo2": ("Olmo2Config", _lm(num_key_value_heads=2), "Olmo2ForCausalLM", "tokens"),
    "cohere": ("CohereConfig", _lm(num_key_value_heads=2), "CohereForCausalLM", "tokens"),
    "starcoder2": ("Starcoder2Config", _lm(num_key_value_heads=2), "Starcoder2ForCausalLM", "tokens"),
    "stablelm": ("StableLmConfig", _lm(num_key_value_heads=2), "StableLmForCausalLM", "tokens"),
    "mamba": (
        "MambaConfig",
        dict(vocab_size=V, hidden_size=H, state_size=4, num_hidden_layers=L, expand=2, conv_kernel=4),
        "MambaForCausalLM",
        "tokens",
    ),
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        _lm(num_key_value_heads=1, lru_width=H, attention_window_size=8, block_types=["recurrent", "attention"]),
        "RecurrentGemmaForCausalLM",
        "tokens",
    ),
    "fnet": ("FNetConfig", _lm(), "FNetForMaskedLM", "tokens"),
    "convbert": ("ConvBertConfig", _lm(embedding_size=H), "ConvBertForMaskedLM", "tokens"),
    "esm": (
        "EsmConfig",
        _lm(pad_token_id=1, mask_token_id=2, position_embedding_type="rotary"),
        "EsmForMaskedLM",
        "tokens",
    ),
    "roformer": ("RoFormerConfig", _lm(embedding_size=H), "RoFormerForMaskedLM", "tokens"),
    "mobilebert": (
        "MobileBertConfig",
        _lm(embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2),
        "MobileBertForMaskedLM",
        "tokens",
    ),
    "nystromformer": (
        "NystromformerConfig",
        _lm(num_landmarks=4, segment_means_seq_len=8),
        "NystromformerForMaskedLM",
        "tokens",
    ),
    "canine": (
        "CanineConfig",
        SIZES
        | dict(
            downsampling_rate=2,
            num_hash_buckets=64,
            num_hash_functions=2,
            local_transformer_stride=4,
            num_labels=3,
        ),
        "CanineForSequenceClassification",
        "classify",
    ),
    "swinv2": (
        "Swinv2Config",
        SWIN,
        "Swinv2ForImageClassification",
        "pixels",
    ),
    "dinov2": (
        "Dinov2Config",
        {k: v for k, v in IMAGE.items() if k != "intermediate_size"} | dict(mlp_ratio=2),
        "Dinov2ForImageClassification",
        "pixels",
    ),
    "vit_mae": (
        "ViTMAEConfig",
        {k: v for k, v in IMAGE.items() if k != "num_labels"}
        | dict(
            decoder_hidden_size=16,
            decoder_num_hidden_layers=1,
            decoder_num_attention_heads=2,
            decoder_intermediate_size=32,
        ),
        "ViTMAEForPreTraining",
        "mae",
    ),
    "pvt_v2": (
        "PvtV2Config",
        HIERARCHICAL | dict(image_size=16),
        "PvtV2ForImageClassification",
        "pixels",
    ),
    "cvt": (
        "CvtConfig",
        dict(
            patch_sizes=[3, 3],
            patch_stride=[2, 2],
            patch_padding=[1, 1],
            embed_dim=[8, 16],
            num_heads=[1, 2],
            depth=[1, 2],  # CvtStage reads drop-path rate number `stage` of its own layers'
            mlp_ratio=[2.0, 2.0],
            attention_drop_rate=[0.0, 0.0],
            drop_rate=[0.0, 0.0],
            drop_path_rate=[0.0, 0.0],
            qkv_bias=[True, True],
            cls_token=[False, True],
            qkv_projection_method=["dw_bn", "dw_bn"],
            kernel_qkv=[3, 3],
            padding_kv=[1, 1],
            stride_kv=[2, 2],
            padding_q=[1, 1],
            stride_q=[1, 1],
            num_labels=3,
        ),
        "CvtForImageClassification",
        "pixels",
    ),
    "bit": (
        "BitConfig",
        dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_groups=4, num_labels=3),
        "BitForImageClassification",
        "pixels",
    ),
    "focalnet": (
        "FocalNetConfig",
        dict(
            image_size=16,
            patch_size=2,
            embed_dim=8,
            depths=[1, 1],
            focal_levels=[2, 2],
            focal_windows=[3, 3],
            num_labels=3,
            drop_path_rate=0.0,
        ),
        "FocalNetForImageClassification",
        "pixels",
    ),
    "wavlm": (
        "WavLMConfig",
        AUDIO | dict(num_buckets=8, max_bucket_distance=16),
        "WavLMForSequenceClassification",
        "audio_cls",
    ),
    "sew_d": (
        "SEWDConfig",
        AUDIO | dict(squeeze_factor=2, position_buckets=8, max_position_embeddings=64),
        "SEWDForSequenceClassification",
        "audio_cls",
    ),
    "unispeech": ("UniSpeechConfig", AUDIO, "UniSpeechForSequenceClassification", "audio_cls"),
    "data2vec_audio": ("Data2VecAudioConfig", AUDIO, "Data2VecAudioForSequenceClassification", "audio_cls"),
    "speech2text": (
        "Speech2TextConfig",
        SEQ2SEQ
        | dict(
            input_feat_per_channel=8,
            input_channels=1,
            conv_channels=16,
            num_conv_layers=2,
            conv_kernel_sizes=[5, 5],
            max_source_positions=64,
            max_target_positions=64,
            decoder_start_token_id=1,
            pad_token_id=0,
        ),
        "Speech2TextForConditionalGeneration",
        "frames",
    ),
    "patchtst": (
        "PatchTSTConfig",
        SERIES | dict(num_attention_heads=2, num_hidden_layers=1, ffn_dim=32),
        "PatchTSTForPrediction",
        "series",
    ),
    "patchtsmixer": ("PatchTSMixerConfig", SERIES | dict(num_layers=1), "PatchTSMixerForPrediction", "series"),
    "time_series_transformer": (
        "TimeSeriesTransformerConfig",
        FORECAST,
        "TimeSeriesTransformerForPrediction",
        "forecast",
    ),
    "informer": ("InformerConfig", FORECAST, "InformerForPrediction", "forecast"),
    "autoformer": ("AutoformerConfig", FORECAST | dict(label_length=4), "AutoformerForPrediction", "forecast"),
    "ast": (
        "ASTConfig",
        SIZES
        | dict(
            patch_size=4,
            frequency_stride=4,
            time_stride=4,
            max_length=16,
            num_mel_bins=16,
            num_labels=3,
        ),
        "ASTForAudioClassification",
        "spectrogram",
    ),
    # masked and causal LMs beside those above
    "bert": ("BertConfig", _lm(), "BertForMaskedLM", "tokens"),
    "megatron_bert": ("MegatronBertConfig", _lm(), "MegatronBertForMaskedLM", "tokens"),
    "rembert": (
        "RemBertConfig",
        _lm(input_embedding_size=16, output_embedding_size=16),
        "RemBertForMaskedLM",
        "tokens",
    ),
    "ernie": ("ErnieConfig", _lm(), "ErnieForMaskedLM", "tokens"),
    "roc_bert": ("RoCBertConfig", _lm(), "RoCBertForMaskedLM", "tokens"),
    "modernbert": (
        "ModernBertConfig",
        _lm(global_attn_every_n_layers=2, local_attention=4),
        "ModernBertForMaskedLM",
        "tokens",
    ),
    "mra": ("MraConfig", _lm(), "MraForMaskedLM", "tokens"),
    "yoso": ("YosoConfig", _lm(), "YosoForMaskedLM", "tokens"),
    "xlm": (
        "XLMConfig",
        dict(vocab_size=V, emb_dim=H, n_layers=L, n_heads=NH, max_position_embeddings=64),
        "XLMWithLMHeadModel",
        "tokens",
    ),
    "flaubert": (
        "FlaubertConfig",
        dict(vocab_size=V, emb_dim=H, n_layers=L, n_heads=NH, max_position_embeddings=64, layerdrop=0.0),
        "FlaubertWithLMHeadModel",
        "tokens",
    ),
    "ctrl": (
        "CTRLConfig",
        dict(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, dff=FF, n_positions=64),
        "CTRLLMHeadModel",
        "tokens",
    ),
    "granite": ("GraniteConfig", _lm(num_key_value_heads=2), "GraniteForCausalLM", "tokens"),
    "olmo": ("OlmoConfig", _lm(num_key_value_heads=2), "OlmoForCausalLM", "tokens"),
    "gemma3": (
        "Gemma3TextConfig",
        _lm(num_key_value_heads=2, head_dim=8, sliding_window=4),
        "Gemma3ForCausalLM",
        "tokens",
    ),
    "helium": ("HeliumConfig", _lm(num_key_value_heads=2, head_dim=8), "HeliumForCausalLM", "tokens"),
    "glm": ("GlmConfig", _lm(num_key_value_heads=2, head_dim=8), "GlmForCausalLM", "tokens"),
    "nemotron": ("NemotronConfig", _lm(num_key_value_heads=2, head_dim=8), "NemotronForCausalLM", "tokens"),
    "smollm3": ("SmolLM3Config", _lm(num_key_value_heads=2), "SmolLM3ForCausalLM", "tokens"),
    "cohere2": ("Cohere2Config", _lm(num_key_value_heads=2, sliding_window=4), "Cohere2ForCausalLM", "tokens"),
    "diffllama": ("DiffLlamaConfig", _lm(num_key_value_heads=2), "DiffLlamaForCausalLM", "tokens"),
    "granitemoe": (
        "GraniteMoeConfig",
        _lm(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "GraniteMoeForCausalLM",
        "tokens",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        _lm(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        "Qwen2MoeForCausalLM",
        "tokens",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        _lm(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        "Qwen3MoeForCausalLM",
        "tokens",
    ),
    "olmoe": (
        "OlmoeConfig",
        _lm(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
        "OlmoeForCausalLM",
        "tokens",
    ),
    "glm4": ("Glm4Config", _lm(num_key_value_heads=2, head_dim=8), "Glm4ForCausalLM", "tokens"),
    "olmo3": ("Olmo3Config", _lm(num_key_value_heads=2, sliding_window=4), "Olmo3ForCausalLM", "tokens"),
    "exaone4": ("Exaone4Config", _lm(num_key_value_heads=2, sliding_window=4), "Exaone4ForCausalLM", "tokens"),
    "arcee": ("ArceeConfig", _lm(num_key_value_heads=2), "ArceeForCausalLM", "tokens"),
    "apertus": ("ApertusConfig", _lm(num_key_value_heads=2), "ApertusForCausalLM", "tokens"),
    "seed_oss": ("SeedOssConfig", _lm(num_key_value_heads=2, head_dim=8), "SeedOssForCausalLM", "tokens"),
    "ernie4_5": ("Ernie4_5Config", _lm(num_key_value_heads=2, head_dim=8), "Ernie4_5ForCausalLM", "tokens"),
    "hunyuan_v1_dense": (
        "HunYuanDenseV1Config",
        _lm(num_key_value_heads=2, head_dim=8),
        "HunYuanDenseV1ForCausalLM",
        "tokens",
    ),
    "doge": ("DogeConfig", _lm(num_key_value_heads=2), "DogeForCausalLM", "tokens"),
    "lfm2": ("Lfm2Config", _lm(num_key_value_heads=2, full_attn_idxs=[1]), "Lfm2ForCausalLM", "tokens"),
    "glm4_moe": (
        "Glm4MoeConfig",
        _lm(
            num_key_value_heads=2,
            head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "Glm4MoeForCausalLM",
        "tokens",
    ),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        _lm(num_key_value_heads=2, moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
        "Ernie4_5_MoeForCausalLM",
        "tokens",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        _lm(**MLA),
        "DeepseekV3ForCausalLM",
        "tokens",
    ),
    "jamba": (
        "JambaConfig",
        _lm(
            num_key_value_heads=2,
            num_experts=2,
            num_experts_per_tok=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
        ),
        "JambaForCausalLM",
        "tokens",
    ),
    "bamba": (
        "BambaConfig",
        _lm(
            num_key_value_heads=2,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_chunk_size=4,
        ),
        "BambaForCausalLM",
        "tokens",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        _lm(**LINEAR_ATTENTION, **LINEAR_ATTENTION_EXPERTS, layer_types=["linear_attention", "full_attention"]),
        "Qwen3NextForCausalLM",
        "tokens",
    ),
    "gpt_oss": (
        "GptOssConfig",
        _lm(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=8),
        "GptOssForCausalLM",
        "tokens",
    ),
    "mpt": (
        "MptConfig",
        dict(d_model=H, n_heads=NH, n_layers=L, max_seq_len=64, vocab_size=V, expansion_ratio=2),
        "MptForCausalLM",
        "tokens",
    ),
    "persimmon": ("PersimmonConfig", _lm(), "PersimmonForCausalLM", "tokens"),
    "falcon_h1": (
        "FalconH1Config",
        _lm(
            num_key_value_heads=2,
            head_dim=8,
            mamba_d_state=8,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_n_groups=1,
            mamba_d_ssm=32,
        ),
        "FalconH1ForCausalLM",
        "tokens",
    ),
    "minicpm3": (
        "MiniCPM3Config",
        _lm(
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4
        ),
        "MiniCPM3ForCausalLM",
        "tokens",
    ),
    "vaultgemma": ("VaultGemmaConfig", _lm(num_key_value_heads=2, head_dim=8), "VaultGemmaForCausalLM", "tokens"),
    "bitnet": ("BitNetConfig", _lm(num_key_value_heads=2), "BitNetForCausalLM", "tokens"),
    "hunyuan_moe": (
        "HunYuanMoEV1Config",
        _lm(num_key_value_heads=2, num_experts=4, moe_topk=2, head_dim=8),
        "HunYuanMoEV1ForCausalLM",
        "tokens",
    ),
    "roformer_lm": ("RoFormerConfig", _lm(is_decoder=True), "RoFormerForCausalLM", "tokens"),
    # its experts' token counts are read with .item()/.tolist(): data-dependent shapes, through torch.onnx
    "jetmoe": (
        "JetMoeConfig",
        dict(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_key_value_heads=2,
            kv_channels=8,
            intermediate_size=FF,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        ),
        "JetMoeForCausalLM",
        "tokens",
    ),
    # rotary embeddings as complex numbers (torch.polar), written as pairs of reals (gradient/aten_onnx_complex.py)
    "llama4": (
        "Llama4TextConfig",
        _lm(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size_mlp=FF,
            num_local_experts=4,
            num_experts_per_tok=1,
            attention_chunk_size=8,
        ),
        "Llama4ForCausalLM",
        "tokens",
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        _lm(
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            v_head_dim=8,
            qk_nope_head_dim=4,
            first_k_dense_replace=1,
        ),
        "DeepseekV2ForCausalLM",
        "tokens",
    ),
    # quantisation-aware: a branch on its running activation range (buffers), refused with the line
    "ibert": ("IBertConfig", _lm(), "IBertForMaskedLM", "tokens"),
    "gpt_neox_japanese": (
        "GPTNeoXJapaneseConfig",
        dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_multiple_size=2),
        "GPTNeoXJapaneseForCausalLM",
        "tokens",
    ),
    "mamba2": (
        "Mamba2Config",
        dict(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_heads=8,
            head_dim=8,
            n_groups=1,
            state_size=8,
            chunk_size=4,
        ),
        "Mamba2ForCausalLM",
        "tokens",
    ),
    "falcon_mamba": (
        "FalconMambaConfig",
        dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, state_size=8, time_step_rank=4),
        "FalconMambaForCausalLM",
        "tokens",
    ),
    "rwkv": (
        "RwkvConfig",
        dict(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            attention_hidden_size=H,
            intermediate_size=FF,
            context_length=64,
        ),
        "RwkvForCausalLM",
        "tokens",
    ),
    "lilt": (
        "LiltConfig",
        _lm(hidden_size=36, channel_shrink_ratio=3, num_labels=3),  # six box embeddings of hidden_size / 6
        "LiltForSequenceClassification",
        "classify",
    ),
    "markuplm": ("MarkupLMConfig", _lm(num_labels=3), "MarkupLMForSequenceClassification", "classify"),
    # seq2seq
    "bigbird_pegasus": (
        "BigBirdPegasusConfig",
        SEQ2SEQ | dict(attention_type="original_full"),
        "BigBirdPegasusForConditionalGeneration",
        "tokens",
    ),
    "plbart": ("PLBartConfig", SEQ2SEQ, "PLBartForConditionalGeneration", "tokens"),
    "mvp": ("MvpConfig", SEQ2SEQ, "MvpForConditionalGeneration", "tokens"),
    "fsmt": (
        "FSMTConfig",
        {k: v for k, v in SEQ2SEQ.items() if k != "vocab_size"}
        | dict(langs=["en", "de"], src_vocab_size=V, tgt_vocab_size=V),
        "FSMTForConditionalGeneration",
        "tokens",
    ),
    # vision
    "convnextv2": (
        "ConvNextV2Config",
        dict(
            num_stages=2,
            patch_size=2,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            num_labels=3,
            image_size=16,
            drop_path_rate=0.0,
        ),
        "ConvNextV2ForImageClassification",
        "pixels",
    ),
    "mobilevitv2": (
        "MobileViTV2Config",
        dict(image_size=64, width_multiplier=0.25, num_labels=3),
        "MobileViTV2ForImageClassification",
        "pixels64",
    ),
    "mobilenet_v1": (
        "MobileNetV1Config",
        dict(image_size=32, depth_multiplier=0.25, min_depth=4, num_labels=3),
        "MobileNetV1ForImageClassification",
        "pixels32",
    ),
    "swiftformer": (
        "SwiftFormerConfig",
        dict(image_size=64, depths=[1, 1, 1, 1], embed_dims=[8, 16, 24, 32], num_labels=3, drop_path_rate=0.0),
        "SwiftFormerForImageClassification",
        "pixels64",
    ),
    "levit": (
        "LevitConfig",
        dict(
            image_size=64,
            hidden_sizes=[16, 24, 32],
            num_attention_heads=[1, 2, 2],
            depths=[1, 1, 1],
            key_dim=[8, 8, 8],
            drop_path_rate=0,  # its config takes an int
            num_labels=3,
        ),
        "LevitForImageClassification",
        "pixels64",
    ),
    "hiera": (
        "HieraConfig",
        dict(
            image_size=[64, 64],
            embed_dim=8,
            depths=[1, 1, 1, 1],
            num_heads=[1, 1, 1, 1],
            num_labels=3,
            drop_path_rate=0.0,
        ),
        "HieraForImageClassification",
        "pixels64",
    ),
    "ijepa": ("IJepaConfig", IMAGE, "IJepaForImageClassification", "pixels"),
    "vit_msn": ("ViTMSNConfig", IMAGE, "ViTMSNForImageClassification", "pixels"),
    "data2vec_vision": (
        "Data2VecVisionConfig",
        IMAGE | dict(use_mean_pooling=True, drop_path_rate=0.0),
        "Data2VecVisionForImageClassification",
        "pixels",
    ),
    "siglip": (
        "SiglipConfig",
        dict(
            text_config=dict(
                vocab_size=V,
                hidden_size=H,
                num_hidden_layers=L,
                num_attention_heads=NH,
                intermediate_size=FF,
                max_position_embeddings=16,
            ),
            vision_config={k: v for k, v in IMAGE.items() if k != "num_labels"},
        ),
        "SiglipModel",
        "clip",
    ),
    # speech
    "wav2vec2": ("Wav2Vec2Config", AUDIO, "Wav2Vec2ForSequenceClassification", "audio_cls"),
    # the CTC head checks its labels in Python (`if labels.max() >= vocab_size: raise`): a branch on a value
    "wav2vec2_ctc": ("Wav2Vec2Config", SPEECH | dict(layerdrop=0.0), "Wav2Vec2ForCTC", "audio"),
    "wav2vec2_conformer": (
        "Wav2Vec2ConformerConfig",
        AUDIO | dict(conv_depthwise_kernel_size=3),
        "Wav2Vec2ConformerForSequenceClassification",
        "audio_cls",
    ),
    "sew": ("SEWConfig", AUDIO | dict(squeeze_factor=2), "SEWForSequenceClassification", "audio_cls"),
    # transformers 5.18's newer decoder classes (the expert counts under each config's own names)
    "aria_text": ("AriaTextConfig", _lm(num_key_value_heads=2, head_dim=8), "AriaTextForCausalLM", "tokens"),
    "cohere2_moe": (
        "Cohere2MoeConfig",
        _lm(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, num_shared_experts=1),
        "Cohere2MoeForCausalLM",
        "tokens",
    ),
    "cwm": ("CwmConfig", _lm(num_key_value_heads=2, head_dim=8), "CwmForCausalLM", "tokens"),
    "dots1": (
        "Dots1Config",
        _lm(
            num_key_value_heads=2,
            num_experts_per_tok=2,
            n_routed_experts=4,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=0,
        ),
        "Dots1ForCausalLM",
        "tokens",
    ),
    "flex_olmo": (
        "FlexOlmoConfig",
        _lm(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
        "FlexOlmoForCausalLM",
        "tokens",
    ),
    "granite_swa": ("GraniteSWAConfig", _lm(num_key_value_heads=2), "GraniteSWAForCausalLM", "tokens"),
    "granitemoe_swa": (
        "GraniteMoeSWAConfig",
        _lm(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "GraniteMoeSWAForCausalLM",
        "tokens",
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        _lm(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "GraniteMoeSharedForCausalLM",
        "tokens",
    ),
    "hyperclovax": ("HyperCLOVAXConfig", _lm(num_key_value_heads=2, head_dim=8), "HyperCLOVAXForCausalLM", "tokens"),
    "jais2": ("Jais2Config", _lm(num_key_value_heads=2, head_dim=8), "Jais2ForCausalLM", "tokens"),
    "minimax": (
        "MiniMaxConfig",
        _lm(num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
        "MiniMaxForCausalLM",
        "tokens",
    ),
    "ministral3": ("Ministral3Config", _lm(num_key_value_heads=2, head_dim=8), "Ministral3ForCausalLM", "tokens"),
    "nanochat": ("NanoChatConfig", _lm(num_key_value_heads=2), "NanoChatForCausalLM", "tokens"),
    "olmo_hybrid": ("OlmoHybridConfig", _lm(num_key_value_heads=2), "OlmoHybridForCausalLM", "tokens"),
    "phimoe": (
        "PhimoeConfig",
        _lm(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "PhimoeForCausalLM",
        "tokens",
    ),
    "hrm_text": ("HrmTextConfig", _lm(head_dim=8), "HrmTextForCausalLM", "tokens"),
    "afmoe": (
        "AfmoeConfig",
        _lm(
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
        ),
        "AfmoeForCausalLM",
        "tokens",
    ),
    "exaone_moe": (
        "ExaoneMoeConfig",
        _lm(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
            first_k_dense_replace=0,
        ),
        "ExaoneMoeForCausalLM",
        "tokens",
    ),
    "hy_v3": (
        "HYV3Config",
        _lm(
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
        ),
        "HYV3ForCausalLM",
        "tokens",
    ),
    "laguna": (
        "LagunaConfig",
        _lm(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        "LagunaForCausalLM",
        "tokens",
    ),
    "mellum": (
        "MellumConfig",
        _lm(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        "MellumForCausalLM",
        "tokens",
    ),
    "mimo_v2_flash": (
        "MiMoV2FlashConfig",
        _lm(num_key_value_heads=2, head_dim=8, num_experts_per_tok=2, n_routed_experts=4, moe_intermediate_size=16),
        "MiMoV2FlashForCausalLM",
        "tokens",
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        _lm(num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
        "MiniMaxM2ForCausalLM",
        "tokens",
    ),
    "nemotron_h": (
        "NemotronHConfig",
        _lm(
            num_key_value_heads=2,
            head_dim=8,
            num_experts_per_tok=2,
            n_routed_experts=4,
            moe_intermediate_size=16,
            n_shared_experts=1,
        ),
        "NemotronHForCausalLM",
        "tokens",
    ),
    "solar_open": (
        "SolarOpenConfig",
        _lm(
            num_key_value_heads=2,
            head_dim=8,
            num_experts_per_tok=2,
            n_routed_experts=4,
            moe_intermediate_size=16,
            n_shared_experts=1,
        ),
        "SolarOpenForCausalLM",
        "tokens",
    ),
    "inkling_text": (
        "InklingTextConfig",
        _lm(
            num_key_value_heads=2,
            head_dim=8,
            num_experts_per_tok=2,
            n_routed_experts=4,
            moe_intermediate_size=16,
            n_shared_experts=1,
        ),
        "InklingForCausalLM",
        "tokens",
    ),
    "hy_v4": (
        "HYV4Config",
        _lm(
            num_key_value_heads=2,
            head_dim=8,
            num_experts_per_tok=2,
            n_routed_experts=4,
            moe_intermediate_size=16,
            n_shared_experts=1,
        ),
        "HYV4ForCausalLM",
        "tokens",
    ),
    "zaya": (
        "ZayaConfig",
        _lm(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16),
        "ZayaForCausalLM",
        "tokens",
    ),
    # and encoders, image classifiers and encoder-decoders
    "eurobert": ("EuroBertConfig", _lm(num_key_value_heads=2), "EuroBertForMaskedLM", "tokens"),
    "gte": ("GteConfig", _lm(), "GteForMaskedLM", "tokens"),
    "jina_embeddings_v3": ("JinaEmbeddingsV3Config", _lm(), "JinaEmbeddingsV3ForMaskedLM", "tokens"),
    "nomic_bert": ("NomicBertConfig", _lm(), "NomicBertForMaskedLM", "tokens"),
    "roberta_prelayernorm": ("RobertaPreLayerNormConfig", _lm(), "RobertaPreLayerNormForMaskedLM", "tokens"),
    "tapas": ("TapasConfig", _lm(), "TapasForMaskedLM", "tokens"),
    "xlm_roberta_xl": ("XLMRobertaXLConfig", _lm(), "XLMRobertaXLForMaskedLM", "tokens"),
    "neomme": ("NeoMMEConfig", _lm(num_key_value_heads=2), "NeoMMEForMaskedLM", "tokens"),
    "esmc": ("EsmcConfig", _lm(), "EsmcForMaskedLM", "tokens"),
    "luke": ("LukeConfig", _lm(entity_vocab_size=10, entity_emb_size=8), "LukeForMaskedLM", "tokens"),
    "hgnet_v2": (
        "HGNetV2Config",
        dict(
            embedding_size=8,
            depths=[1, 1],
            hidden_sizes=[16, 32],
            stem_channels=[3, 8, 8],
            stage_in_channels=[8, 16],
            stage_mid_channels=[8, 8],
            stage_out_channels=[16, 32],
            stage_num_blocks=[1, 1],
            stage_downsample=[False, True],
            stage_downsample_strides=[2, 2],
            stage_light_block=[False, True],
            stage_kernel_size=[3, 5],
            stage_numb_of_layers=[2, 2],
            num_labels=3,
        ),
        "HGNetV2ForImageClassification",
        "pixels",
    ),
    "textnet": (
        "TextNetConfig",
        dict(
            stem_out_channels=8,
            image_size=[16, 16],
            conv_layer_kernel_sizes=[[[3, 3], [1, 3]], [[3, 3], [3, 1]]],
            conv_layer_strides=[[1, 2], [2, 1]],
            hidden_sizes=[8, 8, 16],
            depths=[2, 2],
            num_labels=3,
        ),
        "TextNetForImageClassification",
        "pixels",
    ),
    "pvt": (
        "PvtConfig",
        {k: v for k, v in HIERARCHICAL.items() if k != "sr_ratios"}  # PVT (v1) names them otherwise
        | dict(image_size=16, sequence_reduction_ratios=[2, 1], patch_sizes=[4, 2], strides=[4, 2]),
        "PvtForImageClassification",
        "pixels",
    ),
    "donut_swin": ("DonutSwinConfig", SWIN, "DonutSwinForImageClassification", "pixels"),
    "dinov2_with_registers": (
        "Dinov2WithRegistersConfig",
        IMAGE | dict(num_register_tokens=2),
        "Dinov2WithRegistersForImageClassification",
        "pixels",
    ),
    "m2m_100": (
        "M2M100Config",
        SEQ2SEQ | dict(pad_token_id=0, decoder_start_token_id=2, encoder_layerdrop=0.0, decoder_layerdrop=0.0),
        "M2M100ForConditionalGeneration",
        "tokens",
    ),
    "nllb_moe": (
        "NllbMoeConfig",
        SEQ2SEQ
        | dict(
            pad_token_id=0,
            decoder_start_token_id=2,
            num_experts=4,
            expert_capacity=16,
            encoder_sparse_step=2,
            decoder_sparse_step=2,
            router_jitter_noise=0.0,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
        ),
        "NllbMoeForConditionalGeneration",
        "tokens",
    ),
    "pegasus_x": (
        "PegasusXConfig",
        SEQ2SEQ
        | dict(pad_token_id=0, decoder_start_token_id=0, num_global_tokens=4, block_size=4, stagger_local_blocks=True),
        "PegasusXForConditionalGeneration",
        "tokens",
    ),
    "t5gemma": (
        "T5GemmaConfig",
        dict(
            encoder=_lm(num_key_value_heads=2, head_dim=8), decoder=_lm(num_key_value_heads=2, head_dim=8), vocab_size=V
        ),
        "T5GemmaForConditionalGeneration",
        "tokens",
    ),
    # and more hybrids (linear attention, Mamba), multi-head latent attention and MoE decoders
    "deepseek_v32": ("DeepseekV32Config", _lm(**MLA), "DeepseekV32ForCausalLM", "tokens"),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", _lm(**MLA), "Glm4MoeLiteForCausalLM", "tokens"),
    "youtu": ("YoutuConfig", _lm(**MLA), "YoutuForCausalLM", "tokens"),
    "axk1": ("AXK1Config", _lm(**MLA), "AXK1ForCausalLM", "tokens"),
    "qwen3_5_text": ("Qwen3_5TextConfig", _lm(**LINEAR_ATTENTION), "Qwen3_5ForCausalLM", "tokens"),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        _lm(**LINEAR_ATTENTION, **LINEAR_ATTENTION_EXPERTS),
        "Qwen3_5MoeForCausalLM",
        "tokens",
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        _lm(
            num_key_value_heads=4,
            head_dim=8,
            use_cache=False,
            num_experts=4,
            num_experts_per_token=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            linear_head_dim=8,
            linear_num_heads=4,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
        ),
        "KimiLinearForCausalLM",
        "tokens",
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        _lm(
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_chunk_size=4,
            use_cache=False,
        ),
        "GraniteMoeHybridForCausalLM",
        "tokens",
    ),
    "zamba2": (
        "Zamba2Config",
        _lm(
            num_key_value_heads=2,
            layers_block_type=["mamba", "hybrid"],
            mamba_d_state=8,
            mamba_headdim=8,
            n_mamba_heads=8,
            use_cache=False,
        ),
        "Zamba2ForCausalLM",
        "tokens",
    ),
    "lfm2_moe": (
        "Lfm2MoeConfig",
        _lm(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_dense_layers=1,
            layer_types=["conv", "full_attention"],
        ),
        "Lfm2MoeForCausalLM",
        "tokens",
    ),
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        _lm(num_key_value_heads=2, head_dim=8, num_experts=4, moe_topk=2, rope_theta=10000.0),
        "HunYuanMoEV1ForCausalLM",
        "tokens",
    ),
    "ministral": (
        "MinistralConfig",
        _lm(num_key_value_heads=2, head_dim=8, rope_theta=10000.0),
        "MinistralForCausalLM",
        "tokens",
    ),
    # video classifiers: 3-D patch embeddings, attention over space and time
    "videomae": (
        "VideoMAEConfig",
        VIDEO | dict(tubelet_size=2, use_mean_pooling=True),
        "VideoMAEForVideoClassification",
        "video",
    ),
    "vivit": ("VivitConfig", VIDEO | dict(tubelet_size=[2, 4, 4]), "VivitForVideoClassification", "video"),
    "timesformer": ("TimesformerConfig", VIDEO | dict(drop_path_rate=0), "TimesformerForVideoClassification", "video"),
    "openai_gpt": (
        "OpenAIGPTConfig",
        dict(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=64),
        "OpenAIGPTLMHeadModel",
        "tokens",
    ),
    "imagegpt": (
        "ImageGPTConfig",
        dict(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=64),
        "ImageGPTForCausalImageModeling",
        "tokens",
    ),
    "camembert": ("CamembertConfig", _lm(), "CamembertForMaskedLM", "tokens"),
    "data2vec_text": ("Data2VecTextConfig", _lm(), "Data2VecTextForMaskedLM", "tokens"),
    "xmod": ("XmodConfig", _lm(languages=["en_XX"], default_language="en_XX"), "XmodForMaskedLM", "tokens"),
    "bert_generation": ("BertGenerationConfig", _lm(), "BertGenerationDecoder", "tokens"),
    "modernbert_decoder": (
        "ModernBertDecoderConfig",
        _lm(global_attn_every_n_layers=1, local_attention=8),
        "ModernBertDecoderForCausalLM",
        "tokens",
    ),
    "cpmant": (
        "CpmAntConfig",
        dict(
            vocab_size=V,
            hidden_size=H,
            num_attention_heads=NH,
            dim_head=8,
            dim_ff=FF,
            num_hidden_layers=L,
            prompt_length=4,
        ),
        "CpmAntForCausalLM",
        "tokens",
    ),
    "xlstm": (
        "xLSTMConfig",
        dict(vocab_size=V, hidden_size=H, embedding_dim=H, num_hidden_layers=L, num_heads=NH, use_cache=False),
        "xLSTMForCausalLM",
        "tokens",
    ),
    "mistral4": ("Mistral4Config", _lm(**MLA, n_shared_experts=1), "Mistral4ForCausalLM", "tokens"),
    "deepseek_v4": (  # its compressed attentions over MLA-style experts, one shared key/value head
        "DeepseekV4Config",
        _lm(
            **{
                k: v
                for k, v in MLA.items()
                if k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
            },
            q_lora_rank=16,
            num_key_value_heads=1,
            head_dim=8,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        ),
        "DeepseekV4ForCausalLM",
        "tokens",
    ),
    "unispeech_sat": ("UniSpeechSatConfig", SPEECH | dict(layerdrop=0.0), "UniSpeechSatForCTC", "audio"),
}
# Modules that draw random numbers in training mode beyond dropout (PhiMoE's router samples its experts: `sparsemixer`),
# which no step in another generator can match: they run in eval mode, their deterministic top-k.
SAMPLING_IN_TRAINING = {"PhimoeSparseMoeBlock"}
ARGUMENTS = {  # input kind -> the model's keyword arguments for its inputs
    "tokens": ("input_ids", "labels"),
    "tokens_masked": ("input_ids", "labels", "attention_mask"),
    "pixels": ("pixel_values", "labels"),
    "pixels32": ("pixel_values", "labels"),
    "pixels64": ("pixel_values", "labels"),
    "features": ("input_features", "labels"),
    "audio": ("input_values", "labels"),
    "clip": ("input_ids", "pixel_values"),
    "classify": ("input_ids", "labels"),
    "audio_cls": ("input_values", "labels"),
    "frames": ("input_features", "labels"),
    "spectrogram": ("input_values", "labels"),
    "mae": ("pixel_values", "noise"),
    "series": ("past_values", "future_values"),
    "forecast": ("past_values", "past_time_features", "past_observed_mask", "future_values", "future_time_features"),
    "video": ("pixel_values", "labels"),
}


def _batch(kind: str) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, V, (2, 8), generator=g)
    labels = torch.tensor([0, 2])
    return {
        "tokens": lambda: [tokens, torch.randint(2, V, (2, 8), generator=g)],
        "tokens_masked": lambda: [tokens, torch.randint(2, V, (2, 8), generator=g), torch.ones_like(tokens)],
        "pixels": lambda: [torch.randn(2, 3, 16, 16, generator=g), labels],
        "pixels32": lambda: [torch.randn(2, 3, 32, 32, generator=g), labels],
        "pixels64": lambda: [torch.randn(2, 3, 64, 64, generator=g), labels],
        "features": lambda: [torch.randn(2, 8, 32, generator=g), torch.randint(2, V, (2, 6), generator=g)],
        "audio": lambda: [torch.randn(2, 400, generator=g), torch.randint(2, V, (2, 4), generator=g)],
        "clip": lambda: [tokens, torch.randn(2, 3, 16, 16, generator=g)],
        "classify": lambda: [tokens, labels],
        "audio_cls": lambda: [torch.randn(2, 400, generator=g), labels],
        "frames": lambda: [torch.randn(2, 32, 8, generator=g), torch.randint(2, V, (2, 6), generator=g)],
        "spectrogram": lambda: [torch.randn(2, 16, 16, generator=g), labels],
        "mae": lambda: [torch.randn(2, 3, 16, 16, generator=g), torch.rand(2, 16, generator=g)],
        "series": lambda: [torch.randn(2, 32, 2, generator=g), torch.randn(2, 8, 2, generator=g)],
        "forecast": lambda: [  # the past is the context and the largest lag: 10 steps
            torch.randn(2, 10, generator=g),
            torch.randn(2, 10, 2, generator=g),
            torch.ones(2, 10),
            torch.randn(2, 4, generator=g),
            torch.randn(2, 4, 2, generator=g),
        ],
        "video": lambda: [torch.randn(2, 4, 3, 16, 16, generator=g), labels],
    }[kind]()


def worker(name: str, builder: str = "torch") -> dict[str, Any]:
    """One model's step, in this process (see the module docstring)."""
    import torch
    import transformers

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    config_class, arguments, model_class, kind = MODELS[name]
    config = getattr(transformers, config_class)(**arguments)
    names = ARGUMENTS[kind]

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = getattr(transformers, model_class)._from_config(config, attn_implementation="eager")

        def forward(
            self,
            a: torch.Tensor,
            b: torch.Tensor,
            c: torch.Tensor | None = None,
            d: torch.Tensor | None = None,
            e: torch.Tensor | None = None,
        ) -> torch.Tensor:
            extra = {"return_loss": True} if kind == "clip" else {}
            return self.model(**dict(zip(names, (a, b, c, d, e), strict=False)), **extra).loss

    torch.manual_seed(0)
    model = Loss().train()
    for module in model.modules():  # dropout off: the step is compared with eager's
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attribute in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout", "attn_dropout"):
            if isinstance(getattr(module, attribute, None), float):
                setattr(module, attribute, 0.0)
        if type(module).__name__ in SAMPLING_IN_TRAINING:
            module.eval()
    with torch.no_grad():  # a router initialised to zeros (ERNIE 4.5 MoE) ties every expert: top-k's pick is then
        for qualified, param in model.named_parameters():  # the implementation's (ONNX: the lowest index): redrawn
            if qualified.endswith("gate.weight") and param.dim() == 2 and not param.any():
                param.normal_(0.0, 0.02)
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = _batch(kind)
    dims = [[("batch" if d == 0 else size) for d, size in enumerate(t.shape)] for t in data]
    desc = {"inputs": list(zip("abcde", dims, strict=False)), "outputs": [("loss", [], True)]}
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("orttrainer").addHandler(handler)
    logging.getLogger("orttrainer").setLevel(logging.INFO)
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "_internal_use": {"gradient_builder": builder}})
    result: dict[str, Any] = {"model": name}
    try:
        trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=1.0), options=options)
        start = time.perf_counter()
        trainer.train_step(*data)
        result["first_step_s"] = round(time.perf_counter() - start, 2)
        result["builder"] = trainer.gradient_builder
    except Exception as err:  # the outcome being measured: reported, not raised
        text = str(err) if len(str(err)) <= 900 else f"{str(err)[:300]} ... {str(err)[-600:]}"
        return result | {"error": f"{type(err).__name__}: {text}"}
    found = re.search(r"does not cover this graph \((.*)\); using torch.onnx", log.getvalue(), re.DOTALL)
    if trainer.gradient_builder == "ort":
        result["route"] = "TorchScript export"
    else:
        result["route"] = f"torch.onnx: {found.group(1)[:120]}" if found else "direct"
    result["gradients_differ"] = _gradients_differ(reference, data, before, trainer.state_dict(pytorch_format=True))
    log.truncate(0)
    log.seek(0)
    trainer.eval_step(*data)
    result["eval"] = "exported" if "is exported" in log.getvalue() else "traced"
    return result


def _gradients_differ(reference: Any, data: list[Any], before: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """The parameters whose step (lr 1: the gradient) differs from eager's by more than 2e-5 + 1e-3 of eager's
    largest, and from float64 autograd's by more than 4x eager's own difference: a deep network with BatchNorm over
    a batch of 2 (MobileNetV2) is that sensitive to float32 rounding in eager PyTorch too. float64 runs only when
    needed: some models fail in float64 (XGLM fills a float32 tensor with float64's smallest value)."""
    from orttrainer.trainer.gradient.torch_trace import experts_in_static_shapes

    exact = copy.deepcopy(reference).double()
    reference(*data).backward()
    grads = {name: p.grad if p.grad is not None else 0 * p for name, p in reference.named_parameters()}
    steps = {name: before[name] - state[name] for name in grads}
    far = [n for n, g in grads.items() if float((steps[n] - g).abs().max()) > 2e-5 + 1e-3 * float(g.abs().max())]
    if not far:
        return []
    with experts_in_static_shapes(exact):  # transformers' default experts ('grouped_mm') have no float64 kernel
        exact(*(t.double() if t.is_floating_point() else t for t in data)).backward()
    exact_grads = dict(exact.named_parameters())
    differ = []
    for name in far:
        best = exact_grads[name].grad if exact_grads[name].grad is not None else 0 * exact_grads[name]
        off_exact, eager_off_exact = float((steps[name] - best).abs().max()), float((grads[name] - best).abs().max())
        if off_exact > 4 * eager_off_exact:
            differ.append(name)
    return differ


def _in_process(name: str, builder: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, ORTTRAINER_COMPILE_CACHE=cache, HF_HUB_OFFLINE="1")
        command = [sys.executable, __file__, "--worker", name, "--builder", builder]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"model": name, "error": f"exit {done.returncode}: {done.stderr[-300:]}"}


def main() -> None:
    from common import save_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--builder", choices=["torch", "auto", "ort"], default="torch")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.builder)))
        return
    with ThreadPoolExecutor(args.jobs) as pool:  # each model in its own process
        rows = list(pool.map(lambda name: _in_process(name, args.builder), args.models))
    print("| model | trains like PyTorch | builder | training graph | eval graph | first step (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        trains = (
            "error: " + r["error"][:100]
            if "error" in r
            else ("no: " + ", ".join(r["gradients_differ"][:3]) if r["gradients_differ"] else "yes")
        )
        cells = [r["model"], trains, *(r.get(k, "") for k in ("builder", "route", "eval", "first_step_s"))]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    good = [r for r in rows if "error" not in r and not r["gradients_differ"]]
    direct = [r for r in good if r["route"] == "direct" and r["eval"] == "traced"]
    print(
        f"\n{len(good)} of {len(rows)} train like PyTorch; {len(direct)} of them on the direct translation throughout"
    )
    save_json("model_zoo.json" if args.builder == "torch" else f"model_zoo_{args.builder}.json", {"rows": rows})


if __name__ == "__main__":
    main()
