"""Configuration of SDAR block-diffusion models with an optional MRP head.

Reads, as they are, the ``config.json`` files of the SDAR release (``JetLM/SDAR-*-Chat``: Qwen3
fields, no ``block_size`` / ``mask_token_id``) and of the MRP release
(``heavyball/sdar-*-mrp-3lyr``: ``num_nextn_predict_layers``, ``num_mrp_heads``, ``block_size``,
``mask_token_id``). RoPE settings are accepted in the old spelling (``rope_theta`` plus
``rope_scaling``) and in the transformers-5 one (``rope_parameters``).
"""

from __future__ import annotations

from transformers import PretrainedConfig

DEFAULT_BLOCK_SIZE = 4
DEFAULT_MASK_TOKEN_ID = 151669
SUPPORTED_ROPE_TYPES = ("default", "linear")


class SDARMRPConfig(PretrainedConfig):
    """Qwen3-shaped SDAR backbone plus ``num_nextn_predict_layers`` MRP decoder layers.

    ``num_nextn_predict_layers = 0`` describes a plain SDAR checkpoint (no MRP head).
    """

    model_type = "sdar"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 2048,
        intermediate_size: int = 6144,
        num_hidden_layers: int = 28,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = 8,
        head_dim: int | None = 128,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float | None = None,
        rope_scaling: dict | None = None,
        rope_parameters: dict | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        block_size: int | None = None,
        mask_token_id: int | None = None,
        num_nextn_predict_layers: int = 0,
        num_mrp_heads: int = 1,
        mrp_init_std: float | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        self.mask_token_id = DEFAULT_MASK_TOKEN_ID if mask_token_id is None else mask_token_id
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.num_mrp_heads = num_mrp_heads
        self.mrp_init_std = mrp_init_std
        if float(kwargs.pop("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(_PARTIAL_ROPE)
        self.rope_parameters = _standard_rope(rope_parameters, rope_scaling, rope_theta)
        # Drop keys that transformers would otherwise re-interpret after us.
        kwargs.pop("rope_scaling", None)
        kwargs.pop("rope_theta", None)
        self._validate()  # before transformers' own checks (their words, and their error types, vary by version)
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        # Some transformers versions rewrite ``rope_parameters`` in ``__post_init__``; ours is final.
        self.rope_parameters = _standard_rope(self.rope_parameters, None, None)

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def has_mrp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def _validate(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "block_size")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"config.head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"config.mask_token_id={self.mask_token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size}); set mask_token_id to the id of <|MASK|>")
        if self.num_nextn_predict_layers < 0:
            raise ValueError("config.num_nextn_predict_layers must be >= 0")
        if self.has_mrp and self.num_mrp_heads != 1:
            raise ValueError(f"config.num_mrp_heads={self.num_mrp_heads}: only one MRP head is supported")


_PARTIAL_ROPE = ("partial_rotary_factor other than 1 is not supported: RoPE rotates the whole head_dim in SDAR "
                 "(and Qwen3); remove it from the config")


def _standard_rope(rope_parameters: dict | None, rope_scaling: dict | None, rope_theta: float | None) -> dict:
    """Merge the old (``rope_theta`` + ``rope_scaling``) and new (``rope_parameters``) spellings into
    ``{"rope_type": ..., "rope_theta": ..., ["factor": ...]}``."""
    params = dict(rope_parameters or {})
    for key, value in (rope_scaling or {}).items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    params.setdefault("rope_type", "default")
    if rope_theta is not None:
        params.setdefault("rope_theta", rope_theta)
    params.setdefault("rope_theta", 1_000_000.0)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {params['rope_type']!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}")
    if params["rope_type"] == "linear" and float(params.get("factor", 0)) <= 0:
        raise ValueError("linear rope scaling needs a positive 'factor'")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(_PARTIAL_ROPE)
    if not float(params["rope_theta"]) > 0:
        raise ValueError(f"rope_theta must be > 0, got {params['rope_theta']}")
    return params
