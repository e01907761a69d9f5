"""`p2ptrain export CKPT OUT_DIR`: a checkpoint as a Hugging Face Llama model, with its tokenizer.

The model already follows `LlamaForCausalLM`'s conventions, so export is a renaming of tensors;
the result loads with `AutoModelForCausalLM.from_pretrained(OUT_DIR)` and the tools built on it.
The tokenizer files make `AutoTokenizer.from_pretrained(OUT_DIR)` map text to the ids the model was
trained on (train/data.py): for the bytes tokenizer, one id per UTF-8 byte; for a tokenizer.json,
that tokenizer without the special tokens it would add around a text (training adds none).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from p2ptrain.ckpt.format import DIVERGED_FIELD, META_FILE, CheckpointError, latest_checkpoint
from p2ptrain.config import DataConfig, ModelConfig
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
    """config.json. No pad_token_id: it would make the embedding's row of that id padding
    (no gradient) for whoever fine-tunes the export, and here it is EOS, a token trained on."""
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


def generation_config(eos_id: int) -> dict[str, Any]:
    """generation_config.json: `generate` stops at EOS, and pads a batch with it without a warning."""
    return {"bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": eos_id}


def byte_tokenizer_json(eos_id: int) -> dict[str, Any]:
    """The bytes tokenizer (train/data.py ByteTokenizer) as a tokenizer.json: a BPE without merges
    whose 256 tokens are the bytes (`<0x41>` is id 65), so every character falls back to its UTF-8
    bytes, and the decoder turns them back into text. An EOS beyond the bytes gets a token of its own."""
    vocab = {f"<0x{byte:02X}>": byte for byte in range(256)}
    if eos_id >= 256:
        vocab["<|endoftext|>"] = eos_id
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "ByteFallback"},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": True,
            "vocab": vocab,
            "merges": [],
        },
    }


def tokenizer_files(data: DataConfig, model: ModelConfig) -> tuple[dict[str, dict[str, Any]], int]:
    """({file name: JSON} of the tokenizer the run trained with, its EOS id); a one-line DataError
    where the configured tokenizer cannot be used or does not fit the model."""
    from p2ptrain.train.data import load_tokenizer

    eos_id = load_tokenizer(data, model.vocab_size).eos_id
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model.seq_len,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",  # for batches given to `generate`
    }
    if data.tokenizer == "bytes":
        spec = byte_tokenizer_json(eos_id)
        eos_token = next(token for token, index in spec["model"]["vocab"].items() if index == eos_id)
        # "<0x00>" typed in a text is six bytes, as in training, not the EOS token
        settings["split_special_tokens"] = True
    else:
        from tokenizers import Tokenizer

        path = Path(data.tokenizer).expanduser()
        spec = json.loads(path.read_text())
        spec["post_processor"] = None  # training encodes with add_special_tokens=False: no BOS added
        eos_token = Tokenizer.from_file(str(path)).id_to_token(eos_id)
    settings |= {"eos_token": eos_token, "pad_token": eos_token}
    return {"tokenizer.json": spec, "tokenizer_config.json": settings}, eos_id


def node_folders(path: Path) -> list[str]:
    """The folders in `path` that hold a node's checkpoints (a demo's or a test's work dir)."""
    if not path.is_dir():
        return []
    return sorted(
        sub.name
        for sub in path.iterdir()
        if sub.is_dir() and (latest_checkpoint(sub) or latest_checkpoint(sub / "checkpoints"))
    )


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or the latest one inside a checkpoints folder or a node work dir."""
    if (path / META_FILE).is_file():
        return path
    for folder in (path, path / "checkpoints"):
        found = latest_checkpoint(folder) if folder.is_dir() else None
        if found is not None:
            return found
    nodes = node_folders(path)
    if nodes:
        raise UserError(
            f"{path}: no checkpoint here; node folders: {', '.join(f'{name}/' for name in nodes)} — "
            f"export one of them (p2ptrain export {path / nodes[0]} OUT_DIR)"
        )
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


def export(
    checkpoint: Path,
    out_dir: Path,
    *,
    dtype: str = "fp32",
    allow_diverged: bool = False,
    data: DataConfig | None = None,
) -> Path:
    """Write the model (config.json, generation_config.json, model.safetensors) and the tokenizer
    `data` names (tokenizer.json, tokenizer_config.json; default: the bytes tokenizer) for
    `checkpoint` into `out_dir`; returns `out_dir`.

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
    tokenizer, eos_id = tokenizer_files(data or DataConfig(), model)
    torch_dtype = getattr(torch, DTYPES[dtype])
    renamed = {hf_name(name): tensor.to(torch_dtype).contiguous() for name, tensor in tensors.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()) and not (out_dir / "config.json").exists():
        raise UserError(f"{out_dir}: exists and holds other files; choose an empty or new folder")
    save_file(renamed, str(out_dir / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(out_dir / "model.safetensors.tmp", out_dir / "model.safetensors")
    documents = {
        "config.json": hf_config(model, dtype, eos_id),
        "generation_config.json": generation_config(eos_id),
        **tokenizer,
    }
    for name, document in documents.items():
        (out_dir / name).write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    shareable([out_dir / name for name in ["model.safetensors", *documents]])
    return out_dir


def shareable(paths: list[Path]) -> None:
    """Give `paths` the mode any new file gets here (0644 under the usual umask): safetensors
    writes its file 0600, and an export is made to be read by others (a model hub, a team)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)
