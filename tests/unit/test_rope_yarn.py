"""YaRN rope (gpt-oss) against transformers' frequencies and cos/sin scaling."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.rotary import RotaryEmbedding, attention_scaling, inv_frequencies
from kestrel.models.arch_config import parse_rope


@pytest.mark.parametrize("truncate, original, beta_fast, beta_slow, theta", [
    (False, 4096, 32.0, 1.0, 150000.0), (True, 4096, 32.0, 1.0, 150000.0),
    # Reversed ramp ends: a short original context, beta_fast below beta_slow.
    (False, 4, 8.0, 1.0, 1000.0), (True, 64, 1.0, 4.0, 10000.0)])
def test_yarn_matches_transformers(truncate, original, beta_fast, beta_slow, theta):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": beta_fast, "beta_slow": beta_slow,
              "truncate": truncate, "original_max_position_embeddings": original, "rope_theta": theta}
    hf = transformers.GptOssConfig(head_dim=64, rope_parameters=params)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf)
    rope = parse_rope({"rope_scaling": params, "rope_theta": theta})
    torch.testing.assert_close(inv_frequencies(64, rope), inv_freq, rtol=1e-6, atol=0)
    assert attention_scaling(rope) == pytest.approx(scaling)
    # The cos/sin cache carries the scaling: cos(0) is the factor itself.
    cache = RotaryEmbedding(64, 16, rope).cos_sin_cache
    assert cache[0, 0].item() == pytest.approx(scaling) and scaling > 1.3
