"""A whole tuning run of a deep model on a shared study: every name and key it writes
fits the database (PostgreSQL's key column holds 512 characters; autotune's keys are
short hashes whatever the config), and how long the run takes there.

The tests check the keys of a 64-block config against a real server directly
(``tests/jobs/test_shared_studies.py -k 64_block``); this runs the tuning that writes
them, 5 minutes on a 2-core VM.

    python benchmarks/shared_study.py --storage postgresql+psycopg://postgres@127.0.0.1:55432/postgres
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna
import torch

import autotune
from autotune.jobs._study_store import resolve_storage
from autotune.models import gpt_batch, tiny_gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", required=True, help="an Optuna storage URL or file")
    parser.add_argument("--layers", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = tiny_gpt(n_layer=args.layers, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    name = f"deep-{int(time.time())}"
    start = time.perf_counter()
    result = autotune.autotune(
        model, gpt_batch(model.config, 4), 48 / 1024, device="cpu", global_batch_size=16,
        storage=args.storage, study_name=name, n_trials=20,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    resolved = resolve_storage(args.storage)
    longest = 0
    for study_name in optuna.get_all_study_names(resolved):
        if study_name.startswith(name):
            study = optuna.load_study(study_name=study_name, storage=resolved)
            longest = max([longest, len(study_name), *map(len, study.user_attrs)])
    print(json.dumps({
        "layers": args.layers, "winner": result.config.describe(), "seconds": round(seconds, 1),
        "longest_key": longest, "fits": longest < 100,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
