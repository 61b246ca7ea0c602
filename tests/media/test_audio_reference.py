"""Audio against its published references: the log-mel features against transformers' WhisperFeatureExtractor
(<= 1e-4 on the same waveform, 80 and 128 bins), the windows' attention masks and token counts against the
Qwen2-Audio and Qwen2.5-Omni processors' own code, the chunked encoder spans against Qwen2.5-Omni's encoder.
Clips are generated speech-like signals at several rates and channel counts in every container."""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("transformers")
from transformers import WhisperFeatureExtractor  # noqa: E402

from plait.media.audio import AudioPolicy, decode, probe  # noqa: E402
from plait.media.audio_features import WINDOW_SAMPLES  # noqa: E402
from plait.media.audio_synth import encode, speech_like  # noqa: E402

TOLERANCE = 1e-4
# every container at several of the rates it takes, in 1, 2 and 6 channels (MP3: at most 2; Opus: 8-48 kHz)
CASES = [("wav", 8000, 1, 80), ("wav", 16000, 6, 128), ("wav", 44100, 2, 128), ("wav", 48000, 2, 80),
         ("flac", 8000, 1, 128), ("flac", 22050, 2, 128), ("flac", 44100, 1, 80), ("flac", 48000, 6, 80),
         ("mp3", 8000, 2, 128), ("mp3", 16000, 1, 80), ("mp3", 22050, 1, 128), ("mp3", 44100, 2, 80),
         ("ogg", 8000, 1, 128), ("ogg", 16000, 1, 80), ("ogg", 48000, 2, 128), ("ogg", 48000, 6, 80),
         ("m4a", 16000, 1, 128), ("m4a", 22050, 2, 80), ("m4a", 44100, 6, 128), ("m4a", 48000, 2, 128)]


def reference(waveforms: list[np.ndarray], bins: int) -> dict:
    """What the Hugging Face Qwen2-Audio processor feeds the model: 30 s padding, attention mask."""
    extractor = WhisperFeatureExtractor(feature_size=bins)
    return extractor(waveforms, sampling_rate=16000, padding="max_length", return_attention_mask=True,
                     return_tensors="np")


@pytest.mark.parametrize("ext,rate,channels,bins", CASES, ids=lambda v: str(v))
def test_features_and_tokens_equal_the_qwen2_audio_processor(ext, rate, channels, bins):
    seconds = 0.7 + 0.13 * CASES.index((ext, rate, channels, bins))  # 0.7 .. 3.2 s: token counts differ
    data = encode(speech_like(rate, seconds, channels, seed=rate + channels), rate, ext)
    info = probe(data)
    planned = AudioPolicy("qwen2audio", mel_bins=bins).plan(info)  # from the headers, as planning counts
    wave = decode(data, info, name=f"clip.{ext}")
    ours = AudioPolicy("qwen2audio", mel_bins=bins).features(wave)
    ref = reference([wave], bins)
    assert ours.input_features.shape == ref["input_features"].shape == (1, bins, 3000)
    assert np.abs(ours.input_features - ref["input_features"]).max() <= TOLERANCE
    np.testing.assert_array_equal(ours.feature_attention_mask, ref["attention_mask"])
    processor = qwen2_audio_processor(bins)
    expanded = processor(text=[f"hello {AUDIO}"], audio=[wave], sampling_rate=16000, return_tensors="np")
    placeholders = int((expanded["input_ids"] == processor.tokenizer.convert_tokens_to_ids(AUDIO)).sum())
    assert planned.tokens == ours.plan.tokens == placeholders
    assert abs(placeholders - 25 * seconds) <= 1


AUDIO = "<|AUDIO|>"


