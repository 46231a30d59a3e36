#!/usr/bin/env python3
"""Arrow dataset fixture for tests/all/data.rs (`arrow_save_to_disk_loads_the_same_ids`).

Writes, with Hugging Face `datasets` (written with 5.2, pyarrow 26):

  tests/fixtures/arrow_dataset/          DatasetDict.save_to_disk: dataset_dict.json,
      train/data-0000{0,1}-of-00002.arrow, train/dataset_info.json, train/state.json,
      validation/data-00000-of-00001.arrow, validation/dataset_info.json, validation/state.json
  tests/fixtures/arrow_dataset_train.jsonl   the train split's non-empty rows as JSON lines
                                              (input_ids, text), in order: the reference

Columns: `input_ids` (list<int32>; row 3 is null and row 7 an empty list, which yield no
document), `text` (string), `meta` (int64, skipped). Rows are deterministic (no RNG).

Usage: python3 scripts/make_arrow_fixture.py [out_dir]   (default tests/fixtures)
Needs: datasets (pip install datasets).
"""

import json
import os
import sys

import datasets


def rows(n, base):
    ids, text, meta = [], [], []
    for i in range(n):
        r = base + i
        length = 3 + (r * 5) % 17
        ids.append([(r * 31 + k * 7) % 250 + 3 for k in range(length)])
        text.append(f"document {r}: " + " ".join(f"w{(r + k) % 13}" for k in range(length)))
        meta.append(r * 1000)
    return {"input_ids": ids, "text": text, "meta": meta}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "text": datasets.Value("string"),
            "meta": datasets.Value("int64"),
        }
    )
    train = rows(12, 0)
    train["input_ids"][3] = None
    train["input_ids"][7] = []
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(train, features=features),
            "validation": datasets.Dataset.from_dict(rows(3, 100), features=features),
        }
    )
    target = os.path.join(out, "arrow_dataset")
    dd.save_to_disk(target, num_shards={"train": 2, "validation": 1})
    with open(os.path.join(out, "arrow_dataset_train.jsonl"), "w") as f:
        for ids, text in zip(train["input_ids"], train["text"]):
            if ids:
                f.write(json.dumps({"input_ids": ids, "text": text}) + "\n")


if __name__ == "__main__":
    main()
