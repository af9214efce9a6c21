"""A `--draft-vocab` id list: the N most frequent ids when the draft's tokenizer reads a corpus of
Python files, plus every byte, special and added token (so any text can still be spelled).

    python -m benchmarks.draft_vocab_ids --top 32000 --out /tmp/vocab-top32k.json

The default corpus is every third `.py` file under Python's library directory (site-packages
included): the list docs/performance.md measures.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections import Counter
from pathlib import Path

from specdec.builder import load_tokenizer
from specdec.models.sources import resolve_model
from specdec.models.vocab import special_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="default")
    parser.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="a directory of .py files")
    parser.add_argument("--every", type=int, default=3, help="read every n-th file (sorted by path)")
    parser.add_argument("--top", type=int, default=32000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    tokenizer = load_tokenizer(resolve_model(args.draft, role="draft"))
    files = sorted(Path(args.corpus).rglob("*.py"))[::args.every]
    texts = [f.read_text(encoding="utf-8", errors="ignore") for f in files]
    counts = Counter(i for ids in tokenizer(texts)["input_ids"] for i in ids)
    top = [i for i, _ in counts.most_common(args.top)]
    ids = sorted(set(top) | set(range(256)) | special_token_ids(tokenizer))
    Path(args.out).write_text(json.dumps(ids))
    total = sum(counts.values())
    print(f"{len(files)} files, {total} tokens, {len(counts)} distinct; the top {len(top)} cover "
          f"{sum(counts[i] for i in top) / total:.2%}; {len(ids)} ids written to {args.out}")


if __name__ == "__main__":
    main()
