"""What the benchmarks on the tiny verifier share: this checkout's package first on ``sys.path`` (they run as
scripts: what is measured is the code beside them, not whatever is installed), and the verifier's shape options.

A benchmark imports it before the project: ``import _common`` (its own folder is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def tiny_model_parser(
    doc: str, samples: int, hidden_size: int = 256, vocab_size: int = 4096, layers: int = 4
) -> argparse.ArgumentParser:
    """The benchmark's parser (``doc``'s first line describes it) with the tiny verifier's shape and the number
    of fabricated responses per partition."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--samples", type=int, default=samples, help="fabricated responses per partition")
    parser.add_argument("--hidden-size", type=int, default=hidden_size)
    parser.add_argument("--vocab-size", type=int, default=vocab_size)
    parser.add_argument("--layers", type=int, default=layers, help="verifier layers")
    return parser


def tiny_model(args: argparse.Namespace) -> Path:
    """The tiny verifier of the parsed shape, built once per machine (``cached_tiny_model``)."""
    from eagle3_assets.local.tiny_model import cached_tiny_model

    return cached_tiny_model(num_layers=args.layers, hidden_size=args.hidden_size, vocab_size=args.vocab_size)
