"""Reading config.json dicts into `model_shape.ModelShape` fields: the parts every Llama-style MoE
architecture states alike, for the architecture files' `shape_fields` to compose.

Keys are read as transformers 4.x and 5.x write them (a dict from config.json or from
`PretrainedConfig.to_dict()`).
"""

from __future__ import annotations

from moe_engine.kv_cache.spec import SLIDING_ATTENTION


def required_int(cfg: dict, key: str) -> int:
    """`int(cfg[key])`.

    Raises:
        ValueError: `key` missing or null, naming it.
    """
    if cfg.get(key) is None:
        raise ValueError(f"config.json: missing required field {key!r}")
    return int(cfg[key])


def num_experts_of(cfg: dict) -> int:
    """Routed experts per MoE layer: `num_experts`, `num_local_experts` (Mixtral, gpt-oss) or
    `n_routed_experts` (DeepSeek); 0 when none is set."""
    return int(
        cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    )


def every_layer_moe(cfg: dict) -> tuple[int, ...]:
    """All layer indices when the config has routed experts (Mixtral, gpt-oss), else ()."""
    layers = required_int(cfg, "num_hidden_layers")
    return tuple(range(layers)) if num_experts_of(cfg) else ()


def sparse_step_moe_layers(cfg: dict) -> tuple[int, ...]:
    """The MoE layers of a Qwen-MoE config: layer i is MoE when i is not in
    `mlp_only_layers`, the config has experts, and (i + 1) % `decoder_sparse_step` == 0."""
    layers = required_int(cfg, "num_hidden_layers")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    experts = num_experts_of(cfg)
    return tuple(
        i for i in range(layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0
    )


def moe_shape_fields(
    cfg: dict,
    *,
    architecture: str,
    experts_width_field: str,
    moe_layers: tuple[int, ...],
    **fields,
) -> dict:
    """The `ModelShape` fields a Llama-style MoE config.json states alike, then `fields` (the
    architecture's own; they win).

    Args:
        cfg: the config.json dict.
        architecture: the name for `ModelShape.architecture` when config.json lists none.
        experts_width_field: the key holding one expert's width I ("moe_intermediate_size",
            or "intermediate_size" where experts are the only MLPs: Mixtral, gpt-oss; the
            dense width is then 0).
        moe_layers: the indices of the MoE layers.

    Raises:
        ValueError: a required field missing (named); experts per token outside [1, the
            experts a router scores] where the model has MoE layers.
    """
    hidden, heads = required_int(cfg, "hidden_size"), required_int(cfg, "num_attention_heads")
    layers = required_int(cfg, "num_hidden_layers")
    moe_width = required_int(cfg, experts_width_field)
    dense_width = int(cfg.get("intermediate_size") or 0)
    if experts_width_field == "intermediate_size" or len(moe_layers) == layers:
        dense_width = 0
    common = dict(
        architecture=(cfg.get("architectures") or [architecture])[0],
        vocab_size=required_int(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        num_experts=num_experts_of(cfg),
        top_k=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0),
        moe_intermediate_size=moe_width,
        intermediate_size=dense_width,
        moe_layers=tuple(moe_layers),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        attention_bias=bool(cfg.get("attention_bias", False)),
    )
    shape = {**common, **fields}
    scored = shape["num_experts"] + shape.get("zero_experts", 0)
    stated = "top_k" in fields or any(
        cfg.get(key) is not None for key in ("num_experts_per_tok", "experts_per_token")
    )  # an absent field is transformers' default, filled where the config is loaded
    if stated and shape["moe_layers"] and not 1 <= shape["top_k"] <= scored:
        raise ValueError(
            f"config.json: {shape['architecture']} routes each token to top_k = "
            f"{shape['top_k']} experts (num_experts_per_tok), which must be in [1, {scored}] "
            "(the experts its router scores)"
        )
    return shape


def uniform_window_fields(cfg: dict, *, enabled: bool = True) -> dict:
    """`layer_types` / `sliding_window` of a model whose config.json windows every layer
    alike (Mixtral whenever `sliding_window` is set; Qwen3-MoE only with `use_sliding_window`,
    passed as `enabled`, as transformers drops the window otherwise); {} for full attention.

    Raises:
        ValueError: a window below 1 token.
    """
    window = cfg.get("sliding_window") if enabled else None
    if window is None:
        return {}
    if int(window) < 1:
        raise ValueError(f"config.json: sliding_window {window!r} must be >= 1 token")
    layers = required_int(cfg, "num_hidden_layers")
    return dict(layer_types=(SLIDING_ATTENTION,) * layers, sliding_window=int(window))


def layer_types_fields(cfg: dict, default_window: int) -> dict:
    """`layer_types` / `sliding_window` of a config.json that names each layer's attention
    (gpt-oss: default even layers sliding, as `GptOssConfig`; window default `default_window`).

    Raises:
        ValueError: a `layer_types` of the wrong length or with an unknown entry, or a window
            below 1 token when some layer slides.
    """
    layers = required_int(cfg, "num_hidden_layers")
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    if len(layer_types) != layers or not set(layer_types) <= {
        "sliding_attention",
        "full_attention",
    }:
        raise ValueError(
            f"config.json: layer_types {layer_types} must give one of 'sliding_attention', "
            f"'full_attention' for each of the {layers} layers"
        )
    window = cfg.get("sliding_window", default_window)
    sliding = "sliding_attention" in layer_types
    if sliding and (window is None or int(window) < 1):
        raise ValueError(
            f"config.json: sliding_window {window!r} must be >= 1 token when layer_types has "
            f"sliding_attention layers"
        )
    return dict(layer_types=tuple(layer_types), sliding_window=int(window) if sliding else None)


def mla_shape_fields(cfg: dict) -> dict:
    """The MLA fields of a DeepSeek-V2/V3-style config.json (`kv_lora_rank` set: multi-head
    latent attention, DeepSeek-V2 paper sec. 2.1), {} otherwise.

    Raises:
        ValueError: kv_lora_rank set without qk_rope_head_dim, qk_nope_head_dim or v_head_dim.
    """
    if not cfg.get("kv_lora_rank"):
        return {}
    dims = {}
    for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if cfg.get(key) is None:
            raise ValueError(f"config.json: kv_lora_rank is set (MLA) but {key!r} is missing")
        dims[key] = int(cfg[key])
    q_lora = cfg.get("q_lora_rank")
    return dict(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        q_lora_rank=int(q_lora) if q_lora else None,
        **dims,
    )


def check_hidden_act(cfg: dict, architecture: str) -> None:
    """Refuse an MLP activation other than SiLU: the engine's dense MLPs, shared experts and
    fused experts compute SwiGLU, silu(gate) * up (`hidden_act` default "silu").

    Raises:
        ValueError: naming `hidden_act`, its value and the architecture.
    """
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":
        raise ValueError(
            f"config.json: hidden_act {act!r} is not supported for {architecture} (the engine's "
            f"MLPs and experts compute SwiGLU with silu; supported: 'silu')"
        )


#: `mlp_layer_types` entries (transformers 5: GLM-4.7-Flash, A.X-K1, ...): "sparse" is an MoE
#: layer, "dense" a dense MLP.
MLP_LAYER_TYPES = ("dense", "sparse")


def mlp_layer_types_moe_layers(cfg: dict, default: list[str]) -> tuple[int, ...]:
    """The MoE layers of a config.json naming each layer's MLP in `mlp_layer_types` ("sparse":
    MoE, "dense": a dense MLP); `default` (one entry per layer) where the field is absent or
    null, as the transformers config's `__post_init__` fills it. () without routed experts.

    Raises:
        ValueError: a `mlp_layer_types` of the wrong length or with an entry other than
            "dense" / "sparse" (naming the field, its value and what is supported).
    """
    layers = required_int(cfg, "num_hidden_layers")
    types = cfg.get("mlp_layer_types") or default
    if len(types) != layers or not set(types) <= set(MLP_LAYER_TYPES):
        raise ValueError(
            f"config.json: mlp_layer_types {types} must give one of {MLP_LAYER_TYPES} for each "
            f"of the {layers} layers"
        )
    if not num_experts_of(cfg):
        return ()
    return tuple(i for i, kind in enumerate(types) if kind == "sparse")


#: Older config.json layer-type names -> transformers 5's (`configuration_utils.
#: _LEGACY_LAYER_TYPE_REMAP`: Granite-4.0-H's and Nemotron-H's released configs say "mamba").
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def remap_layer_types(types: list[str] | tuple[str, ...] | None) -> list[str] | None:
    """`types` with legacy names ("mamba", "attention") replaced as transformers 5 reads
    them; None stays None."""
    if types is None:
        return None
    return [LEGACY_LAYER_TYPES.get(t, t) for t in types]
