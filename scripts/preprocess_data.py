#!/usr/bin/env python
"""Turn a text file into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).

One document per line, or one JSON object per line with ``--json-key``. Tokenised with the
download-free ByteLevelTokenizer (UTF-8 bytes, eod = 256 after every document), so a real-data
run needs nothing but this script and megatron-core. Blank documents are skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import numpy as np
from megatron.core.datasets.indexed_dataset import (
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

log = logging.getLogger("preprocess_data")

TOKENIZERS = ("ByteLevelTokenizer",)


def _fail(message: str) -> None:
    """Exit 2 (the usage-error code, as argparse uses) with a message naming the bad value."""
    log.error(message)
    print(f"preprocess_data.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _tokenizer(tokenizer_type: str):
    # Imported lazily so `--help` works without the package on sys.path.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from deadpool_megatron.megatron.data import build_tokenizer

    return build_tokenizer(tokenizer_type, 257)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="Text file, one document per line.")
    parser.add_argument("--output-prefix", required=True, help="Write PREFIX.bin and PREFIX.idx.")
    parser.add_argument("--tokenizer-type", default="ByteLevelTokenizer", choices=TOKENIZERS)
    parser.add_argument(
        "--json-key", default=None, help="Read JSONL and take the document from this key."
    )
    return parser.parse_args(argv)


def _documents(path: str, json_key: str | None):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if json_key is None:
                yield line
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                _fail(f"{path}:{lineno} is not valid JSON ({err.msg}); drop --json-key for text")
            if not isinstance(record, dict) or json_key not in record:
                _fail(f"{path}:{lineno} has no key {json_key!r}; pass the right --json-key")
            yield str(record[json_key])


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if not os.path.isfile(args.input):
        _fail(f"--input {args.input!r} does not exist or is not a file")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    tokenizer = _tokenizer(args.tokenizer_type)
    # uint16 holds every id below 65536, as megatron's DType.optimal_dtype would choose.
    dtype = np.uint16 if tokenizer.vocab_size < 65500 else np.int32
    builder = IndexedDatasetBuilder(get_bin_path(args.output_prefix), dtype=dtype)
    n_docs = n_tokens = n_skipped = 0
    for text in _documents(args.input, args.json_key):
        ids = tokenizer.tokenize(text)
        if not ids:
            n_skipped += 1
            continue
        ids.append(tokenizer.eod)
        builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
        n_docs += 1
        n_tokens += len(ids)
    builder.finalize(get_idx_path(args.output_prefix))
    if n_docs == 0:
        for path in (get_bin_path(args.output_prefix), get_idx_path(args.output_prefix)):
            os.remove(path)
        _fail(f"--input {args.input!r} holds no non-blank document")
    log.info(
        "wrote %s(.bin/.idx): %d documents, %d tokens (incl. eod), %d blank skipped",
        args.output_prefix,
        n_docs,
        n_tokens,
        n_skipped,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
