"""Tensor parallelism on CPU: two ranks over gloo give the tokens one rank gives (fp32, tiny models).

Each TP=2 engine spawns one extra rank process (about 4 s on a loaded 2-core machine), so a test
builds as few engines as it can.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel import Engine, SamplingParams
from tests.e2e.test_engine import prompts_with_shared_prefixes

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


def run(model: str, prompts: list[list[int]], params: list[SamplingParams], **options) -> list[list[int]]:
    with Engine(model=model, device="cpu", dtype="float32", **options) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert all(o.meta["finish_reason"] == "length" for o in outs), [o.meta for o in outs]
    return [o.token_ids for o in outs]


SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
# Its tokens go to the ranks, and overlap scheduling stops while it runs.
PENALIZED = SamplingParams(max_new_tokens=3, temperature=0.0, repetition_penalty=1.5, ignore_eos=True)
SCORED = SamplingParams(max_new_tokens=4, temperature=0.0, prompt_logprobs=1, ignore_eos=True)


@pytest.mark.parametrize("arch, overrides, options, last", [
    # vocab 511: the vocab-parallel rows do not split evenly (rank 1 holds a padding row).
    ("llama", dict(vocab_size=511), dict(enable_mixed_chunk=True), GREEDY),
    # One KV head for two ranks: each rank keeps a copy of it; tied embeddings; qk-norm; head_dim 32.
    # Prompt logprobs: logits at every prompt position, the sampled ones picked out on every rank.
    ("qwen3", dict(num_key_value_heads=1, tie=True), dict(enable_mixed_chunk=True), SCORED),
    # q/k/v biases sharded with their rows. (Penalties with enable_mixed_chunk fail on one rank too.)
    ("qwen2", {}, {}, PENALIZED),
], ids=["llama", "qwen3-kv-heads-fewer-than-ranks", "qwen2-bias-penalties"])
def test_tp2_tokens_equal_tp1(tiny_model, arch, overrides, options, last):
    model = tiny_model(arch, **overrides)
    prompts = prompts_with_shared_prefixes(5, vocab=overrides.get("vocab_size", 512), seed=3)
    # A seeded sampled request: every rank must draw the same token (the next step's input).
    params = [GREEDY] * 3 + [SAMPLED, last]
    # Chunked prefill over shared prefixes: chunks, radix hits and decodes all cross the ranks.
    options = dict(chunked_prefill_size=16, **options)
    one = run(model, prompts, params, **options)
    assert run(model, prompts, params, tp_size=2, **options) == one


@pytest.mark.parametrize("ep_size", [1, 2], ids=["experts-width-split", "experts-split"])
def test_qwen3_moe_tp2_and_ep2_tokens_equal_tp1(tiny_model, ep_size):
    """Qwen3-MoE at --tp-size 2: each expert's width split over the ranks (ep 1), or each rank holding
    half the experts whole (ep 2); a dense MLP layer beside the MoE one. One all-reduce per MoE layer."""
    model = tiny_model("qwen3_moe", mlp_only_layers=[1])
    prompts = prompts_with_shared_prefixes(3, seed=6)
    params = [GREEDY] * 2 + [SAMPLED]
    options = dict(chunked_prefill_size=16)
    one = run(model, prompts, params, **options)
    assert run(model, prompts, params, tp_size=2, ep_size=ep_size, **options) == one


@pytest.mark.parametrize("ep_size", [1, 2], ids=["experts-width-split", "experts-split"])
def test_gpt_oss_tp2_and_ep2_tokens_equal_tp1(tmp_path, ep_size):
    """gpt-oss at --tp-size 2: sinks, q/k/v/o biases and the router split or replicated per rank, expert
    biases added once, window and full layers alternating, decode past the window."""
    from tests.model.gpt_oss_tiny import WINDOW, make_gpt_oss

    model = str(make_gpt_oss(tmp_path / "gpt_oss", seed=5))
    prompts = prompts_with_shared_prefixes(3, vocab=96, seed=8)
    params = [SamplingParams(max_new_tokens=2 * WINDOW, temperature=0.0, ignore_eos=True)] * 2 + [SAMPLED]
    options = dict(chunked_prefill_size=16)
    one = run(model, prompts, params, **options)
    assert run(model, prompts, params, tp_size=2, ep_size=ep_size, **options) == one


@pytest.mark.parametrize("ep_size", [1, 2], ids=["experts-width-split", "experts-split"])
def test_deepseek_v3_tp2_and_ep2_tokens_equal_tp1(tmp_path, ep_size):
    """DeepSeek-V3 at --tp-size 2: MLA heads split, the latent cache whole on every rank, q LoRA and the
    latent projections replicated, grouped sigmoid routing, a dense layer and the shared expert."""
    from tests.model.dsv3_tiny import make_dsv3

    model = str(make_dsv3(tmp_path / "dsv3"))
    prompts = [[5, 17, 99, 3, 64, 2, 120, 9, 31], [45, 7, 7, 31, 88, 11, 0, 54, 23], [5, 17, 99, 3, 64, 8]]
    params = [GREEDY] * 2 + [SAMPLED]
    options = dict(chunked_prefill_size=4)
    one = run(model, prompts, params, **options)
    assert run(model, prompts, params, tp_size=2, ep_size=ep_size, **options) == one


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(tiny_model):
    import os
    import signal

    from kestrel.distributed.errors import RankFailedError

    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32", tp_size=2) as engine:
        (pid,) = engine.ranks.pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankFailedError, match=f"tensor-parallel rank 1 \\(pid {pid}\\) exited"):
            engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)
        with pytest.raises(RankFailedError):  # and stays down
            engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)


def test_deepseek_v4_experts_split_over_two_ranks_give_one_rank_tokens(tmp_path):
    """DeepSeek-V4's tiny config at --tp-size 2 --ep-size 2: each rank holds half the routed experts
    (and reads only those from the file), the routed sums meet in an all-reduce."""
    import json

    import torch
    from safetensors.torch import save_file

    from tests.model import dsv4_reference as ref

    cfg = ref.RefConfig(index_n_heads=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg.native_config()))
    save_file({k: v.contiguous() for k, v in ref.random_weights(cfg, seed=0).items()},
              str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (70, 9)]
    params = [SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)] * 2
    options = dict(page_size=128, max_total_tokens=2048, chunked_prefill_size=64)
    one = run(str(tmp_path), prompts, params, **options)
    assert run(str(tmp_path), prompts, params, tp_size=2, ep_size=2, **options) == one


def test_two_nodes_launched_apart_give_one_rank_tokens(tiny_model):
    """--nnodes 2: node 1 is `kestrel serve --node-rank 1` (its ranks only, no HTTP), node 0 the engine;
    both meet at --dist-init-addr. When node 0's engine stops, node 1's launcher exits 0."""
    import subprocess
    import sys

    from tests.e2e.server_process import REPO, free_port

    model = tiny_model("llama")
    prompts = prompts_with_shared_prefixes(2, seed=4)
    one = run(model, prompts, [GREEDY] * 2)
    flags = ["--model", model, "--device", "cpu", "--dtype", "float32", "--tp-size", "2", "--nnodes", "2",
             "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    node1 = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", *flags, "--node-rank", "1"], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        options = dict(tp_size=2, nnodes=2, node_rank=0, dist_init_addr=flags[-1])
        assert run(model, prompts, [GREEDY] * 2, **options) == one
        assert node1.wait(timeout=60) == 0, node1.stderr.read()
    finally:
        node1.kill()


def test_each_rank_loads_only_its_slices_and_together_they_make_the_model(tiny_model, monkeypatch):
    """Built without a process group (loading needs none): rank r's parameters are its slices of the
    one-rank model's, and what it reads from the file is about half of it, not all of it."""
    import torch

    from kestrel.distributed.parallel_state import ParallelState
    from kestrel.models import loader

    path = tiny_model("llama", vocab_size=511)
    whole = loader.load_model(path, torch.float32, "cpu")
    read = []
    real_read = loader._read
    monkeypatch.setattr(loader, "_read", lambda f, name, part: read.append(t := real_read(f, name, part)) or t)
    ranks = []
    for rank in range(2):
        read.clear()
        ranks.append(loader.load_model(path, torch.float32, "cpu", parallel=ParallelState(rank, 2)))
        total = sum(p.numel() for p in whole.parameters())
        assert sum(t.numel() for t in read) < 0.6 * total  # norms (and biases of row-parallel layers) are whole
    w = [dict(m.named_parameters()) for m in ranks]
    full = dict(whole.named_parameters())
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        assert torch.equal(torch.cat([w[0][name], w[1][name]], dim=1), full[name])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # 256 rows each, rank 1's last one padding
        assert torch.equal(torch.cat([w[0][name], w[1][name]])[:511], full[name])
        assert not w[1][name][-1].any()
    qkv = "model.layers.0.self_attn.qkv_proj.weight"  # q: 2 heads each; k, v: 1 head each (of 2)
    q, k, v = full[qkv].split([4 * 16, 2 * 16, 2 * 16])
    for rank in range(2):
        assert torch.equal(w[rank][qkv], torch.cat([q[rank * 32:(rank + 1) * 32], k[rank * 16:(rank + 1) * 16],
                                                    v[rank * 16:(rank + 1) * 16]]))


def test_a_script_without_a_main_guard_is_told_what_to_do(tiny_model, tmp_path):
    """Its rank re-imports the script and would build the engine again: one line says to guard it."""
    script = tmp_path / "unguarded.py"
    script.write_text(f"from kestrel import Engine\nEngine(model={tiny_model('llama')!r}, device='cpu', tp_size=2)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0
    assert 'RankFailedError: tensor-parallel rank 1 could not start: a script that creates Engine(tp_size > 1) must ' \
           'do it under `if __name__ == "__main__":`' in done.stderr
    assert "bootstrapping phase" not in done.stderr  # multiprocessing's page of text
