"""`p2ptrain export CKPT OUT_DIR`: a checkpoint as a Hugging Face Llama model (config.json + safetensors).

The model already follows `LlamaForCausalLM`'s conventions, so export is a renaming of tensors;
the result loads with `LlamaForCausalLM.from_pretrained(OUT_DIR)` and the tools built on it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from p2ptrain.ckpt.format import DIVERGED_FIELD, META_FILE, CheckpointError, latest_checkpoint
from p2ptrain.config import ModelConfig
from p2ptrain.errors import UserError

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""--dtype → the torch dtype's name (torch is imported once the arguments are checked)."""


def hf_name(name: str) -> str:
    """Our parameter name → the Hugging Face Llama name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise CheckpointError(f"parameter {name!r} has no Hugging Face Llama counterpart")


def hf_config(model: ModelConfig, dtype: str, eos_id: int | None = None) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.dim // model.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": model.seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": DTYPES[dtype],
        "bos_token_id": None,
        "eos_token_id": eos_id,
    }


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or the latest one inside a checkpoints folder or a node work dir."""
    if (path / META_FILE).is_file():
        return path
    for folder in (path, path / "checkpoints"):
        found = latest_checkpoint(folder) if folder.is_dir() else None
        if found is not None:
            return found
    raise UserError(f"{path}: no checkpoint there (expected meta.json, or step-* folders)")


def _read_meta(source: Path) -> dict[str, Any]:
    """The checkpoint's meta.json, or {} where it cannot be read (load_params then says why)."""
    try:
        meta = json.loads((source / META_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _refuse_diverged(source: Path, meta: dict[str, Any]) -> None:
    diverged = meta.get(DIVERGED_FIELD)
    if diverged:
        raise UserError(f"{source} is not the swarm's model ({diverged}); --allow-diverged exports it anyway")


def export(checkpoint: Path, out_dir: Path, dtype: str = "fp32", allow_diverged: bool = False) -> Path:
    """Write config.json and model.safetensors for `checkpoint` into `out_dir`; returns `out_dir`.

    A checkpoint of a node that ended off the swarm's track (meta `diverged`) holds a model that is
    not the swarm's: refused unless `allow_diverged`."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    source = resolve_checkpoint(checkpoint)
    if not allow_diverged:
        _refuse_diverged(source, _read_meta(source))  # before torch loads: a refusal takes a moment
    import torch
    from safetensors.torch import save_file

    from p2ptrain.train.checkpoint import load_params

    tensors, meta = load_params(source)
    model = ModelConfig.model_validate(meta["model"])
    torch_dtype = getattr(torch, DTYPES[dtype])
    renamed = {hf_name(name): tensor.to(torch_dtype).contiguous() for name, tensor in tensors.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()) and not (out_dir / "config.json").exists():
        raise UserError(f"{out_dir}: exists and holds other files; choose an empty or new folder")
    save_file(renamed, str(out_dir / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(out_dir / "model.safetensors.tmp", out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2) + "\n")
    return out_dir
