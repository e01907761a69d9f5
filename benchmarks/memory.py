"""The memory estimate against the measured peak of real inner steps, and what the chunked loss saves.

    python -m benchmarks.memory --json [--cases debug:8,20m:8,150m:2] [--set KEY=VALUE ...]

Each case CONFIG:MICRO_BATCH runs in a fresh process: a Trainer of that config (one rank,
batch_size = the micro-batch, so one pass per inner step) takes an inner step, an outer step and a
checkpoint (which allocate the DiLoCo vectors and the snapshot buffers a node holds from then on),
then `--steps` − 1 more inner steps (AdamW's moments exist from the first: the peak). Measured: the
process's peak RSS (VmHWM) on CPU, max_memory_allocated on a GPU. Reported per case: the estimate,
the measured peak, their ratio (target: within 25 %) and the first inner step's seconds.
20m at micro-batch 8 runs twice, with the loss in chunks and in one piece (`train.loss_chunk=0`):
`logits_saved_gib` is what chunking saves in peak memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import report, unwind_on_sigterm

DEFAULT_CASES = "debug:8,20m:8,20m:8:unchunked,150m:2"


def measure(
    config_name: str, micro_batch: int, chunked: bool, steps: int, settings: list[str]
) -> dict[str, Any]:
    """One inner-step run in this process (the child side)."""
    import torch

    from p2ptrain.config import load_config
    from p2ptrain.memory_limits import peak_rss
    from p2ptrain.train.trainer import RankContext, Trainer

    overrides = [
        f"train.batch_size={micro_batch}",
        f"train.micro_batch={micro_batch}",
        *([] if chunked else ["train.loss_chunk=0"]),
        'checkpoint.staging=""',
        *settings,
    ]
    config = load_config(config_name, overrides=overrides)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    with tempfile.TemporaryDirectory() as work:
        trainer = Trainer(config, node_key=b"m" * 32, work_dir=Path(work), ctx=RankContext(device=device))
        started = time.monotonic()
        trainer.inner_step_once()
        seconds = time.monotonic() - started
        # everything a node holds from its first outer step and checkpoint on, then more steps
        trainer.outer_step_once(trainer.tokens_per_step)
        trainer.save_checkpoint(background=False)
        for _ in range(steps - 1):
            trainer.inner_step_once()
    found = trainer.memory  # the rank's own estimate at this micro-batch
    measured = int(torch.cuda.max_memory_allocated()) if on_gpu else (peak_rss("self") or 0)
    predicted = found.device
    return {
        "case": f"{config_name}:{micro_batch}{'' if chunked else ':unchunked'}",
        "estimate_gib": round(predicted / (1 << 30), 3),
        "measured_gib": round(measured / (1 << 30), 3),
        "ratio": round(predicted / measured, 3) if measured else None,
        "activations_gib": round(found.activations / (1 << 30), 3),
        "logits_gib": round(found.logits / (1 << 30), 3),
        "step_s": round(seconds, 2),
        "device": device.type,
    }


def run_case(case: str, steps: int, settings: list[str]) -> dict[str, Any]:
    """Run one case in a fresh interpreter, so each peak is its own."""
    name, _, rest = case.partition(":")
    micro, _, flag = rest.partition(":")
    command = [
        sys.executable,
        "-m",
        "benchmarks.memory",
        "--child",
        f"{name}:{micro}:{flag}",
        "--steps",
        str(steps),
    ]
    for item in settings:
        command += ["--set", item]
    print(f"memory: {case} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"memory: case {case} failed: {done.stderr.strip().splitlines()[-1:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--json", action="store_true", help="print only the JSON result line")
    args.add_argument("--cases", default=DEFAULT_CASES, help="CONFIG:MICRO_BATCH[:unchunked],…")
    args.add_argument("--steps", type=int, default=3, help="inner steps per case (at least 2)")
    args.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args.add_argument("--child", default="", help=argparse.SUPPRESS)
    options = args.parse_args()
    unwind_on_sigterm()
    if options.child:
        name, micro, flag = options.child.split(":")
        row = measure(name, int(micro), flag != "unchunked", max(2, options.steps), options.set)
        print(json.dumps(row))
        return
    rows = [run_case(case, options.steps, options.set) for case in options.cases.split(",") if case]
    result: dict[str, Any] = {"rows": rows}
    ratios = [row["ratio"] for row in rows if row["ratio"]]
    result["worst_ratio"] = max(ratios, key=lambda ratio: abs(ratio - 1)) if ratios else None
    by_case = {row["case"]: row for row in rows}
    if "20m:8" in by_case and "20m:8:unchunked" in by_case:
        result["logits_saved_gib"] = round(
            by_case["20m:8:unchunked"]["measured_gib"] - by_case["20m:8"]["measured_gib"], 3
        )
    if not options.json:
        for row in rows:
            print(json.dumps(row))
    report({key: value for key, value in result.items() if key != "rows"} | {"rows": rows}, True)


if __name__ == "__main__":
    main()
