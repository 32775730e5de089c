"""Chat data for training an EAGLE head on a real chat model (scripts/train_eagle_head.py --target PATH),
and the measurement of the trained head in kestrel's engine.

Prompts come from two offline sources: the first line of function docstrings in the Python standard
library (demo's corpus, scripts/train_demo_model.py; prompts for training from its training files, held-out
prompts from its held-out files), wrapped in a few coding requests; and general requests written here,
TASKS x TOPICS, the held-out ones on topics no training prompt names. The target answers them itself
through kestrel's Engine (batched, on the CPU or a GPU): half greedy, half sampled, as it answers when
serving.
"""
from __future__ import annotations

import random
import sysconfig
import time
from pathlib import Path

import torch
import train_demo_model as demo_training

from kestrel import Engine, SamplingParams

CODE_TASKS = ("Write a Python function that does this: {}", "{}",
              "Explain what a Python function documented as \"{}\" does, and when to use it.",
              "How would I implement this in Python? {}")
TASKS = ("Explain {} in simple terms.", "Give three facts about {}.", "Write a short paragraph about {}.",
         "What are the pros and cons of {}?", "Write a haiku about {}.", "How would you teach a child about {}?",
         "Summarize the history of {} in a few sentences.", "List some common misconceptions about {}.")
TOPICS = ("photosynthesis", "the French Revolution", "black holes", "machine learning", "the water cycle",
          "volcanoes", "the Roman Empire", "climate change", "vaccines", "the internet", "jazz music", "chess",
          "the moon landing", "honey bees", "electric cars", "the stock market", "recycling", "dinosaurs",
          "the human heart", "coffee", "the Olympic Games", "earthquakes", "solar panels", "the printing press",
          "sleep", "rainbows", "democracy", "the immune system", "bicycles", "the Great Wall of China")
HELD_OUT_TOPICS = ("ocean tides", "the Renaissance", "glaciers", "compound interest", "octopuses")
MEASURE_SETTINGS = {"chain 3/1/4": (3, 1, 4), "tree 5/4/8": (5, 4, 8)}


def chat_prompts(num_train: int, num_held_out: int, seed: int) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts), half general requests and half coding requests each; no
    held-out prompt shares a topic or a source file with a training prompt."""
    files, _ = demo_training.collect_corpus(Path(sysconfig.get_paths()["stdlib"]))
    held_files = {f: files.pop(f) for f in demo_training.HELD_OUT}
    rng = random.Random(seed)

    def code(source: dict[str, str], n: int) -> list[str]:
        summaries = sorted({chat[0]["content"] for chat in demo_training.chat_examples(source)})
        return [rng.choice(CODE_TASKS).format(s) for s in rng.sample(summaries, n)]

    def general(topics: tuple[str, ...], n: int) -> list[str]:
        pairs = [(task, topic) for task in TASKS for topic in topics]
        return [task.format(topic) for task, topic in rng.sample(pairs, min(n, len(pairs)))]

    train = general(TOPICS, num_train // 2)
    train += code(files, num_train - len(train))
    held = general(HELD_OUT_TOPICS, num_held_out // 2)
    held += code(held_files, num_held_out - len(held))
    rng.shuffle(train)
    return train, held


def chat_ids(tok, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn through the target's chat template, ready for the answer."""
    return [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for p in prompts]


def engine_answers(target: str, prompts: list[list[int]], new_tokens: int, batch: int, deadline: float,
                   seed: int, device: str = "cpu") -> list[list[int]]:
    """The target's answers to `prompts` through kestrel's Engine on `device` (float32 on a CPU, bfloat16 on a
    GPU), `batch` at a time until `deadline` (time.time()): even prompts greedy, odd ones sampled (temperature
    0.7, top-p 0.9). Returns prompt + answer token ids of every prompt answered."""
    out = []
    # On a GPU in bfloat16: the answers are training text (the features come from the float32 target), and in
    # float32 one H200 answered a single batch of 512 in the phase's 71 s, start-up included.
    dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    with Engine(model=target, device=device, dtype=dtype) as engine:
        for start in range(0, len(prompts), batch):
            if time.time() >= deadline:
                break
            chunk = prompts[start:start + batch]
            params = [SamplingParams(max_new_tokens=new_tokens, temperature=0.0) if (start + i) % 2 == 0 else
                      SamplingParams(max_new_tokens=new_tokens, temperature=0.7, top_p=0.9, seed=seed + start + i)
                      for i in range(len(chunk))]
            answers = engine.generate(prompt_token_ids=chunk, sampling_params=params, use_tqdm=False)
            out += [p + a.token_ids for p, a in zip(chunk, answers)]
    return out


def measure_speculation(target: str, head: Path, algorithm: str, prompts: list[list[int]],
                        new_tokens: int, device: str = "cpu") -> tuple[dict, list[list[int]]]:
    """Greedy answers to `prompts` through kestrel's Engine without speculation and with the head `head`
    (`algorithm`: "EAGLE" or "EAGLE3", what the head is) in each MEASURE_SETTINGS (steps/topk/draft
    tokens): the accept lengths (mean of the requests' meta spec_accept_length, and committed tokens over
    verify rounds of all requests together), wall seconds, and whether every output equals the plain
    greedy one token for token; and the plain greedy answers."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    results, plain = {}, None
    for name, setting in {"plain greedy": None, **MEASURE_SETTINGS}.items():
        spec = {} if setting is None else dict(
            speculative_algorithm=algorithm, speculative_draft_model_path=str(head), speculative_num_steps=setting[0],
            speculative_eagle_topk=setting[1], speculative_num_draft_tokens=setting[2])
        with Engine(model=target, device=device, dtype="float32", **spec) as engine:
            started = time.time()
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            seconds = round(time.time() - started, 1)
        tokens = [o.token_ids for o in outs]
        entry = {"seconds": seconds, "completion_tokens": sum(map(len, tokens))}
        if plain is None:
            plain = tokens
        else:
            rounds = sum(o.meta["spec_verify_ct"] for o in outs)
            committed = sum(k * n for o in outs for k, n in enumerate(o.meta["spec_accept_histogram"]))
            entry.update(
                mean_spec_accept_length=round(sum(o.meta["spec_accept_length"] for o in outs) / len(outs), 3),
                pooled_accept_length=round(committed / rounds, 3), verify_rounds=rounds,
                equals_plain_greedy=tokens == plain,
                requests_differing=sum(a != b for a, b in zip(tokens, plain)))
        results[name] = entry
    return results, plain
