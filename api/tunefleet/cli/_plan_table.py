"""``tunefleet plan`` output: the breakdown and the advice as a plain-text table."""

from __future__ import annotations

from typing import Any

ROWS = ("weights", "gradients", "optimizer", "activations", "logits", "total", "cpu_offloaded")


def _gib(n: float) -> str:
    return f"{n / 1024**3:10.3f} GiB"


def render(plan: dict[str, Any]) -> str:
    p, inp = plan["parameters"], plan["input"]
    advice = plan["advice"]
    rank = f" r={inp['lora_r']}" if inp["method"] in ("lora", "qlora") else ""
    lines = [
        f"model {plan['model']}: {p['trainable']:,} trainable of {p['total']:,} parameters "
        f"({p['trainable_percent']}%)",
        f"as the job runs: {inp['method']}{rank} {inp['precision']} "
        f"{inp['strategy']} x{inp['num_workers']}, per-device batch {inp['per_device_batch']}, "
        f"seq {inp['seq_len']}",
        "",
        f"{'per device':<14}{'as the job runs':>16}{'advised':>16}",
    ]
    for row in ROWS:
        lines.append(
            f"{row:<14}{_gib(plan['breakdown'][row]):>16}{_gib(advice['breakdown'][row]):>16}"
        )
    lines += [
        "",
        f"advice: {advice['strategy']}"
        + (" + gradient checkpointing" if advice["gradient_checkpointing"] else "")
        + f", per-device batch {advice['per_device_batch']}, "
        f"{advice['gradient_accumulation_steps']} accumulation step(s)"
        + ("" if advice["fits"] else "  (does NOT fit)"),
    ]
    lines += [f"  - {r}" for r in advice["reasons"]]
    return "\n".join(lines)
