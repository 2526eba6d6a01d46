"""Traced (fake-tensor) memory profiles against real ones, model by model (issue 27).

For each model: the memory profile the tuner records (fp32 and bf16, AdamW, every block
kept, checkpointed and checkpointed selectively, at micro-batches 2 and 4) measured for
real on the CPU, and the same profile traced on fake tensors from the same builder; every
byte figure of the two compared. Time figures are left out (a traced step has none).

    python benchmarks/traced.py --out benchmarks/results/traced-cpu.json            # the zoo
    python benchmarks/traced.py --large --out benchmarks/results/traced-large-cpu.json

``--large`` adds Hugging Face LLaMA and GPT-2 models of 300M+ parameters (minutes each).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the repository root and the tests' zoo
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "tests"), str(root / "tests" / "models")]

from torchvision_ops import declare_torchvision_ops

from autotune._blocks import find_blocks
from autotune._profile_data import profile_to_json
from autotune.config import Timeline
from autotune.measure._fake import traced
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler

declare_torchvision_ops()  # transformers imports torchvision: see tests/torchvision_ops.py

Built = tuple[torch.nn.Module, Any, Any]


def memory_of(built: Built, precisions: tuple[str, ...]) -> dict[str, Any]:
    """The memory profile of a built ``(model, batch, loss)``, as JSON without times."""
    model, batch, loss_fn = built
    blocks = tuple(find_blocks(model))
    profiler = Profiler(model, batch, blocks, device=torch.device("cpu"), loss_fn=loss_fn)
    profile, _ = memory_profile(
        profiler,
        tuple(Timeline(p) for p in precisions),
        ("adamw",),
        device_name="cpu",
        context_bytes=0,
        selective=True,
    )
    return _bytes_only(json.loads(profile_to_json(profile)))


def _bytes_only(value: Any) -> Any:
    """``value`` without its time figures (``*_s``, ``seconds``, ``time``)."""
    if isinstance(value, dict):
        return {
            k: _bytes_only(v)
            for k, v in value.items()
            if not (k.endswith("_s") or k in ("seconds", "time"))
        }
    if isinstance(value, list):
        return [_bytes_only(v) for v in value]
    return value


def differences(real: Any, fake: Any, path: str = "") -> list[str]:
    """Where two profiles (as JSON) differ, each as ``path: real != fake``."""
    if isinstance(real, dict) and isinstance(fake, dict):
        keys = sorted(set(real) | set(fake))
        return [d for k in keys for d in differences(real.get(k), fake.get(k), f"{path}.{k}")]
    if isinstance(real, list) and isinstance(fake, list) and len(real) == len(fake):
        return [
            d
            for i, (a, b) in enumerate(zip(real, fake, strict=True))
            for d in differences(a, b, f"{path}[{i}]")
        ]
    return [] if real == fake else [f"{path}: {str(real)[:80]} != {str(fake)[:80]}"]


def compare(name: str, build: Callable[[], Built], precisions: tuple[str, ...]) -> dict[str, Any]:
    """One model: real and traced profiles, their differences and how long each took."""
    row: dict[str, Any] = {"model": name}
    try:
        t0 = time.perf_counter()
        built = build()
        row["parameters"] = sum(p.numel() for p in built[0].parameters())
        real = memory_of(built, precisions)
        del built
        t1 = time.perf_counter()
        with traced():
            fake = memory_of(build(), precisions)
        t2 = time.perf_counter()
    except Exception as exc:  # a model a profile cannot be taken of: reported, not fatal
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        return row
    found = differences(real, fake)
    row.update(real_s=t1 - t0, traced_s=t2 - t1, differences=len(found), first=found[:3])
    return row


def _zoo() -> list[tuple[str, Callable[[], Built]]]:
    from zoo import CASES

    return [(c.name, c.build) for c in CASES if not c.missing()]


def _large() -> list[tuple[str, Callable[[], Built]]]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def llama() -> Built:
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
            num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
        )  # fmt: skip
        ids = torch.randint(0, 32000, (4, 128))
        return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids.clone()}, None

    def gpt2_medium() -> Built:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=128)
        ids = torch.randint(0, 50257, (4, 128))
        return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids.clone()}, None

    return [("llama-24x1024 (seq 128)", llama), ("gpt2-medium (seq 128)", gpt2_medium)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="300M+ models only")
    parser.add_argument("--only", nargs="*", help="only these zoo cases")
    parser.add_argument("--out", type=Path, default=Path("results-traced.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    models = _large() if args.large else _zoo()
    if args.only:
        models = [(n, b) for n, b in models if n in args.only]
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "rows": [],
    }
    for name, build in models:
        row = compare(name, build, ("fp32", "bf16"))
        report["rows"].append(row)
        args.out.write_text(json.dumps(report, indent=1))
        print(json.dumps(row), flush=True)
    rows = report["rows"]
    exact = sum(1 for r in rows if r.get("differences") == 0)
    print(f"byte-exact: {exact} of {len(rows)}; errors: {sum('error' in r for r in rows)}")


if __name__ == "__main__":
    main()
