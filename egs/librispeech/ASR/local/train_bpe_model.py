#!/usr/bin/env python3
"""Stage 4: sentencepiece unigram model on the training transcripts.

    ./local/train_bpe_model.py --lang-dir data/lang_bpe_500 --vocab-size 500 \
        --supervisions data/manifests/librispeech_supervisions_train-clean-100.jsonl.gz

Writes LANG_DIR/transcript_words.txt, bpe.model and tokens.txt with
<blk>=0, <sos/eos>=1, <unk>=2. Fails clearly when the transcripts are too
small for --vocab-size, naming the largest size that works.
"""

import argparse
import logging
import sys
from pathlib import Path

from icefall_lite.data.bpe import VocabSizeError, supervision_texts, train_bpe_model, write_transcript_words
from icefall_lite.utils import parse_script_args, script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--lang-dir", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=500)
    parser.add_argument("--supervisions", type=Path, nargs="+", required=True, help="training supervision manifests")
    return parser


def main() -> int:
    args = parse_script_args(get_parser())
    transcript = args.lang_dir / "transcript_words.txt"
    texts = [t for path in args.supervisions for t in supervision_texts(path)]
    n = write_transcript_words(texts, transcript)
    logging.info(f"wrote {n} training transcripts to {transcript}")
    try:
        train_bpe_model(transcript, args.lang_dir, args.vocab_size)
    except VocabSizeError as e:
        logging.error(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
