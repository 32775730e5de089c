"""The bundled DeepSeek-V3-family config folders parse to the architecture they describe."""
import json
import math
from pathlib import Path

import pytest

from kestrel.models.deepseek_v3.config import parse_v3_config
from kestrel.models.registry import model_class

CONFIGS = Path(__file__).parents[2] / "kestrel/assets/configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def test_deepseek_v3_config():
    cfg = parse_v3_config(_config("deepseek-v3"))
    assert cfg.moe_layers == (False,) * 3 + (True,) * 58
    assert (cfg.moe.router.n_group, cfg.moe.router.topk_group, cfg.moe.router.scaling_factor) == (8, 4, 2.5)
    assert cfg.moe.shared_intermediate_size == 2048 and cfg.rope_interleave
    mscale = 0.1 * math.log(40) + 1  # mscale_all_dim = 1: the softmax scale grows by mscale ** 2
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert cfg.num_nextn_predict_layers == 1


def test_kimi_k2_loads_through_the_v3_class():
    config = _config("kimi-k2")
    assert model_class(config["architectures"]).__name__ == "DeepseekV3ForCausalLM"
    cfg = parse_v3_config(config)
    assert (cfg.moe.num_experts, cfg.num_attention_heads, cfg.moe.router.n_group) == (384, 64, 1)
    assert cfg.moe_layers[0] is False and all(cfg.moe_layers[1:])


def test_slice_keeps_real_widths():
    full, part = parse_v3_config(_config("deepseek-v3")), parse_v3_config(_config("deepseek-v3-slice"))
    assert (part.hidden_size, part.num_attention_heads, part.kv_lora_rank) == (7168, 128, 512)
    assert part.num_hidden_layers == 4 and part.moe.num_experts == 32
    assert part.softmax_scale == full.softmax_scale


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"n_group": 3}, "n_group"),
])
def test_bad_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        parse_v3_config({**_config("deepseek-v3"), **change})
