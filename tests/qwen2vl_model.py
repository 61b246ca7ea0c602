"""A tiny random Qwen2-VL for the qwen2vl layout's tests: plait's test placeholder ids (300 image, 301
video), a 512-token vocabulary, two text layers and a two-block vision tower; CPU, float32."""

from __future__ import annotations

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 300, 301


def tiny_qwen2vl():
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=257,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [2, 3, 3]}),
                        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
                        image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=302,
                        vision_end_token_id=303)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(cfg).eval()
