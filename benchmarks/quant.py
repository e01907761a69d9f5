"""Throughput of the int8 kernels against a torch-ops implementation of the same scheme and memcpy.

    python -m benchmarks.quant --json

GB/s are of fp32 input processed (4 bytes per value), 64 MiB buffer, median of several runs.
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.common import median_seconds, parser, report
from p2ptrain import _kernels
from p2ptrain.comm.quant import dequantize_add, empty, quantize


def torch_quantize(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same blockwise uint8 code written with plain torch ops, as hivemind's codecs are."""
    grid = values.view(-1, block)
    lo = grid.amin(dim=1, keepdim=True)
    step = (grid.amax(dim=1, keepdim=True) - lo) / 255
    codes = ((grid - lo) / step.clamp_min(1e-30)).round_().clamp_(0, 255).to(torch.uint8)
    return codes, lo, step


def torch_dequantize_add(
    codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, acc: torch.Tensor
) -> None:
    acc.view(codes.shape).add_(codes.to(torch.float32) * step + lo)


def main() -> None:
    args = parser(__doc__).parse_args()
    n, block, repeats = (64 << 20) // 4, 256, 7
    values = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    acc = np.zeros(n, np.float32)
    copy = np.empty_like(values)
    encoded = empty(n, block)
    quantize(values, block, encoded)
    tensor, tensor_acc = torch.from_numpy(values), torch.from_numpy(acc)
    torch_codes = torch_quantize(tensor, block)
    gigabytes = values.nbytes / 1e9
    result = {
        "buffer_mib": values.nbytes >> 20,
        "threads": _kernels.max_threads(),
        "quant_gbps": gigabytes / median_seconds(lambda: quantize(values, block, encoded), repeats),
        "dequant_gbps": gigabytes / median_seconds(lambda: dequantize_add(encoded, acc), repeats),
        "torch_quant_gbps": gigabytes / median_seconds(lambda: torch_quantize(tensor, block), repeats),
        "torch_dequant_gbps": gigabytes
        / median_seconds(lambda: torch_dequantize_add(*torch_codes, tensor_acc), repeats),
        "memcpy_gbps": gigabytes / median_seconds(lambda: np.copyto(copy, values), repeats),
    }
    result = {key: round(value, 3) if isinstance(value, float) else value for key, value in result.items()}
    result["quant_vs_torch"] = round(result["quant_gbps"] / result["torch_quant_gbps"], 1)
    result["dequant_vs_torch"] = round(result["dequant_gbps"] / result["torch_dequant_gbps"], 1)
    report(result, args.json)


if __name__ == "__main__":
    main()
