"""The architecture description our model code needs, independent of where the weights came from."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral" or "qwen2": all run on isoserve.model.llama
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    rope_scaling: dict | None = None  # HF rope_scaling dict ("linear", "llama3", ...)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V over all layers for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
