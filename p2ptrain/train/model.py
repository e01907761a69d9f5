"""A Llama-style decoder in plain PyTorch: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

It follows the Llama papers and Hugging Face's `LlamaForCausalLM` conventions exactly (rotate-half
rotary embeddings, key/value heads repeated in blocks), so `p2ptrain export` only renames tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from p2ptrain.config import ModelConfig, validate_shape

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """x / rms(x) · g, computed in fp32 whatever the activations' dtype (Zhang & Sennrich, 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position·frequency, (seq_len, head_dim), both halves repeated (RoFormer, §3.4)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim/2) pair of x (batch, heads, seq, head_dim) by its position's angle."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention where groups of query heads share one key/value head (GQA)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        repeats = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) · w3 x) (Shazeer, 2020)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The whole decoder: embeddings, the blocks, the final norm and the output layer (tied to the
    embeddings where the config says), computing the training loss itself (`forward`)."""

    def __init__(self, config: ModelConfig, activation_checkpointing: bool = False, loss_chunk: int = 0):
        super().__init__()
        validate_shape(config)
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        self.loss_chunk = loss_chunk
        """Tokens per chunk of the output layer and loss in training (0: all at once)."""
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.dim // config.n_heads, config.seq_len, config.rope_theta)
        # Not parameters and not saved: rebuilt from the config, so checkpoints hold weights only.
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Llama/GPT-2 convention: N(0, 0.02), residual output projections scaled by 1/sqrt(2·layers)."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(param, 0.0, residual_std)
            else:
                nn.init.normal_(param, 0.0, INIT_STD)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last block's output, normalised: (batch, seq, dim)."""
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.norm(x)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab); with `targets`, the next-token cross-entropy instead: the mean
        over tokens, or with reduction="sum" the sum (micro-batches add these up). One entry point,
        so FSDP2's forward hooks gather the parameters whichever is asked for."""
        x = self.hidden(tokens)
        if targets is None:
            return F.linear(x, self.output_weight)
        summed = summed_cross_entropy(x, self.output_weight, targets, chunk=self.loss_chunk)
        return summed if reduction == "sum" else summed / targets.numel()


def summed_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk: int
) -> torch.Tensor:
    """Σ over tokens of −log softmax(hidden · weightᵀ)[target], `chunk` tokens at a time.

    Each chunk's logits are recomputed in the backward pass instead of kept, so at most one chunk's
    logits (and their gradient) exist at once: with a 32k vocabulary, 8 × 1024 tokens' logits are
    1 GiB in fp32, a 512-token chunk's 64 MiB. The sum is the same up to float summation order."""
    flat_hidden = hidden.flatten(0, 1)
    flat_targets = targets.flatten()
    if chunk <= 0 or chunk >= flat_targets.numel():
        return _token_losses(flat_hidden, weight, flat_targets)
    total = hidden.new_zeros((), dtype=torch.float32)
    for part, part_targets in zip(flat_hidden.split(chunk), flat_targets.split(chunk), strict=True):
        if torch.is_grad_enabled():
            total = total + checkpoint(_token_losses, part, weight, part_targets, use_reentrant=False)
        else:
            total = total + _token_losses(part, weight, part_targets)
    return total


def _token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
