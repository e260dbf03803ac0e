"""`load_hf_config`: a checkpoint's config.json as a transformers config, never running the
checkpoint's own Python code.

`AutoConfig` resolves config.json's `model_type`; a checkpoint whose model_type transformers
does not know but whose "architectures" this engine serves (Kimi-K2: model_type "kimi_k2",
architectures ["DeepseekV3ForCausalLM"], `auto_map` pointing at remote code) is read into the
config class of the architecture's own model_type (`MoeCausalLM.model_types[0]`, e.g.
`DeepseekV3Config`), as vLLM maps such configs onto a known class instead of trusting remote
code.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from moe_engine.errors import StartupError
from moe_engine.startup.config import read_config_json


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """The transformers config of `model_dir`/config.json (trust_remote_code=False).

    Raises:
        StartupError: config.json missing or invalid, a field of the wrong type (transformers'
            strict config validation, in one line naming the field, its value and the type),
            or a config neither AutoConfig nor the architecture's config class can read (both
            reasons given).
        ValueError, KeyError: AutoConfig's own error (e.g. "trust_remote_code") when
            config.json names no architecture this engine serves.
    """
    from moe_engine.models import resolve_config_dict

    try:
        cfg = read_config_json(model_dir)
    except (FileNotFoundError, ValueError) as e:
        raise StartupError(str(e)) from e
    try:
        return _strict(AutoConfig.from_pretrained, str(model_dir), trust_remote_code=False)
    except (ValueError, KeyError) as auto_error:
        try:
            _, model_cls = resolve_config_dict(cfg)
        except StartupError:
            raise auto_error from None  # no architecture served here: AutoConfig's reason
        model_type = next(iter(model_cls.model_types), None)
        if model_type not in CONFIG_MAPPING:
            raise StartupError(f"config.json: {auto_error}") from auto_error
        config_class = CONFIG_MAPPING[model_type]
        fields = {k: v for k, v in cfg.items() if k not in ("auto_map", "model_type")}
        try:
            return _strict(config_class.from_dict, fields)
        except (ValueError, TypeError, KeyError) as e:
            raise StartupError(
                f"config.json (model_type {cfg.get('model_type')!r}): AutoConfig: {auto_error}; "
                f"as {config_class.__name__}: {e}"
            ) from e


def _strict(read, *args, **kwargs) -> PretrainedConfig:
    """`read(*args, **kwargs)` with transformers' strict field validation errors (a
    `huggingface_hub` StrictDataclassError, e.g. for `"n_group": "4"`) as one-line
    StartupErrors instead of a traceback.

    Raises:
        StartupError: "config.json: Validation error for field 'n_group': TypeError: Field
            'n_group' with value '4' doesn't match ... expected int, got str (value: '4')".
    """
    try:
        return read(*args, **kwargs)
    except StrictDataclassError as e:
        raise StartupError(f"config.json: {' '.join(str(e).split())}") from None
