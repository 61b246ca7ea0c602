"""`plait demo`: generate the embedded sample dataset once and stream it."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from plait.cli.common import console, positive_int
from plait.cli.demo_data import default_cache_dir, generate
from plait.cli.stream import print_summary, stream
from plait.spec import load_spec

HELP = "generate the embedded sample dataset (once) and stream it for 8 DP ranks"
DESCRIPTION = (
    "Generate a small 5-source dataset (4 text sources and an image-text source) in a cache folder "
    "(once), stream it for a simulated job of 8 data-parallel ranks and print throughput (tokens/s, "
    "images/s), the encoder's share of the cost, mixture and balance. Its demo-text.yaml is the four "
    "text sources alone."
)


def add_arguments(p) -> None:
    p.add_argument("--steps", type=positive_int, default=None, help="global steps to stream (default: the demo spec's 50)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    p.add_argument("--cache", metavar="DIR", help="where the sample dataset lives (default: ~/.cache/plait/demo-v2, or $PLAIT_CACHE/demo-v2)")
    p.add_argument("--plot", metavar="PATH", help="draw per-step mixture and balance to a PNG (needs matplotlib)")
    p.add_argument("--runtime", choices=["local", "ray"], default="local", help="where the roles run")
    p.add_argument("--video", action="store_true", help="also stream 12 short generated videos (demo-video.yaml; "
                   "needs plait[video]); the default demo and its digest are unchanged")
    p.add_argument("--audio", action="store_true", help="also stream 48 generated speech-like clips (WAV, FLAC, MP3, "
                   "Ogg/Opus, M4A at 8-48 kHz; demo-audio.yaml; needs PyAV); the default demo and its digest are "
                   "unchanged")


def run(args) -> int:
    cache = Path(args.cache) if args.cache else default_cache_dir()
    existed = (cache / "demo.yaml").exists() and (cache / "demo-text.yaml").exists()
    with console.status("generating the demo dataset (once)…", spinner="dots"):
        spec_path = generate(cache, images=True)
        if args.video:
            from plait.cli.demo_data import IMAGE_TOKEN_ID
            from plait.cli.video_data import demo_video_spec

            spec_path = demo_video_spec(cache, IMAGE_TOKEN_ID)
        if args.audio:
            from plait.cli.audio_data import demo_audio_spec
            from plait.cli.demo_data import AUDIO_TOKEN_ID

            spec_path = demo_audio_spec(spec_path, AUDIO_TOKEN_ID)
    console.print(f"dataset: {cache} ({'cached' if existed else 'generated'}); spec: {spec_path}")
    spec = load_spec(spec_path)
    summary = stream(spec, steps=args.steps or spec.steps or 50, runtime=args.runtime, progress=True,
                     outputs={"plot": args.plot})
    print_summary(spec, summary, console=Console())
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        console.print(f"summary written to {args.json}")
    return 0
