"""Throughput of the int8 (or int4) kernels against a torch-ops implementation of the same scheme and memcpy.

    python -m benchmarks.quant --json [--bits 4 | --codec sparse]

GB/s are of fp32 input processed (4 bytes per value), 64 MiB buffer, median of several runs. With
`--bits 4` also the fused ring hop, and why the 4-bit code is int4 with (min, step) per block: the
relative L2 error of int4, FP4 E2M1 and FP4 E3M0 (one absmax scale per block, nearest level) at
blocks of 256, on Gaussian values and on a real pseudo-gradient (the `debug` model after 10 AdamW
steps).

With `--codec sparse`, the sparse codec's kernels (codec/sparse.py, chunks of 4096, top 64): top-k
selection and packing (`topk_pack`), the check of a received payload, and decode-accumulate, in
GB/s of the fp32 vector they stand for, against memcpy and against torch.topk over the same chunks
(the selection alone, as torch-based top-k codecs do it).
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.common import median_seconds, parser, report
from p2ptrain import _kernels
from p2ptrain.comm.codec.quant import (
    add_encode_payload,
    decode_payload,
    dequantize,
    dequantize_add,
    empty,
    encode_payload,
    quantize,
)
from p2ptrain.comm.codec.sparse import SparseCode, squared_norm
from p2ptrain.comm.codec.sparse import decode_add as sparse_decode_add
from p2ptrain.comm.codec.sparse import encode as sparse_encode

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
E3M0 = np.array([0] + [2.0**k for k in range(-6, 1)], np.float32)
"""The magnitudes of two FP4 formats: E2M1 (OCP MX), and E3M0 (Streaming DiLoCo's)."""


def torch_quantize(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same blockwise uint8 code written with plain torch ops, as hivemind's codecs are."""
    grid = values.view(-1, block)
    lo = grid.amin(dim=1, keepdim=True)
    step = (grid.amax(dim=1, keepdim=True) - lo) / 255
    codes = ((grid - lo) / step.clamp_min(1e-30)).round_().clamp_(0, 255).to(torch.uint8)
    return codes, lo, step


def torch_dequantize_add(
    codes: torch.Tensor, lo: torch.Tensor, *, step: torch.Tensor, acc: torch.Tensor
) -> None:
    acc.view(codes.shape).add_(codes.to(torch.float32) * step + lo)


def fp4(values: np.ndarray, block: int, levels: np.ndarray) -> np.ndarray:
    """Encode and decode with one absmax scale per block and the nearest of `levels` (± each)."""
    grid = values.reshape(-1, block)
    scale = np.abs(grid).max(axis=1, keepdims=True) / levels[-1]
    scale = np.where(scale > 0, scale, 1)
    nearest = np.abs(np.abs(grid)[..., None] / scale[..., None] - levels).argmin(axis=-1)
    return (np.sign(grid) * levels[nearest] * scale).reshape(-1)


def relative_error(values: np.ndarray, decoded: np.ndarray) -> float:
    return round(float(np.linalg.norm(decoded - values) / np.linalg.norm(values)), 4)


def real_pseudo_gradient() -> np.ndarray:
    """Outer minus inner params of the `debug` model after one inner phase of 10 AdamW steps."""
    import tempfile
    from pathlib import Path

    from p2ptrain.config import load_config
    from p2ptrain.train.trainer import RankContext, Trainer

    overrides = ["train.max_steps=10", "checkpoint.interval=0", 'checkpoint.staging=""']
    config = load_config("debug", overrides=overrides)
    with tempfile.TemporaryDirectory() as work:
        trainer = Trainer(config, node_key=b"\1" * 32, work_dir=Path(work), ctx=RankContext())
        tokens, _ = trainer.inner_phase()
        trainer.prepare_outer(tokens)
        assert trainer.leader is not None
        vector = trainer.leader.buffer.numpy().copy()
    return vector[: vector.size // 256 * 256]


def format_errors(block: int) -> dict[str, float]:
    vectors = {
        "gaussian": np.random.default_rng(1).standard_normal(1 << 20).astype(np.float32),
        "pseudo_gradient": real_pseudo_gradient(),
    }
    errors = {}
    for name, values in vectors.items():
        errors[f"int4_error_{name}"] = relative_error(values, dequantize(quantize(values, block, bits=4)))
        errors[f"e2m1_error_{name}"] = relative_error(values, fp4(values, block, E2M1))
        errors[f"e3m0_error_{name}"] = relative_error(values, fp4(values, block, E3M0))
    return errors


def four_bits(values: np.ndarray, block: int, repeats: int) -> dict[str, float]:
    n = values.size
    gigabytes = values.nbytes / 1e9
    acc, copy = np.zeros(n, np.float32), np.empty_like(values)
    encoded = quantize(values, block, bits=4)
    received = decode_payload(encode_payload(values, block, bits=4), n, block=block, bits=4)
    hop_out = memoryview(bytearray(len(encode_payload(values, block, bits=4))))
    return {
        "quant_gbps": gigabytes / median_seconds(lambda: quantize(values, block, out=encoded), repeats),
        "dequant_gbps": gigabytes / median_seconds(lambda: dequantize_add(encoded, acc), repeats),
        "fused_hop_gbps": gigabytes
        / median_seconds(lambda: add_encode_payload(values, 0.5, received=received, out=hop_out), repeats),
        "memcpy_gbps": gigabytes / median_seconds(lambda: np.copyto(copy, values), repeats),
    }


def sparse_codes(values: np.ndarray, repeats: int) -> dict[str, float]:
    code = SparseCode()
    n, gigabytes = values.size, values.nbytes / 1e9
    acc, copy = np.zeros(n, np.float32), np.empty_like(values)
    payload = sparse_encode(values, code)
    chunks = torch.from_numpy(values[: n // code.chunk * code.chunk]).view(-1, code.chunk)
    return {
        "topk_pack_gbps": gigabytes / median_seconds(lambda: sparse_encode(values, code), repeats),
        "check_gbps": gigabytes / median_seconds(lambda: squared_norm(payload, n, code), repeats),
        "decode_add_gbps": gigabytes
        / median_seconds(lambda: sparse_decode_add(payload, acc, code, weight=0.5), repeats),
        "torch_topk_gbps": gigabytes / median_seconds(lambda: chunks.abs().topk(code.k, dim=1), repeats),
        "memcpy_gbps": gigabytes / median_seconds(lambda: np.copyto(copy, values), repeats),
        "bits_per_value": code.bits_per_value(n),
    }


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--bits", type=int, choices=[8, 4], default=8, help="code width (default %(default)s)")
    cli.add_argument("--codec", choices=["dense", "sparse"], default="dense", help="comm.codec's kernels")
    args = cli.parse_args()
    n, block, repeats = (64 << 20) // 4, 256, 7
    if args.codec == "sparse":
        values = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        speeds = {key: round(value, 3) for key, value in sparse_codes(values, repeats).items()}
        summary: dict[str, object] = {
            "codec": "sparse",
            "buffer_mib": values.nbytes >> 20,
            "threads": _kernels.max_threads(),
            **speeds,
        }
        for kernel in ("topk_pack", "check", "decode_add", "torch_topk"):
            summary[f"{kernel}_vs_memcpy"] = round(speeds[f"{kernel}_gbps"] / speeds["memcpy_gbps"], 2)
        report(summary, args.json)
        return
    if args.bits == 4:
        values = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        speeds = {key: round(value, 3) for key, value in four_bits(values, block, repeats).items()}
        result = {"bits": 4, "buffer_mib": values.nbytes >> 20, "threads": _kernels.max_threads(), **speeds}
        for kernel in ("quant", "dequant", "fused_hop"):
            result[f"{kernel}_vs_memcpy"] = round(speeds[f"{kernel}_gbps"] / speeds["memcpy_gbps"], 2)
        report({**result, **format_errors(block)}, args.json)
        return
    values = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    acc = np.zeros(n, np.float32)
    copy = np.empty_like(values)
    encoded = empty(n, block)
    quantize(values, block, out=encoded)
    tensor, tensor_acc = torch.from_numpy(values), torch.from_numpy(acc)
    torch_codes = torch_quantize(tensor, block)
    gigabytes = values.nbytes / 1e9
    result = {
        "buffer_mib": values.nbytes >> 20,
        "threads": _kernels.max_threads(),
        "quant_gbps": gigabytes / median_seconds(lambda: quantize(values, block, out=encoded), repeats),
        "dequant_gbps": gigabytes / median_seconds(lambda: dequantize_add(encoded, acc), repeats),
        "torch_quant_gbps": gigabytes / median_seconds(lambda: torch_quantize(tensor, block), repeats),
        "torch_dequant_gbps": gigabytes
        / median_seconds(
            lambda: torch_dequantize_add(torch_codes[0], torch_codes[1], step=torch_codes[2], acc=tensor_acc),
            repeats,
        ),
        "memcpy_gbps": gigabytes / median_seconds(lambda: np.copyto(copy, values), repeats),
    }
    result = {key: round(value, 3) if isinstance(value, float) else value for key, value in result.items()}
    result["quant_vs_torch"] = round(result["quant_gbps"] / result["torch_quant_gbps"], 1)
    result["dequant_vs_torch"] = round(result["dequant_gbps"] / result["torch_dequant_gbps"], 1)
    report(result, args.json)


if __name__ == "__main__":
    main()
