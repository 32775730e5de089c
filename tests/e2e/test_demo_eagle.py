"""The bundled EAGLE head `demo-eagle`: it resolves as demo's EAGLE draft, loads through kestrel's loader
in the public layout, and drafts demo's next token far above chance on Python text."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kestrel.assets import resolve_model_path
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.engine.tokenizer import load_tokenizer
from kestrel.models.llama_eagle import TargetParts, detect_eagle_variant, load_eagle_head
from kestrel.models.loader import checkpoint_names, load_model
from tests.model.harness import Harness

TEXT = '''import os


def walk_sizes(root):
    """Return a dict mapping each file below root to its size in bytes."""
    sizes = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                sizes[path] = os.path.getsize(path)
            except OSError:
                continue
    return sizes


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count += 1
        return self.count
'''


def test_demo_eagle_is_demos_eagle_draft():
    folder = Path(resolve_model_path("demo-eagle"))
    assert detect_eagle_variant(folder) == "EAGLE"
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= set(checkpoint_names(folder))
    assert json.loads((folder / "training_info.json").read_text())["target"] == "demo"
    spec = resolve_config(EngineConfig.from_flat(model="demo", device="cpu", speculative_algorithm="EAGLE",
                                                 speculative_draft_model_path="demo-eagle")).speculative
    assert spec.speculative_draft_model_path == str(folder)
    assert (spec.speculative_num_steps, spec.speculative_eagle_topk, spec.speculative_num_draft_tokens) == (5, 4, 8)


def test_demo_eagle_drafts_demos_next_token():
    demo = load_model(resolve_model_path("demo"), torch.float32, "cpu")
    head = load_eagle_head(resolve_model_path("demo-eagle"), "EAGLE", TargetParts.of(demo),
                           demo.config.num_hidden_layers, demo.config.max_position_embeddings, torch.float32, "cpu")
    ids = load_tokenizer(resolve_model_path("demo")).encode(TEXT)
    batch = Harness(demo, 1, max_len=len(ids)).batch([ids])
    with torch.no_grad():
        features = demo(batch.input_ids, batch.positions, batch)
        demo_next = demo.compute_logits(features).argmax(-1)  # demo's greedy token after each position
        # As DRAFT_EXTEND runs it: position t reads token t+1 and demo's feature at t.
        head_batch = Harness(head, 1, max_len=len(ids)).batch([ids[1:]])
        _, logits = head(head_batch.input_ids, head_batch.positions, features[:-1], head_batch)
    agreement = (logits.argmax(-1) == demo_next[1:]).double().mean().item()
    assert agreement > 0.2, agreement  # chance is 1 / 8192; a mis-loaded head scores ~0