@functools.lru_cache(maxsize=None)
def qwen2_audio_processor(bins: int):
    """The Hugging Face Qwen2-Audio processor as users call it, over a word-level tokenizer that knows its
    special tokens (a real checkpoint's vocabulary changes nothing in how placeholders are counted)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2AudioProcessor

    special = [AUDIO, "<|audio_bos|>", "<|audio_eos|>", "<unk>"]
    words = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*special, "hello"])}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<unk>",
                                        additional_special_tokens=special[:3])
    return Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=bins), tokenizer=tokenizer,
                               chat_template="")


def test_windows_masks_and_tokens_equal_the_qwen2_audio_processor():
    wave = np.tile(speech_like(16000, 1.0, 1, seed=9)[0], 64)[: 63 * 16000 + 77]  # 63 s: 30 + 30 + 3 s
    ours = AudioPolicy("qwen2audio", mel_bins=128).features(wave)
    windows = [wave[i:i + WINDOW_SAMPLES] for i in range(0, len(wave), WINDOW_SAMPLES)]
    processor = qwen2_audio_processor(128)
    ref = processor(text=[f"hello {AUDIO}"] * len(windows), audio=windows, sampling_rate=16000,
                    return_tensors="np", padding=True)
    placeholders = (ref["input_ids"] == processor.tokenizer.convert_tokens_to_ids(AUDIO)).sum(axis=1)
    assert list(ours.plan.window_tokens) == placeholders.tolist() == [750, 750, 75]
    np.testing.assert_array_equal(ours.feature_attention_mask, ref["feature_attention_mask"])
    assert np.abs(ours.input_features - ref["input_features"]).max() <= TOLERANCE


def omni_audio_processor(bins: int):
    """Qwen2.5-Omni's processor with its audio part only: its constructor wants image and video processors
    (the video one needs torchvision), which counting audio placeholders never touches."""
    from transformers import Qwen2_5OmniProcessor

    class OmniAudio(Qwen2_5OmniProcessor):
        def __init__(self):  # not the processor's: its audio methods read only these two attributes
            self.feature_extractor = WhisperFeatureExtractor(feature_size=bins)
            self.audio_token = AUDIO

        def tokens_for(self, samples: int) -> int:
            return int(self._get_num_audio_tokens(samples))

        def audio_inputs(self, waves: list[np.ndarray]) -> dict:
            inputs, _ = self._process_audio(waves, sampling_rate=16000, return_attention_mask=True)
            return inputs

    return OmniAudio()


@pytest.mark.parametrize("seconds", [0.04, 1.0, 2.0, 7.31, 29.99, 30.0])
def test_chunked_tokens_equal_the_qwen2_5_omni_processor(seconds):
    samples = round(seconds * 16000)
    assert AudioPolicy("chunked").plan(samples).tokens == omni_audio_processor(128).tokens_for(samples)


def test_chunked_mask_equals_the_qwen2_5_omni_processor():
    wave = speech_like(16000, 4.53, 1, seed=4)[0]
    ref = omni_audio_processor(128).audio_inputs([wave])
    ours = AudioPolicy("chunked").features(wave)
    np.testing.assert_array_equal(ours.feature_attention_mask, ref["feature_attention_mask"])
    assert list(ours.plan.window_tokens) == list(ref["num_audio_tokens"])
    assert np.abs(ours.input_features - ref["input_features"]).max() <= TOLERANCE


@pytest.mark.slow  # imports the whole Qwen2.5-Omni model code (torch.nn and its kernels)
def test_chunked_spans_equal_the_qwen2_5_omni_encoder():
    import torch
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import chunk_and_pad_features, get_audio_cu_seqlens

    lengths = [16000 * 5, 16000 * 2, 31 * 16000 + 5, 160 * 7 + 3]
    plans = [AudioPolicy("chunked", chunk_seconds=2.0).plan(n) for n in lengths]
    frames = torch.tensor([f for plan in plans for f in plan.frames])
    _, chunk_lengths = chunk_and_pad_features(torch.zeros(128, int(frames.sum())), frames, n_window=100)
    spans = torch.diff(get_audio_cu_seqlens(chunk_lengths)).tolist()
    assert spans == [s for plan in plans for s in plan.spans]
