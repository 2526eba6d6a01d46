"""The budget held in real training on fresh batches, for every model of
``tests/train/test_training_budget.py`` (the tests run the convnet alone): each is tuned, then
trained for 30 steps on batches made as a DataLoader makes them, every byte counted.

    python benchmarks/fresh_batches.py            # gpt, convnet, vit: ~6 min on 2 cores
    python benchmarks/fresh_batches.py --cases vit
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]

import test_training_budget as checks  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=sorted(checks.CASES))
    args = parser.parse_args()
    failed = 0
    for case in args.cases:
        started = time.perf_counter()
        try:
            checks.test_training_on_fresh_batches_stays_within_the_budget(case)
            status = "ok"
        except AssertionError:
            failed += 1
            status = "FAILED\n" + traceback.format_exc(limit=1)
        print(f"{case}: {status} ({time.perf_counter() - started:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
