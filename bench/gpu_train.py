"""Training on one GPU: the checks issue 4 asks for when a GPU is available.

SmolLM2-135M through TuneFleet's real driver and loop on a local Ray cluster with one GPU
worker, four jobs on the same varied-length chat data (``train_throughput.make_data``):

- ``bf16_lora``: LoRA r=16 on every projection, bf16 autocast;
- ``qlora``: the base in 4-bit NF4 (double quantization), bf16 compute, paged 8-bit AdamW;
- ``fsdp_offload``: LoRA under FSDP2 on the one GPU with CPU offload (``zero3_offload``:
  the one sharded mode that changes anything on a single device);
- ``fp8_full``: full fine-tuning with torchao's float8 linear layers (compute capability
  8.9+; torchao must be installed on the machine).

Each job's tokens/s (after a warm-up step), MFU against the GPU's data-sheet peak and peak
memory (``torch.cuda.max_memory_allocated``) come from the loop's own metrics events and go
to ``bench/results/gpu_train.json``; a job that fails is recorded with its error and the
others still run.

    .venv/bin/python bench/gpu_train.py    # on a machine with a CUDA GPU; a few minutes
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput

OUT = train_throughput.ROOT / "bench" / "results" / "gpu_train.json"
JOBS: dict[str, dict[str, Any]] = {
    "bf16_lora": {"precision": "bf16"},
    "qlora": {
        "method": "qlora",
        "precision": "bf16",
        "qlora": {"compute_dtype": "bfloat16"},
        "optimizer": "paged_adamw_8bit",
    },
    "fsdp_offload": {"precision": "bf16", "strategy": "zero3_offload"},
    "fp8_full": {"method": "full", "precision": "fp8"},
}


def main() -> None:
    parser = train_throughput.workload_parser(
        __doc__.splitlines()[0], steps=20, micro_batch=8, accum=1, max_seq_len=1024
    )
    parser.add_argument("--only", nargs="*", choices=list(JOBS), default=list(JOBS))
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_train.py needs a CUDA GPU; this machine has none")
    sys.path.insert(0, str(train_throughput.ROOT / "workers"))
    from tunefleet.platform.models import ModelRegistry
    from tunefleet.platform.settings import get_settings
    from tunefleet.workers.model_registry import prepare_builtin

    model_path = prepare_builtin(ModelRegistry(get_settings().resolved_model_registry))
    data = Path(tempfile.mkdtemp(prefix="tf-gpu-data-")) / "varied.jsonl"
    train_throughput.make_data(
        data, args.examples, max_words=int(args.max_seq_len * 0.6), seed=args.seed
    )
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "steps": args.steps,
        "micro_batch": args.micro_batch,
        "max_seq_len": args.max_seq_len,
        "jobs": {},
    }
    for name in args.only:
        try:
            run = train_throughput.run_tunefleet(model_path, data, args, JOBS[name], gpus=1)
            results["jobs"][name] = {"options": JOBS[name], **run}
        except Exception as exc:  # one failing job must not hide the others' figures
            results["jobs"][name] = {"options": JOBS[name], "error": repr(exc)}
        OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
