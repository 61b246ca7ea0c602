"""Features must not depend on how many threads BLAS runs: a Ray worker has one, a trainer several, and the
same clip must give the same bits (the local = Ray digest)."""

import os
import subprocess
import sys

import pytest

CODE = """
import hashlib
from plait.media.audio import AudioPolicy
from plait.media.audio_synth import speech_like
h = hashlib.sha256()
for bins in (80, 128):
    policy = AudioPolicy("qwen2audio", mel_bins=bins)
    for seed in range(3):
        h.update(policy.features(speech_like(16000, 1.0 + 7.3 * seed, 1, seed=seed)[0]).input_features.tobytes())
print(h.hexdigest())
"""


@pytest.mark.subprocess
def test_features_are_the_same_bits_on_one_blas_thread_and_on_two():
    digests = set()
    for threads in ("1", "2"):
        env = {"OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        out = subprocess.run([sys.executable, "-c", CODE], env={**os.environ, **env},
                             capture_output=True, text=True, timeout=120, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1
